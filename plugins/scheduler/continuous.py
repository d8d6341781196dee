"""Scheduler `continuous`: in-flight batching with a token budget, chunked prefill and
preemption by recompute (Orca's iteration-level scheduling as vLLM and SGLang run it).

Every step is planned afresh:

1. Running sequences, most urgent first, each get their uncomputed tokens (one for a decode;
   the next chunk of a prompt being prefilled in pieces) within ``max_num_batched_tokens``.
   When the cache cannot hold a sequence's next tokens, the least urgent running sequence is
   preempted (its blocks freed, its tokens recomputed later) until it can, or it preempts
   itself if it is the least urgent.
2. If nothing was preempted, waiting sequences join while the budget, ``max_num_seqs`` and
   the cache allow, taking cached prefix blocks first; a prompt longer than the remaining
   budget runs its first chunk now (``chunked_prefill``), so decodes are never starved by a
   long prompt.

Urgency: ``fcfs`` orders by arrival; ``priority`` by the request's priority (lower value
first), then arrival. A preempted sequence keeps its place in that order.
"""

from __future__ import annotations

import bisect
from typing import Literal

from pydantic import Field

import tessellm
from tessellm.core.interfaces.batch import ScheduledSeq, SchedulerOutput
from tessellm.core.errors import RequestRejectedError
from tessellm.core.plugin import PluginOptions
from tessellm.core.interfaces.scheduler import QueueScheduler
from tessellm.core.interfaces.sequence import Sequence, SequenceStatus, cut_chunk


class ContinuousOptions(PluginOptions):
    """Options of the `continuous` scheduler."""

    max_num_seqs: int = Field(64, ge=1, le=4096)
    """Most sequences running at once (forks of an n > 1 request count from admission)."""
    max_num_batched_tokens: int = Field(1024, ge=1, le=1_048_576)
    """Most query tokens in one step: decodes plus prefill chunks."""
    chunked_prefill: bool = True
    """Split prompts longer than the step's remaining budget across steps."""
    policy: Literal["fcfs", "priority"] = "fcfs"
    """Which sequences run (and are preempted last): first come first served, or by priority."""


class ContinuousScheduler(QueueScheduler):
    """In-flight batching: sequences join and leave every step under a token budget.

    Guarantees: every admitted request eventually runs (the most urgent sequence can always
    run alone, since admission rejects any request larger than the whole cache); a
    preempted sequence resumes with its output so far and produces the same tokens.
    """

    name = "continuous"
    api_version = "1.19"
    description = "in-flight batching: token budget, chunked prefill, preemption, fcfs/priority"
    Options = ContinuousOptions
    auto_priority = 50

    @property
    def max_step_tokens(self) -> int:
        return self.options.max_num_batched_tokens

    @property
    def max_step_seqs(self) -> int:
        return self.options.max_num_seqs

    def __init__(self, options: ContinuousOptions, cache, limits):
        super().__init__(options, cache, limits)
        self.waiting: list[Sequence] = []  # sorted by _urgency
        self.running: list[Sequence] = []
        self._running_sorted = True  # removals keep the order; only appends can break it

    def _urgency(self, seq: Sequence) -> tuple:
        if self.options.policy == "priority":
            return seq.priority, seq.arrival_time, seq.seq_id
        return seq.arrival_time, seq.seq_id

    # ------------------------------------------------------------------ admission

    def add(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.check_admission(seq)
            if not self.options.chunked_prefill and seq.num_prompt_tokens > self.options.max_num_batched_tokens:
                raise RequestRejectedError(
                    f"prompt has {seq.num_prompt_tokens} tokens but a step processes at most "
                    f"max_num_batched_tokens={self.options.max_num_batched_tokens} without chunked prefill; "
                    f"shorten the prompt or enable scheduler.options.chunked_prefill", field="prompt")
            if seq.joint and seq.group_size > self.options.max_num_batched_tokens:
                raise RequestRejectedError(
                    f"its {seq.group_size} sequences (beams) step together, but a step processes at most "
                    f"max_num_batched_tokens={self.options.max_num_batched_tokens} tokens; lower num_beams or raise it")
        for seq in seqs:
            self._wait(seq)

    def _wait(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._urgency)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.options.max_num_batched_tokens
        lookahead = self.limits.num_lookahead_tokens
        chosen: dict[int, ScheduledSeq] = {}
        if not self._running_sorted:  # a step of hundreds of sequences need not re-sort them all
            self.running.sort(key=self._urgency)
            self._running_sorted = True
        try_reserve = self.cache.try_reserve
        groups: dict[str, bool] = {}  # joint requests seen this step -> whether they fit the budget
        for seq in list(self.running):  # per sequence, hundreds a step: lengths spelled out
            if out.preempted and seq.status is not SequenceStatus.RUNNING:
                continue  # preempted to make room for a more urgent one
            if budget == 0:
                break
            if seq.joint and not self._group_fits(seq, budget, groups):
                continue
            computed = seq.num_computed_tokens
            remaining = len(seq.token_ids) + seq.num_pending - computed
            if remaining == 0:
                continue
            n = remaining if remaining <= budget else cut_chunk(seq, computed, budget)
            if n == 0:  # the chunk would end inside an image computed whole: it waits for room
                continue
            need = computed + n + (lookahead if n == remaining else 0)
            if not try_reserve(seq, need):
                while not self.cache.can_reserve(seq, need):
                    victim = self.running[-1]
                    budget += self._preempt(victim, chosen, out)
                    if victim is seq or seq.status is not SequenceStatus.RUNNING:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                self.cache.reserve(seq, need)
            chosen[seq.seq_id] = ScheduledSeq(seq, n)
            budget -= n
        if not out.preempted or not chosen:
            self._admit(budget, chosen, out, lookahead)
        out.scheduled = list(chosen.values())
        return out

    def _group_fits(self, seq: Sequence, budget: int, groups: dict[str, bool]) -> bool:
        """Whether a joint request's running members (beams) all get a token this step: decided
        at its first member, so the budget never splits a group's step."""
        fits = groups.get(seq.request_id)
        if fits is None:
            members = sum(1 for s in self.running if s.request_id == seq.request_id
                          and s.status is SequenceStatus.RUNNING and s.num_tokens > s.num_computed_tokens)
            fits = groups[seq.request_id] = members <= budget
        return fits

    def _preempt(self, seq: Sequence, chosen: dict[int, ScheduledSeq], out: SchedulerOutput) -> int:
        """Free ``seq``'s cache and send it back to wait (with the rest of its group, for a
        joint request: beams are preempted as one); return the budget they gave back."""
        if not seq.joint:
            return self._preempt_one(seq, chosen, out)
        group = [s for s in self.running if s.request_id == seq.request_id]
        return sum(self._preempt_one(s, chosen, out) for s in group)

    def _preempt_one(self, seq: Sequence, chosen: dict[int, ScheduledSeq], out: SchedulerOutput) -> int:
        self.running.remove(seq)
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        self._wait(seq)
        out.preempted.append(seq)
        item = chosen.pop(seq.seq_id, None)
        return item.num_query_tokens if item is not None else 0

    @staticmethod
    def _footprint(seq: Sequence) -> int:
        """Sequences ``seq`` will occupy: an n > 1 request not yet forked counts n."""
        return seq.group_size if seq.sample_index == 0 and seq.num_output_tokens == 0 else 1

    def _admit(self, budget: int, chosen: dict[int, ScheduledSeq], out: SchedulerOutput, lookahead: int) -> None:
        if not self.waiting or budget <= 0:  # the usual decode step: nobody to admit, no count needed
            return
        occupied = sum(self._footprint(s) for s in self.running)  # kept current below, not recounted per admission
        i = 0
        while i < len(self.waiting) and budget > 0:
            seq = self.waiting[i]
            if occupied and occupied + self._footprint(seq) > self.options.max_num_seqs:
                break
            if chosen and seq.num_computed_tokens == 0 and not self.cache.prefix_ready(seq):
                # its cached prefix is still being read (a disk tier): later ones go first,
                # while the step has other work (else it starts now, match_prefix waiting)
                i += 1
                continue
            if seq.num_computed_tokens == 0:
                seq.num_computed_tokens = self.cache.match_prefix(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = remaining if remaining <= budget else cut_chunk(seq, seq.num_computed_tokens, budget)
            # without chunked prefill a prompt waits for a step with room for all of it; a
            # preempted sequence, which may have outgrown any step, is recomputed in chunks
            if n == 0 or (n < remaining and not self.options.chunked_prefill and seq.num_output_tokens == 0):
                self._release(seq)
                break
            need = seq.num_computed_tokens + n + (lookahead if n == remaining else 0)
            while not self.cache.can_reserve(seq, need) and self._outranks(seq):
                victim = max(self.running, key=self._urgency)
                budget += self._preempt(victim, chosen, out)
                occupied = sum(self._footprint(s) for s in self.running)
            if not self.cache.can_reserve(seq, need):
                self._release(seq)  # head of line waits for memory: later ones must not overtake it
                break
            self.cache.reserve(seq, need)
            self.waiting.pop(i)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._running_sorted = False
            chosen[seq.seq_id] = ScheduledSeq(seq, n)
            budget -= n
            occupied += self._footprint(seq)

    def _outranks(self, seq: Sequence) -> bool:
        """Under the priority policy, whether waiting ``seq`` may preempt the least urgent
        running sequence (it is strictly more urgent by priority)."""
        if self.options.policy != "priority" or not self.running:
            return False
        return seq.priority < max(self.running, key=self._urgency).priority

    def _release(self, seq: Sequence) -> None:
        """Give back prefix blocks matched for a sequence that could not start after all."""
        self.cache.free(seq)
        seq.num_computed_tokens = 0

    # ------------------------------------------------------------------ bookkeeping

    def adopt(self, seq: Sequence) -> None:
        if seq.num_computed_tokens == 0:  # its cache could not be forked: recompute the prompt
            self._wait(seq)
        else:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._running_sorted = False


@tessellm.hookimpl
def register_scheduler(register):
    register(ContinuousScheduler)
