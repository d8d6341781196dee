"""Scheduler `static`: first come, first served, one fixed batch at a time.

A batch of up to ``max_batch_size`` waiting sequences is prefilled together and decoded
together until every one has finished; only then does the next batch start. This is what
transformers' padded ``generate`` does, without the padding, and the baseline continuous
batching improves on.
"""

from __future__ import annotations

from collections import deque

from pydantic import Field

import tessellm
from tessellm.core.interfaces.batch import ScheduledSeq, SchedulerOutput
from tessellm.core.plugin import PluginOptions
from tessellm.core.interfaces.scheduler import QueueScheduler
from tessellm.core.interfaces.sequence import Sequence, SequenceStatus


class StaticOptions(PluginOptions):
    """Options of the `static` scheduler."""

    max_batch_size: int = Field(16, ge=1, le=4096)
    """Sequences per batch (a request with n samples counts n)."""


class StaticScheduler(QueueScheduler):
    """FCFS static batching. When the cache cannot grow a running sequence, the sequence
    admitted last is preempted (its cache freed, recomputed in a later batch)."""

    name = "static"
    api_version = "1.19"
    description = "FCFS static batches: a new batch starts when the last one has finished"
    Options = StaticOptions
    auto_priority = 10

    @property
    def max_step_seqs(self) -> int:
        return self.options.max_batch_size

    def __init__(self, options, cache, limits):
        super().__init__(options, cache, limits)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.check_admission(seq)
        self.waiting.extend(seqs)

    def _start_batch(self) -> list[Sequence]:
        batch: list[Sequence] = []
        width = 0
        i = 0
        while i < len(self.waiting):
            seq = self.waiting[i]
            cost = seq.group_size if seq.num_output_tokens == 0 else 1  # its forks join this batch
            if width and width + cost > self.options.max_batch_size:
                break
            if batch and seq.num_computed_tokens == 0 and not self.cache.prefix_ready(seq):
                # its cached prefix is still being read (a disk tier): later ones go first,
                # while the batch has others (else it starts now, match_prefix waiting)
                i += 1
                continue
            if seq.num_computed_tokens == 0:
                seq.num_computed_tokens = self.cache.match_prefix(seq)
            if not self.cache.can_reserve(seq, seq.num_tokens):
                # a waiting sequence holds no blocks: matched prefix blocks it keeps could
                # leave the whole cache to sequences that cannot start (nothing would run)
                self.cache.free(seq)
                seq.num_computed_tokens = 0
                break
            self.cache.reserve(seq, seq.num_tokens)
            del self.waiting[i]
            seq.status = SequenceStatus.RUNNING
            batch.append(seq)
            width += cost
        return batch

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Send ``seq`` back to wait, with the rest of its group for a joint request (beams)."""
        group = [s for s in self.running if s.request_id == seq.request_id] if seq.joint else [seq]
        for member in reversed(group):
            self._preempt_one(member, out)

    def _preempt_one(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if not self.running:
            self.running = self._start_batch()
            out.scheduled = [ScheduledSeq(s, s.num_tokens - s.num_computed_tokens) for s in self.running]
            return out
        lookahead = self.limits.num_lookahead_tokens
        for seq in list(self.running):
            if seq not in self.running:  # preempted while making room for an earlier one
                continue
            need = seq.num_tokens + lookahead
            while not self.cache.can_reserve(seq, need) and self.running[-1] is not seq and seq in self.running:
                self._preempt(self.running[-1], out)
            if seq not in self.running:  # preempted with its group
                continue
            if not self.cache.can_reserve(seq, need):
                self._preempt(seq, out)
                continue
            self.cache.reserve(seq, need)
        # a sequence whose last token is still on the device (async scheduling) has nothing to run
        out.scheduled = [ScheduledSeq(s, n) for s in self.running if (n := s.num_tokens - s.num_computed_tokens)]
        if not self.running and self.waiting:  # every one was preempted: the next batch starts
            return self.schedule()
        return out

    def adopt(self, seq: Sequence) -> None:
        if seq.num_computed_tokens == 0:  # no room to fork its cache: recompute in a later batch
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        else:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)


@tessellm.hookimpl
def register_scheduler(register):
    register(StaticScheduler)
