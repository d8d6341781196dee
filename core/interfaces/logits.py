"""The logits-processor interface: per-request transformations of the logits a decoder picks
from (penalties, banned words, allowed tokens, a bias, a grammar's mask), applied by the engine
for every decoder, batched over the rows of one step.

A request turns a processor on through its ``SamplingParams``: a built-in reads its own field
(``presence_penalty``, ``bad_words``, ...), any other processor an entry of
``params.logits_processors`` naming it with its arguments. The engine binds each request to
the processors it uses when it arrives (bad arguments are refused then, naming the processor),
and in every step hands each processor that some row of the step uses the rows that use it,
in one call.

A row's history is its sequence's tokens (prompt, then output), then, for a speculative
verification row, the draft tokens before it: row j of a slot that verifies k drafts is
transformed as if drafts 0..j-1 had been accepted. Draft tokens never enter a processor's
state; only accepted tokens do (``accept``), so rejected drafts leave nothing to undo.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from pydantic import ValidationError

from tessellm.core.errors import InvalidRequestError, validation_problems
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.core.plugin import Plugin, PluginOptions


@dataclass(frozen=True)
class ProcessorContext:
    """What a logits processor may use of its pipeline, given when it is built.

    - ``vocab_size``: the width of the logits rows (the model's vocabulary, which may be
      padded past the tokenizer's).
    - ``device``: where the logits live.
    - ``eos_token_ids``: the model's end-of-sequence ids.
    - ``encode(text)``: the tokenizer's ids for ``text``, without special tokens.
    - ``max_model_len``: the context window (no history is longer).
    """

    vocab_size: int
    device: torch.device
    eos_token_ids: frozenset[int]
    encode: Callable[[str], list[int]]
    max_model_len: int


@dataclass
class ProcessorRows:
    """The rows of one step's logits that one processor transforms (each row once, though the
    samples of an ``n > 1`` request share their first row), and what each row follows.

    Per row ``i``: ``rows[i]`` is its index in the logits; ``seqs[i]`` its sequence;
    ``args[i]`` the request's validated arguments; ``drafts[i]`` the draft tokens it follows
    past the sequence's tokens (empty but on verification rows after the first);
    ``num_output[i]`` how many output tokens it follows (the sequence's output, tokens still
    on the device included, then its drafts). ``index`` is ``rows`` on the logits' device.
    """

    rows: list[int]
    seqs: list[Sequence]
    args: list[Any]
    drafts: list[tuple[int, ...]]
    num_output: list[int]
    index: torch.Tensor = field(repr=False)

    def __len__(self) -> int:
        return len(self.rows)

    def history(self, i: int) -> list[int]:
        """Row ``i``'s tokens on the host: prompt, output, then its drafts. (A token still on the
        device, in an overlapped step, is not among them: a processor that needs token values
        does not run in the overlapped step.)"""
        return self.seqs[i].token_ids + list(self.drafts[i])


PROCESSOR_FIELDS: tuple[str, ...] = ("presence_penalty", "frequency_penalty", "repetition_penalty", "bad_words",
                                     "bad_words_ids", "allowed_token_ids", "no_repeat_ngram_size", "min_tokens",
                                     "logit_bias", "structured_output")
"""The ``SamplingParams`` fields that built-in logits processors apply (each declares its
own in ``fields``). A request that sets one no installed processor reads (its plugin disabled
with ``TESSELLM_DISABLE_PLUGINS``) is refused rather than served without it."""


def to_device(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a list, nested lists) as a tensor on ``device``, copied without waiting for
    the device's queued work (pinned memory, a non-blocking copy): what an overlap-safe
    processor builds its per-step index and value tensors with."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class LogitsProcessor(Plugin):
    """Transforms the logits rows of the requests that use it, in place, once per step.

    Contract:
    - ``Args``: the per-request arguments, a ``PluginOptions`` model. ``request_args(params)``
      returns a request's arguments validated, or None when the request does not use the
      processor. By default a request uses it by naming it in ``params.logits_processors``
      (``{"name": ..., "args": {...}}``); a built-in that reads a ``SamplingParams`` field
      overrides ``request_args``. Arguments that do not validate raise
      ``InvalidRequestError`` naming the processor (the engine asks when the request
      arrives, so no step meets a bad one).
    - ``order``: where it runs among the step's processors (lower first): the built-ins'
      penalties at 10-20, the bias at 30, bans at 40, third-party processors at 50 by
      default, the grammar's mask last (100), so no processor can give back a token the
      grammar forbids.
    - ``apply(logits, rows)`` transforms ``logits[rows.rows]`` in place (float32, or float64
      in a float64 pipeline; the engine's copy, the model's own logits stay for
      log-probabilities), one vectorized call for every row that uses it; other rows must not
      change. (A processor that is not tessellm's own is handed a tensor of its own rows
      only, ``rows.rows`` then counting from 0; ``TESSELLM_CHECK_CONTRACTS=1`` checks the
      rule instead.) Setting a logit to -inf bans a token; a processor must leave each row at least
      one finite logit when the row came with one.
    - State: a processor may keep per-sequence state, a function of the tokens accepted so
      far. ``add(seq, args)`` builds it from the sequence's tokens when the sequence starts
      using the processor (on arrival, and for each sample an ``n > 1`` request forks, which
      arrives with its parent's tokens); ``accept(updates)`` advances it by the tokens the
      engine appended, ``[(seq, tokens), ...]``, after each step; ``remove(seq)`` forgets it
      when the sequence finishes or is aborted. Tokens are never taken back once accepted:
      drafts reach a processor only as ``rows.drafts``, so a rejected draft needs no rollback,
      and a preempted sequence keeps its tokens (it is recomputed, not re-generated), so its
      state stays valid. The conformance suite holds a processor to all of this: accepting
      tokens one step at a time equals ``add`` on the whole history, drafts leave no trace,
      a batch equals each row alone.
    - ``overlap_safe``: whether it may run in the overlapped step of async scheduling, where
      the previous step's tokens are still on the device: ``apply`` must then not wait for
      the device (no ``.item()``, ``.tolist()``, ``.cpu()`` of device tensors) and may rely
      only on counts (``rows.num_output``) and on state that ``accept_on_device(seqs,
      tokens)`` advanced with those tokens on the device (called right after the overlapped
      step picks them; ``accept`` is then not called for them). A request using a processor
      that is not overlap-safe runs through the synchronous step.
    """

    kind: ClassVar[str] = "logits"
    Args: ClassVar[type[PluginOptions]] = PluginOptions
    order: ClassVar[int] = 50
    overlap_safe: ClassVar[bool] = False
    fields: ClassVar[tuple[str, ...]] = ()
    """The ``SamplingParams`` fields a built-in reads in its ``request_args`` (it is then
    turned on by those fields, and naming it in ``logits_processors`` is refused); empty for a
    processor turned on by name."""

    def __init__(self, options: PluginOptions, ctx: ProcessorContext):
        self.options = options
        self.ctx = ctx

    # ---------------------------------------------------------------- per request

    def request_args(self, params: SamplingParams) -> PluginOptions | None:
        """The arguments ``params`` give this processor, validated; None when it is unused."""
        named = [p for p in params.logits_processors if p.name == self.name]
        if not named:
            return None
        if len(named) > 1:
            raise InvalidRequestError(f"logits processor {self.name!r} is named {len(named)} times in "
                                      f"logits_processors; name it once")
        return self.validate_args(named[0].args)

    def validate_args(self, raw: dict[str, Any]) -> PluginOptions:
        """``raw`` validated by ``Args`` (InvalidRequestError naming this processor and what it takes)."""
        try:
            return self.Args.model_validate(raw)
        except ValidationError as exc:
            takes = ", ".join(self.Args.model_fields) or "no arguments"
            raise InvalidRequestError(f"logits processor {self.name!r} refuses its args (it takes: {takes}): "
                                      f"{validation_problems(exc, 'args.')}") from None

    # ---------------------------------------------------------------- per step

    def apply(self, logits: torch.Tensor, rows: ProcessorRows) -> None:
        """Transform ``logits`` in place on ``rows``."""
        raise NotImplementedError

    required: ClassVar[tuple[str, ...]] = ("apply",)

    # ---------------------------------------------------------------- per-sequence state

    def add(self, seq: Sequence, args: PluginOptions) -> None:
        """``seq`` starts using this processor with ``args``; its tokens so far are
        ``seq.token_ids``. Nothing by default (a stateless processor)."""

    def accept(self, updates: list[tuple[Sequence, list[int]]]) -> None:
        """The tokens the engine appended to each sequence in a step. Nothing by default."""

    def accept_on_device(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        """An overlapped step picked ``tokens[i]`` (on the device) for ``seqs[i]``: advance
        the state without reading them on the host. Nothing by default (a processor whose
        state does not follow token values)."""

    def remove(self, seq: Sequence) -> None:
        """Forget ``seq``. Nothing by default."""

