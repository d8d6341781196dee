"""The decoder interface: logits in, accepted tokens out."""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from .batch import BatchMetadata, SchedulerOutput
from .model_spec import ModelSpec
from .plugin import Plugin, PluginOptions
from .sequence import SamplingParams, Sequence

if TYPE_CHECKING:
    from .llm import Pipeline


class Decoder(Plugin):
    """Turns a step's logits into tokens, proposing draft tokens first if it speculates.

    Contract:
    - ``num_lookahead_tokens``: the most draft tokens it proposes per sequence and step; the
      scheduler reserves that many extra slots.
    - ``bind(pipeline)`` is called once, after every part is built: a speculative decoder
      takes the model runner (layer-skip drafting), or builds a draft pipeline of its own.
    - ``check(params)`` raises ``InvalidRequestError`` for sampling parameters it cannot honor.
    - ``propose(out)`` returns seq_id -> draft tokens for the scheduled decoding sequences;
      the engine appends them to the sequence's query (plain decoders return {}). At most
      ``num_lookahead_tokens`` per sequence, and none for a sequence whose query is not its
      last uncomputed tokens or that has no output yet (the step that may fork it, n > 1).
    - ``decode(logits, batch)`` gets logits [R, vocab] (float32, or float64 in a float64 pipeline) for ``batch.logits_indices``
      and returns, for each ``batch.samples`` slot in order, the accepted tokens: exactly one
      for plain decoding, 1 to k+1 when verifying k drafts (accepted drafts, then one token
      sampled from the target). The engine keeps the KV of accepted drafts and rolls the rest
      back.
    - ``finish(seq)`` is called once when a sequence finishes or is aborted: release any
      per-sequence state (a draft model's cache, an n-gram index).
    - Optional, for async scheduling: ``samples_on_device(params)`` says whether it can pick a
      request's tokens without the host, and ``device_tokens(logits, batch)`` then returns
      one token per sample slot as a device tensor (no host synchronisation), exactly the
      tokens ``decode`` would return. A decoder whose ``device_tokens`` only ranks each
      row's logits (an argmax) sets ``device_tokens_any_dtype``: it may then be handed them
      in the model's dtype (bfloat16 on a GPU), which spares a float32 copy of the batch's
      logits every step and changes no token (the conversion is exact and keeps the order).
    """

    kind: ClassVar[str] = "decoding"
    num_lookahead_tokens: int = 0
    device_tokens_any_dtype: ClassVar[bool] = False

    def __init__(self, options: PluginOptions, model: ModelSpec, device: torch.device):
        self.options = options
        self.model = model
        self.device = device

    def bind(self, pipeline: Pipeline) -> None:
        """Take what the decoder needs from the assembled pipeline; nothing by default."""

    def check(self, params: SamplingParams) -> None:
        """Raise InvalidRequestError if ``params`` ask for what this decoder cannot do."""

    def propose(self, out: SchedulerOutput) -> dict[int, list[int]]:
        """Draft tokens per decoding sequence; none by default."""
        return {}

    def finish(self, seq: Sequence) -> None:
        """Forget ``seq``'s per-sequence state; nothing by default."""

    def samples_on_device(self, params: SamplingParams) -> bool:
        """Whether ``device_tokens`` serves requests with ``params``; no by default."""
        return False

    def device_tokens(self, logits: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
        """[len(batch.samples)] tokens on the logits' device, for requests that
        ``samples_on_device`` accepted."""
        raise NotImplementedError(f"decoding plugin {self.name!r} does not sample on the device")

    @abstractmethod
    def decode(self, logits: torch.Tensor, batch: BatchMetadata) -> list[list[int]]:
        """Accepted tokens for each sample slot of ``batch``."""


def slot_logits(logits: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
    """The logits row of each sample slot's first row, [len(batch.samples), vocab]. In a
    plain decode step that is every row in order, returned as is (no gather, no host-to-device
    index copy)."""
    first = [s.first_row for s in batch.samples]
    if len(first) == logits.shape[0] and first == list(range(len(first))):
        return logits
    return logits[torch.tensor(first, dtype=torch.long, device=logits.device)]
