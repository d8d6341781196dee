"""Async scheduling: each step is scheduled and launched before the previous step's tokens
reach the host, and the previous step is then absorbed while the GPU runs this one, so the
host's work leaves the critical path (vLLM's and SGLang's overlap scheduling).

Scheduling needs token counts, not token values: a launched step's sampled tokens count in
their sequences' lengths at once (``Sequence.num_pending``) and stay on the device, where the
next step takes its inputs from them. So decodes, prefill chunks and admissions can all be
planned ahead, as long as every sequence picks its tokens on the device (the decoder's
``samples_on_device``; no drafts, no logprobs). What a launched step finishes is learnt a
step late: a sequence ended by a stop token runs one wasted row, and its place is offered to
the queue one step later, as in vLLM. Any other step runs synchronously (``Engine``'s step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from tessellm.core.engine import contracts
from tessellm.core.engine.batch_builder import build_batch
from tessellm.core.engine.engine import Engine
from tessellm.core.interfaces.batch import BatchMetadata, SchedulerOutput
from tessellm.core.interfaces.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class LaunchedStep:
    """A step whose sampled tokens are still on their way to the host."""

    out: SchedulerOutput
    batch: BatchMetadata
    tokens: torch.Tensor  # [samples] on the device: the next step's inputs are taken from here
    host: torch.Tensor  # their copy on the host (pinned), complete once ``ready`` is
    ready: Any  # a CUDA event, or None on the CPU (the copy is done)
    holds_pending: set[int]  # seq_ids whose ``num_pending`` counts this step's token
    start: float


class OverlappedEngine(Engine):
    """``Engine`` with async scheduling: at most one step is in flight; ``step`` launches the
    next one when it can and then absorbs the one before, so it returns the requests that the
    previous step finished. Outputs equal the synchronous engine's."""

    async_scheduling = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._in_flight: LaunchedStep | None = None
        self._device_ok: dict[int, bool] = {}  # seq_id -> _samples_on_device, kept once it cannot change

    def has_unfinished(self) -> bool:
        return self._in_flight is not None or super().has_unfinished()

    def _step(self) -> None:
        if self._in_flight is not None and not self._can_overlap():
            self._collect_in_flight()  # the next schedule needs its tokens
        out = self._schedule()
        if out.is_empty:
            if self._in_flight is not None:
                self._collect_in_flight()
            elif self.scheduler.unfinished():
                self._check_idle()
            return
        if self._launchable(out) and self._launch_ahead(out):
            return
        if self._in_flight is not None:  # a synchronous step: nothing may stay in flight
            self._collect_in_flight()
            out.scheduled = [i for i in out.scheduled if not i.seq.is_finished]
        if out.scheduled:
            self._run_step(out)

    def _launch_ahead(self, out: SchedulerOutput) -> bool:
        """Launch ``out``, then absorb the step before it; False if the launch raised (the
        step then runs synchronously, where a failing request fails alone)."""
        previous = self._in_flight
        try:
            self._in_flight = self._launch(out, previous)
        except Exception:
            return False
        if previous is not None:
            self._collect(previous)
        return True

    # ------------------------------------------------------------------ what may overlap

    def _samples_on_device(self, seq: Sequence) -> bool:
        """Whether ``seq``'s next token can be picked on the device and left there a step
        (asked of every live sequence every step: the answer is kept once it cannot change)."""
        ok = self._device_ok.get(seq.seq_id)
        if ok is not None:
            return ok
        params = seq.params
        state = self.requests.get(seq.request_id)
        settled = params.n == 1 or state is None or state.forked  # n > 1 changes when it forks
        ok = (self.decoder.num_lookahead_tokens == 0 and params.logprobs is None and params.prompt_logprobs is None
              and self.processors.overlap_safe(seq) and self.decoder.samples_on_device(params) and settled)
        if settled:
            self._device_ok[seq.seq_id] = ok
        return ok

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the in-flight step's tokens arrive:
        every running sequence picks its tokens on the device."""
        known, ok = self._device_ok, self._samples_on_device  # a kept answer skips the call
        return all(known.get(s.seq_id) or ok(s) for s in self.scheduler.running_sequences())

    def _launchable(self, out: SchedulerOutput) -> bool:
        """Whether ``out`` can run without the host waiting for its tokens: every scheduled
        sequence (decoding, prefilling or just admitted) picks its tokens on the device, and
        has a token to run (a scheduler may list one whose last token is still pending)."""
        known, ok = self._device_ok, self._samples_on_device
        return all(i.num_query_tokens and (known.get(i.seq.seq_id) or ok(i.seq)) for i in out.scheduled)

    # ------------------------------------------------------------------ launch and collect

    def _launch(self, out: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        """Run a step up to its sampled tokens, which stay on the device (a copy to the host
        is queued). Nothing about the sequences changes unless it all succeeds."""
        start = time.perf_counter()
        device = self.runner.device
        # (lengths spelled out in this method's per-sequence loops: hundreds of sequences a step)
        decodes = all(i.num_query_tokens == 1 and
                      i.seq.num_computed_tokens + 1 == len(i.seq.token_ids) + i.seq.num_pending
                      for i in out.scheduled)
        batch = build_batch(out.scheduled, self.cache, device, decodes_only=decodes)
        if self._kv_check.always:
            contracts.check_slots_not_held(self.cache, contracts.query_slots(batch),
                                           list(self.scheduler.running_sequences()))
        if previous is not None:
            self._inputs_from(previous, batch, decodes)
        plan = self.processors.plan(batch)
        phase = self.stats.add_phase("prepare", start)
        # processors run on float32 logits, as in the synchronous step, so both pick the same tokens
        logits = self._forward(batch, native_logits=self.decoder.device_tokens_any_dtype and not plan)
        phase = self.stats.add_phase("forward", phase)
        tokens = self.decoder.device_tokens(self.processors.apply(logits, plan), batch)
        contracts.check_device_tokens(self.decoder, tokens, batch)
        host, ready = tokens, None
        if tokens.is_cuda:  # pinned, so the copy waits for this step only, not for the next
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        self.stats.overlapped_steps += previous is not None
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_query_tokens
        # the coming tokens count in their sequences' lengths, unless one is surely its last
        continuing = self.stop.continuing([slot.seq for slot in batch.samples])
        self.processors.accept_on_device(batch, tokens)
        for seq in continuing:
            seq.num_pending += 1
        self.stats.add_phase("sample", phase)
        return LaunchedStep(out, batch, tokens, host, ready, {s.seq_id for s in continuing}, start)

    @staticmethod
    def _inputs_from(previous: LaunchedStep, batch: BatchMetadata, decodes: bool) -> None:
        """Fill ``batch``'s rows of tokens still on the device from the previous step's."""
        if decodes and batch.seqs == previous.batch.seqs and len(previous.batch.samples) == len(batch.seqs):
            # the steady state: the same sequences in the same order, each one pending token
            # behind (one query row and one sampled row each): the inputs are the tokens
            batch.input_ids.copy_(previous.tokens)
            return
        src = {slot.seq.seq_id: j for j, slot in enumerate(previous.batch.samples)}
        rows, picks, row = [], [], 0
        for seq, n in zip(batch.seqs, batch.query_lens_cpu):
            at = len(seq.token_ids) - seq.num_computed_tokens  # the pending token's row in this query
            if seq.num_pending and at < n:  # (one at most: only the previous step is in flight)
                rows.append(row + at)
                picks.append(src[seq.seq_id])
            row += n
        if rows:
            device = batch.input_ids.device
            index = torch.tensor([rows, picks], dtype=torch.long)
            index = (index.pin_memory() if device.type == "cuda" else index).to(device, non_blocking=True)
            batch.input_ids[index[0]] = previous.tokens.index_select(0, index[1])

    def _collect_in_flight(self) -> None:
        step, self._in_flight = self._in_flight, None
        self._collect(step)

    def _collect(self, step: LaunchedStep) -> None:
        """Wait for a launched step's tokens and absorb them as a synchronous step would."""
        collecting = time.perf_counter()
        if step.ready is not None:
            waited = time.perf_counter()
            step.ready.synchronize()
            self.stats.device_wait_seconds += time.perf_counter() - waited
        tokens = step.host.tolist()
        landed = time.perf_counter()
        # ``Engine._append`` spelled out: hundreds of tokens a step, one call each saved
        holds, finished, check, appended = step.holds_pending, SequenceStatus.FINISHED, self.stop.check, 0
        for slot, token in zip(step.batch.samples, tokens):
            seq = slot.seq
            if seq.seq_id in holds:
                seq.num_pending -= 1
            if seq.status is finished:  # aborted, or finished by the step before, while this one ran
                continue
            appended += 1
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = landed
            reason = check(seq, token)
            if reason is not None:
                self._finish(seq, reason)
        self.stats.sample_slots += appended
        self.stats.generated_tokens += appended
        self._end_step(step.out, step.batch, step.start)
        self.stats.add_phase("process", collecting)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._device_ok.pop(seq.seq_id, None)
        super()._finish(seq, reason)
