"""The scheduler interface: which sequences run in each step."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from tessellm.core.interfaces.batch import SchedulerOutput
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.errors import RequestRejectedError
from tessellm.core.plugin import Plugin, PluginOptions
from tessellm.core.interfaces.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerLimits:
    """Limits the engine imposes on any scheduler."""

    max_model_len: int
    """No sequence may grow past this many tokens."""
    num_lookahead_tokens: int = 0
    """Extra slots to reserve for each decoding sequence (the decoder's draft tokens)."""


class Scheduler(Plugin):
    """Decides, step by step, which sequences run and how many tokens each processes.

    Contract:
    - ``add(seqs)`` admits a request's sequences or raises ``RequestRejectedError`` if it can
      never be served (prompt + max_tokens over ``max_model_len`` or over
      ``cache.max_seq_tokens``); an admitted request is never dropped.
    - ``schedule()`` returns the step's sequences with their query-token counts, having
      reserved cache slots for each (``cache.reserve(seq, computed + query + lookahead)``
      for decoding sequences). A sequence is scheduled with all its uncomputed tokens or, for
      prefill chunks, a prefix of them. Preempted sequences have had their cache freed and
      ``num_computed_tokens`` reset to 0; they are recomputed later.
    - ``adopt(seq)`` takes over a running sequence forked from a scheduled one (n > 1).
    - ``finish(seq)`` removes a finished or aborted sequence and frees its cache.

    Duties the engine leaves to the scheduler (prefix caching silently stops if one is missed):
    - ``seq.status`` is the scheduler's to set: ``RUNNING`` when a sequence starts,
      ``WAITING`` when it goes back to the queue (preempted, or adopted without a cache).
    - Before a sequence with nothing computed starts, ``seq.num_computed_tokens =
      cache.match_prefix(seq)`` (the tokens its cached prefix covers); one that then cannot
      start is given back with ``cache.free(seq)`` and its count reset: a waiting sequence
      holds no blocks.
    - A request's sequence with no output yet costs ``seq.params.n`` seats: its samples fork
      from it after the prompt and come back through ``adopt``.
    """

    kind: ClassVar[str] = "scheduler"

    def __init__(self, options: PluginOptions, cache: CacheManager, limits: SchedulerLimits):
        self.options = options
        self.cache = cache
        self.limits = limits

    @property
    def max_step_tokens(self) -> int | None:
        """The most query tokens one step can hold (None: no fixed budget). Start-up warm-up
        runs a step of this size."""
        return None

    @property
    def max_step_seqs(self) -> int | None:
        """The most sequences one step can hold (None: no fixed limit). No decode batch is
        larger, so no CUDA graph is captured for a larger one."""
        return None

    def check_admission(self, seq: Sequence) -> None:
        """Raise RequestRejectedError if ``seq`` could never run to its max_tokens."""
        need = seq.num_prompt_tokens + seq.params.max_tokens
        if need > self.limits.max_model_len:
            raise RequestRejectedError(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.params.max_tokens}) = {need} "
                f"exceeds the context window (max_model_len {self.limits.max_model_len}); shorten the prompt "
                f"or lower max_tokens to at most {max(self.limits.max_model_len - seq.num_prompt_tokens, 0)}",
                field="prompt")
        room = self.cache.max_seq_tokens
        if need + self.limits.num_lookahead_tokens > room:
            raise RequestRejectedError(
                f"prompt + max_tokens = {need} tokens (+{self.limits.num_lookahead_tokens} lookahead) can never "
                f"fit in the KV cache, which holds at most {room} tokens per sequence; enlarge the cache",
                field="prompt")

    @abstractmethod
    def add(self, seqs: list[Sequence]) -> None:
        """Admit the sequences of one request (raises RequestRejectedError)."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch."""

    @abstractmethod
    def adopt(self, seq: Sequence) -> None:
        """Run ``seq``, forked from a running sequence, from the next step on."""

    @abstractmethod
    def finish(self, seq: Sequence) -> None:
        """Forget ``seq`` (finished or aborted) and free its cache."""

    @abstractmethod
    def unfinished(self) -> list[Sequence]:
        """Every admitted sequence not yet finished (waiting or running)."""

    def running_sequences(self) -> list[Sequence]:
        """The unfinished sequences that are running (not waiting); read-only for callers."""
        return [s for s in self.unfinished() if s.status is SequenceStatus.RUNNING]

    @property
    @abstractmethod
    def num_waiting(self) -> int: ...

    @property
    @abstractmethod
    def num_running(self) -> int: ...


class QueueScheduler(Scheduler):
    """A scheduler keeping its sequences in two collections, ``running`` and ``waiting``
    (lists or deques, in the subclass's order); it implements the bookkeeping from them."""

    running: list[Sequence]
    waiting: Any

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.free(seq)

    def unfinished(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def running_sequences(self) -> list[Sequence]:
        return self.running

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
