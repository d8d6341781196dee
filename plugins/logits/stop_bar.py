"""``min_tokens``: EOS and the request's stop ids are barred until the output is long enough."""

from __future__ import annotations

from typing import Optional

import torch
from pydantic import Field

import tessellm
from tessellm.core.interfaces.logits import LogitsProcessor, ProcessorRows, to_device
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.core.plugin import PluginOptions
from tessellm.core.version import PLUGIN_API_VERSION


class MinTokensArgs(PluginOptions):
    min_tokens: int = Field(1, ge=1)
    """Output tokens before a stop id may be picked."""
    stop_ids: tuple[int, ...] = ()
    """The ids barred until then: EOS (unless ignore_eos) and the request's stop_token_ids."""


class MinTokens(LogitsProcessor):
    """Sets EOS and each stop token id to -inf on the rows of sequences with fewer than
    ``min_tokens`` output tokens at that row (a verification row counts the drafts before it;
    an overlapped step counts the tokens still on the device), so the output never stops early,
    unless nothing else is left to pick (another processor banned the rest). Stateless: it
    reads only counts, so it runs in the overlapped step."""

    name = "min_tokens"
    api_version = PLUGIN_API_VERSION
    order = 40
    overlap_safe = True
    fields = ("min_tokens",)
    Args = MinTokensArgs

    def request_args(self, params: SamplingParams) -> Optional[MinTokensArgs]:
        if not params.min_tokens:
            return None
        ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.ctx.eos_token_ids))
        return MinTokensArgs(min_tokens=params.min_tokens,
                             stop_ids=tuple(sorted(t for t in ids if t < self.ctx.vocab_size)))

    def apply(self, logits: torch.Tensor, rows: ProcessorRows) -> None:
        barred: list[int] = []  # rows still short of min_tokens
        local: list[int] = []
        cols: list[int] = []
        for row, args, out in zip(rows.rows, rows.args, rows.num_output):
            if out < args.min_tokens and args.stop_ids:
                local.extend([len(barred)] * len(args.stop_ids))
                cols.extend(args.stop_ids)
                barred.append(row)
        if not barred:
            return
        device = logits.device
        index = to_device(barred, torch.long, device)
        view = logits.index_select(0, index)
        ban = torch.zeros_like(view, dtype=torch.bool)
        at = to_device([local, cols], torch.long, device)
        ban[at[0], at[1]] = True
        # a row whose only finite logits are stop ids (another processor banned the rest) keeps them
        ban &= (view.isfinite() & ~ban).any(dim=-1, keepdim=True)
        logits.index_copy_(0, index, view.masked_fill_(ban, float("-inf")))


@tessellm.hookimpl
def register_logits(register):
    register(MinTokens)
