"""Logits processor `wrap-up`: once a request's output holds ``after`` tokens, every
end-of-sequence logit is raised by ``boost``, steering the model to finish.

A request names it with its arguments, offline
``SamplingParams(logits_processors=[{"name": "wrap-up", "args": {"after": 32, "boost": 4.0}}])``,
over the OpenAI API ``extra_body={"logits_processors": [...]}``; the engine validates the
arguments when the request arrives.

It keeps no state: it reads only how many output tokens each row follows
(``rows.num_output``, which counts a verification row's drafts and an overlapped step's
tokens still on the device), so it is ``overlap_safe``, and its index tensors are made with
``tessellm.to_device`` so that building them never waits for the device.
"""

from __future__ import annotations

import torch
from pydantic import Field

import tessellm


class WrapUpArgs(tessellm.PluginOptions):
    """Per-request arguments of `wrap-up`."""

    after: int = Field(0, ge=0, le=1_000_000)
    """Output tokens before the end-of-sequence logits are raised."""
    boost: float = Field(4.0, gt=0.0, le=1000.0)
    """Added to each end-of-sequence logit from then on (a banned one, at -inf, stays banned)."""


class WrapUp(tessellm.LogitsProcessor):
    """Raises the end-of-sequence logits by ``boost`` on the rows that follow at least ``after``
    output tokens."""

    name = "wrap-up"
    api_version = "1.9"
    Args = WrapUpArgs
    overlap_safe = True  # reads counts only

    def apply(self, logits: torch.Tensor, rows: tessellm.ProcessorRows) -> None:
        eos = sorted(t for t in self.ctx.eos_token_ids if t < self.ctx.vocab_size)
        due = [i for i, (args, count) in enumerate(zip(rows.args, rows.num_output)) if count >= args.after]
        if not eos or not due:
            return
        row_ids = [rows.rows[i] for i in due for _ in eos]
        token_ids = [token for _ in due for token in eos]
        boosts = [rows.args[i].boost for i in due for _ in eos]
        at = tessellm.to_device([row_ids, token_ids], torch.long, logits.device)
        logits.index_put_((at[0], at[1]), tessellm.to_device(boosts, logits.dtype, logits.device), accumulate=True)


@tessellm.hookimpl
def register_logits(register):
    register(WrapUp)
