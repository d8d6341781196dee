"""``logit_bias`` (OpenAI's): a per-token bias added to the logits."""

from __future__ import annotations

from typing import Optional

import torch

import tessellm
from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.logits import LogitsProcessor, ProcessorRows, to_device
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.core.plugin import PluginOptions
from tessellm.core.version import PLUGIN_API_VERSION


class LogitBiasArgs(PluginOptions):
    token_ids: tuple[int, ...] = ()
    """The biased token ids."""
    values: tuple[float, ...] = ()
    """The bias of each of ``token_ids``, in [-100, 100]."""


class LogitBias(LogitsProcessor):
    """Adds each request's ``logit_bias`` to its rows: -100 all but bans a token, 100 all but
    forces it. Stateless, so it runs in the overlapped step."""

    name = "logit_bias"
    api_version = PLUGIN_API_VERSION
    order = 30
    overlap_safe = True
    fields = ("logit_bias",)
    Args = LogitBiasArgs

    def request_args(self, params: SamplingParams) -> Optional[LogitBiasArgs]:
        if not params.logit_bias:
            return None
        outside = [t for t in params.logit_bias if t >= self.ctx.vocab_size]
        if outside:
            raise InvalidRequestError(f"logit_bias token id {outside[0]} is outside the vocabulary "
                                      f"[0, {self.ctx.vocab_size})")
        ids = sorted(params.logit_bias)
        return LogitBiasArgs(token_ids=tuple(ids), values=tuple(params.logit_bias[t] for t in ids))

    def apply(self, logits: torch.Tensor, rows: ProcessorRows) -> None:
        row_ids: list[int] = []
        col_ids: list[int] = []
        values: list[float] = []
        for row, args in zip(rows.rows, rows.args):
            row_ids.extend([row] * len(args.token_ids))
            col_ids.extend(args.token_ids)
            values.extend(args.values)
        index = to_device([row_ids, col_ids], torch.long, logits.device)
        logits.index_put_((index[0], index[1]), to_device(values, logits.dtype, logits.device), accumulate=True)


@tessellm.hookimpl
def register_logits(register):
    register(LogitBias)
