"""The repetition penalties: ``repetition_penalty`` (transformers' and vLLM's, over the prompt
and the output) and ``presence_penalty`` with ``frequency_penalty`` (OpenAI's, over the
output).

Both keep each sequence's tokens on the device (``TokenHistory``) and touch only the logits of
tokens a row holds, so they run in the overlapped step and cost little beside the forward.
"""

from __future__ import annotations

from typing import Optional

import torch
from pydantic import Field

import tessellm
from tessellm.core.interfaces.logits import LogitsProcessor, ProcessorRows, to_device
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.core.plugin import PluginOptions
from tessellm.core.version import PLUGIN_API_VERSION
from tessellm.plugins.logits.history import TokenHistory, flat_index


class _OnDeviceHistory(LogitsProcessor):
    """A processor whose state is each sequence's tokens on the device: overlap-safe."""

    overlap_safe = True

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.history = TokenHistory(ctx.device)

    def add(self, seq: Sequence, args: PluginOptions) -> None:
        self.history.add(seq)

    def accept(self, updates: list[tuple[Sequence, list[int]]]) -> None:
        self.history.extend(updates)

    def accept_on_device(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        self.history.extend_on_device(seqs, tokens)

    def remove(self, seq: Sequence) -> None:
        self.history.remove(seq)


class RepetitionPenaltyArgs(PluginOptions):
    penalty: float = Field(1.0, gt=0.0, le=10.0)
    """Divides a held token's positive logit, multiplies its negative one."""


class RepetitionPenalty(_OnDeviceHistory):
    """transformers' ``RepetitionPenaltyLogitsProcessor`` and vLLM's ``repetition_penalty``:
    each token the prompt, the output or the drafts before the row hold has its logit divided by
    the penalty where positive and multiplied by it where negative (once per token, however
    often it occurs)."""

    name = "repetition_penalty"
    api_version = PLUGIN_API_VERSION
    order = 10
    fields = ("repetition_penalty",)
    Args = RepetitionPenaltyArgs

    def request_args(self, params: SamplingParams) -> Optional[RepetitionPenaltyArgs]:
        if params.repetition_penalty == 1.0:
            return None
        return RepetitionPenaltyArgs(penalty=params.repetition_penalty)

    def apply(self, logits: torch.Tensor, rows: ProcessorRows) -> None:
        held = self.history.window(rows, outputs_only=False)
        if held is None:
            return
        # [R, L]: every position, padding included, computes the value of a token its row holds
        flat = flat_index(logits, rows.index, held.ids)
        score = logits.view(-1).index_select(0, flat).view(held.ids.shape)
        penalty = to_device([a.penalty for a in rows.args], logits.dtype, logits.device)[:, None]
        penalized = torch.where(score < 0, score * penalty, score / penalty)
        if held.nonempty is not None:  # a row holding no token writes its logits back unchanged
            penalized = torch.where(held.nonempty, penalized, score)
        logits.view(-1).index_copy_(0, flat, penalized.reshape(-1))


class PresenceFrequencyArgs(PluginOptions):
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """Subtracted once from each token the output holds."""
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """Subtracted once per occurrence of a token in the output."""


class PresenceFrequencyPenalty(_OnDeviceHistory):
    """OpenAI's presence and frequency penalties, over the output (and the drafts before the
    row), not the prompt: ``logit[t] -= frequency * count[t] + presence * (count[t] > 0)``."""

    name = "presence_frequency"
    api_version = PLUGIN_API_VERSION
    order = 20
    fields = ("presence_penalty", "frequency_penalty")
    Args = PresenceFrequencyArgs

    def request_args(self, params: SamplingParams) -> Optional[PresenceFrequencyArgs]:
        if params.presence_penalty == 0.0 and params.frequency_penalty == 0.0:
            return None
        return PresenceFrequencyArgs(presence_penalty=params.presence_penalty,
                                     frequency_penalty=params.frequency_penalty)

    def apply(self, logits: torch.Tensor, rows: ProcessorRows) -> None:
        held = self.history.window(rows, outputs_only=True)
        if held is None:
            return
        values = to_device([[a.presence_penalty, a.frequency_penalty] for a in rows.args], logits.dtype,
                           logits.device)
        flat = flat_index(logits, rows.index, held.ids)
        flat_logits = logits.view(-1)
        # presence: every position of a token writes the same value, so it counts once (a row
        # holding no token writes its logits back unchanged)
        presence = values[:, :1] if held.nonempty is None else values[:, :1].masked_fill(~held.nonempty, 0)
        shifted = flat_logits.index_select(0, flat).view(held.ids.shape) - presence
        flat_logits.index_copy_(0, flat, shifted.reshape(-1))
        # frequency: once per occurrence (padding adds -0.0, which changes nothing). The addends of
        # one logit are all equal, so their order, which a device may vary, cannot change the sum.
        frequency = torch.where(held.valid, -values[:, 1:], -0.0)
        flat_logits.index_add_(0, flat, frequency.reshape(-1))


@tessellm.hookimpl
def register_logits(register):
    register(RepetitionPenalty)
    register(PresenceFrequencyPenalty)
