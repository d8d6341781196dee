"""The engine: one step reads as schedule, run the model, post-process."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .batch import BatchMetadata, ScheduledSeq, SchedulerOutput, build_batch
from .cache import CacheManager
from .decoding import Decoder
from .errors import InvalidRequestError, RequestRejectedError
from .kernel_builds import build_log
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .sequence import FinishReason, SamplingParams, Sequence, SequenceStatus, TokenLogprob

logger = logging.getLogger(__name__)

WASTE_SAMPLE_STEPS = 8
"""KV waste is sampled every this many steps: counting used slots walks every live sequence
(0.1 ms per step at 256 sequences on a 2-core CPU, bench/host_overhead.py), and a run's
average needs no more."""


@dataclass
class RequestState:
    """A request's sequences (n > 1 forks them after the prompt) and its stop rules."""

    request_id: str
    params: SamplingParams
    seqs: list[Sequence]
    forked: bool = False

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs) and (self.forked or self.params.n == 1)


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    peak_kv_blocks: int = 0
    """Most blocks held by live sequences after any step (cached-but-evictable ones excluded)."""
    peak_running: int = 0
    """Most sequences running in one step (the batch size reached)."""
    kv_allocated_slots: int = 0
    kv_used_slots: int = 0
    """Sums of allocated and used KV slots over every ``WASTE_SAMPLE_STEPS``-th step (the
    first included): waste = 1 - used / allocated."""
    sample_slots: int = 0
    """Sequence-steps that produced tokens (one target forward each, verifying any drafts)."""
    draft_tokens: int = 0
    """Draft tokens verified (speculative decoding)."""
    accepted_draft_tokens: int = 0
    """Draft tokens the target accepted."""
    overlapped_steps: int = 0
    """Steps launched before the previous step's tokens reached the host (async scheduling)."""
    device_wait_seconds: float = 0.0
    """Host time spent waiting for launched steps' tokens (async scheduling): near zero over
    a run means the host, not the GPU, set its pace."""
    kernel_builds: int = 0
    """Triton kernel variants built during steps (each stalls its step for a compile; start-up
    warm-up should leave none: see core/kernel_builds.py). Counted where Triton is in use."""
    step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    """Wall time of the most recent steps (bounded: an engine may run for days)."""

    @property
    def kv_waste(self) -> float | None:
        """Share of allocated KV slots holding no token, averaged over steps (None: untracked)."""
        if not self.kv_allocated_slots:
            return None
        return 1.0 - self.kv_used_slots / self.kv_allocated_slots

    @property
    def acceptance_rate(self) -> float | None:
        """Share of draft tokens accepted (None: nothing was drafted)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def tokens_per_forward(self) -> float | None:
        """Mean tokens a sequence gained per target forward that sampled it (1.0 without
        speculation; (1 - a^(k+1)) / (1 - a) for acceptance a and k drafts every step)."""
        if not self.sample_slots:
            return None
        return (self.sample_slots + self.accepted_draft_tokens) / self.sample_slots


@dataclass
class _InFlight:
    """A launched step whose sampled tokens have not reached the host (async scheduling)."""

    out: SchedulerOutput
    batch: BatchMetadata
    tokens: torch.Tensor  # [samples] on the device: the next step's inputs are taken from here
    host: torch.Tensor  # their copy on the host (pinned), complete once ``event`` is
    event: Any
    counted: set[int]  # sequences whose num_pending counts this step's token
    start: float


class Engine:
    """Owns the live requests and advances them one step at a time.

    ``add_request`` validates and admits; ``step`` runs one forward for the scheduler's batch
    and returns the requests that finished in it; ``abort`` stops a request and frees its
    cache. ``decode_text`` turns token ids into text for stop strings.
    """

    def __init__(self, runner: ModelRunner, cache: CacheManager, scheduler: Scheduler, decoder: Decoder,
                 *, max_model_len: int, eos_token_ids: set[int], vocab_size: int, seed: int = 0,
                 decode_text: Callable[[list[int]], str] | None = None, async_scheduling: bool = False):
        self.runner = runner
        self.cache = cache
        self.scheduler = scheduler
        self.decoder = decoder
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.seed = seed
        self.decode_text = decode_text
        self.requests: dict[str, RequestState] = {}
        self.failures: dict[str, BaseException] = {}
        """Requests aborted because their own forward raised (request id -> the error); the
        caller that waits for a request pops its entry."""
        self.stats = EngineStats()
        self._counter = 0
        self.async_scheduling = async_scheduling
        self._async_verdicts: dict[int, bool] = {}  # seq_id -> _async_ok, for live sequences
        self._pending: _InFlight | None = None  # async scheduling: the launched step whose tokens are on their way
        self._carried: list[RequestState] = []  # finished in a step that then failed: returned by the next

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, priority: int = 0, cache_salt: str | None = None) -> RequestState:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty; give at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {len(prompt_token_ids)} tokens; the context window "
                                      f"(max_model_len) is {self.max_model_len}, leaving no room to generate")
        self.decoder.check(params)
        seq = Sequence(request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt)
        seq.generator = self._generator(params, 0)
        self.scheduler.add([seq])  # raises RequestRejectedError if it can never fit
        state = RequestState(request_id, params, [seq])
        self.requests[request_id] = state
        self.stats.prompt_tokens += len(prompt_token_ids)
        return state

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator:
        if params.seed is not None:
            # sample 0 keeps the seed; others derive from it, so seeds s and s + 1 never share a stream
            seed = params.seed if index == 0 else (params.seed * 1_000_003 + index) % 2**63
        else:
            self._counter += 1
            seed = self.seed * 1_000_003 + self._counter
        return torch.Generator().manual_seed(seed)

    def abort(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        for seq in state.seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.unfinished())

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestState]:
        """Run one step; return the requests that finished in it.

        With ``async_scheduling``, a step whose sequences all pick their tokens on the device
        (decodes, prefill chunks, admissions) is scheduled and launched before the previous
        step's tokens reach the host (its inputs are taken from them on the device), and the
        previous step is then finished while the GPU runs this one: the call returns the
        requests the previous step finished. Any other step runs synchronously."""
        start = time.perf_counter()
        builds = build_log.total
        finished, self._carried = self._carried, []
        try:
            more = self._step(start, finished)  # extends ``finished`` with what it completes first
        except BaseException:
            self._carried = finished  # finished before the failure: returned by the next step
            raise
        finally:
            if build_log.total != builds:
                self._built_kernels(build_log.total - builds)
        return finished + more

    def _built_kernels(self, count: int) -> None:
        self.stats.kernel_builds += count
        logger.info("step %d built %d new Triton kernel variant(s) and stalled for the compile (kernels built so "
                    "far: %s); start-up warm-up did not cover this step's shapes", self.stats.steps, count,
                    ", ".join(f"{k} x{n}" for k, n in build_log.by_kernel.items()))

    def _step(self, start: float, finished: list[RequestState]) -> list[RequestState]:
        """``step`` without the hand-over of requests finished before a failure; appends
        the ones it finishes first to ``finished``."""
        if self._pending is not None and not self._can_overlap():
            finished += self._complete(self._take_pending())  # the next schedule needs its tokens
        out = self.scheduler.schedule()
        self.stats.preemptions += len(out.preempted)
        if out.is_empty:
            if self._pending is not None:
                return self._complete(self._take_pending())
            if self.has_unfinished():
                raise RuntimeError("scheduler returned an empty batch while requests are waiting "
                                   f"({self.scheduler.num_waiting} waiting, {self.scheduler.num_running} running)")
            return []
        if self.async_scheduling and self._launchable(out):
            previous = self._pending
            try:
                self._pending = self._launch(out, previous, start)
            except Exception:  # finish the previous step, then this one synchronously (fault isolation)
                self._pending = previous
            else:
                return self._complete(previous) if previous is not None else []
        if self._pending is not None:  # a synchronous step: nothing may stay in flight
            finished += self._complete(self._take_pending())
            out.scheduled = [i for i in out.scheduled if not i.seq.is_finished]
            if not out.scheduled:
                return []
        return self._step_sync(out, start)

    def _step_sync(self, out: SchedulerOutput, start: float) -> list[RequestState]:
        """Propose, build, run, decode and absorb one scheduled step, waiting for its tokens."""
        drafts = self.decoder.propose(out)
        if any(len(d) > self.decoder.num_lookahead_tokens for d in drafts.values()):
            raise RuntimeError(f"decoding plugin {self.decoder.name!r} proposed more drafts than its "
                               f"num_lookahead_tokens ({self.decoder.num_lookahead_tokens}), the slots reserved")
        forks = self._plan_forks(out)
        batch = build_batch(out.scheduled, self.cache, self.runner.device, drafts, forks)
        try:
            logits, tokens = self._run_batch(batch)
        except Exception:
            # find the requests whose own forward fails, fail only them, rerun the others
            if not self._fail_culprits(out, drafts, forks):
                raise  # no single request reproduces it: the caller decides
            if not out.scheduled:
                self.stats.steps += 1
                return []
            drafts = {k: v for k, v in drafts.items() if any(i.seq.seq_id == k for i in out.scheduled)}
            forks = {k: v for k, v in forks.items() if any(i.seq.seq_id == k for i in out.scheduled)}
            batch = build_batch(out.scheduled, self.cache, self.runner.device, drafts, forks)
            logits, tokens = self._run_batch(batch)
        # every query token (chunk, last token, drafts) now has KV in the cache
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_query_tokens + len(drafts.get(item.seq.seq_id, []))
        for parent_id, children in forks.items():
            parent = next(i.seq for i in out.scheduled if i.seq.seq_id == parent_id)
            for child in children:
                if self.cache.can_fork(parent):
                    child.num_computed_tokens = parent.num_computed_tokens
                    self.cache.fork(parent, child)
                else:  # no room to share or copy the prompt's cache: the child recomputes it later
                    child.num_computed_tokens = 0
                self.scheduler.adopt(child)
            self.requests[parent.request_id].forked = True
        logprobs = self._logprobs(logits, batch, tokens)
        for slot, accepted, lps in zip(batch.samples, tokens, logprobs):
            seq = slot.seq
            self.stats.sample_slots += 1
            self.stats.draft_tokens += len(slot.draft_tokens)
            self.stats.accepted_draft_tokens += len(accepted) - 1
            rejected = len(slot.draft_tokens) - (len(accepted) - 1)
            if rejected > 0:  # roll back the KV of drafts the decoder did not accept
                seq.num_computed_tokens -= rejected
                self.cache.truncate(seq, seq.num_computed_tokens)
            for i, token in enumerate(accepted):
                if lps is not None:
                    seq.logprobs.append(lps[i])
                if self._append(seq, token):
                    break
        return self._absorbed(out, batch, start)

    def _absorbed(self, out: SchedulerOutput, batch: BatchMetadata, start: float) -> list[RequestState]:
        """After a step's tokens are appended: index newly full blocks, count the step, and
        return the requests it finished."""
        finished, commit = SequenceStatus.FINISHED, self.cache.commit
        for item in out.scheduled:
            if item.seq.status is not finished:
                commit(item.seq)
        done: dict[str, RequestState] = {}
        for slot in batch.samples:
            seq = slot.seq
            if seq.status is finished and seq.request_id not in done:
                state = self.requests.get(seq.request_id)
                if state is not None and state.finished:
                    done[seq.request_id] = state
        self._sample_memory(len(out.scheduled))
        self.stats.steps += 1
        self.stats.step_seconds.append(time.perf_counter() - start)
        return list(done.values())

    # ------------------------------------------------------------------ async scheduling

    def _async_ok(self, seq: Sequence) -> bool:
        """Whether ``seq``'s next token can be picked on the device and left there a step
        (asked of every live sequence every step: the verdict is kept until it finishes, once
        it can no longer change)."""
        ok = self._async_verdicts.get(seq.seq_id)
        if ok is not None:
            return ok
        state = self.requests.get(seq.request_id)
        settled = seq.params.n == 1 or state is None or state.forked  # n > 1 changes when it forks
        ok = (self.decoder.num_lookahead_tokens == 0 and seq.params.logprobs is None
              and self.decoder.samples_on_device(seq.params) and settled)
        if settled:
            self._async_verdicts[seq.seq_id] = ok
        return ok

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the pending step's tokens arrive:
        every running sequence picks its tokens on the device. Scheduling needs token counts,
        which the pending tokens already hold, not their values; so decodes, prefill chunks
        and admissions may all be planned ahead. What the pending step finishes is learnt a
        step late: a sequence ended by a stop token runs one wasted row, and its place is
        offered to the queue one step later, as in vLLM."""
        verdicts, ok = self._async_verdicts, self._async_ok  # a kept verdict skips the call
        return all(verdicts.get(s.seq_id) or ok(s) for s in self.scheduler.running_sequences())

    def _launchable(self, out: SchedulerOutput) -> bool:
        """Whether ``out`` can run without the host waiting for its tokens: every scheduled
        sequence (decoding, prefilling or just admitted) picks its tokens on the device, and
        has a token to run (a scheduler may list one whose last token is still pending)."""
        verdicts, ok = self._async_verdicts, self._async_ok
        return all(i.num_query_tokens and (verdicts.get(i.seq.seq_id) or ok(i.seq)) for i in out.scheduled)

    def _take_pending(self) -> _InFlight:
        pending, self._pending = self._pending, None
        return pending

    def _launch(self, out: SchedulerOutput, previous: _InFlight | None, start: float) -> _InFlight:
        """Run a step up to its sampled tokens, which stay on the device (a copy to the host
        is queued). Nothing about the sequences changes unless it all succeeds."""
        device = self.runner.device
        # (lengths spelled out in this method's per-sequence loops: hundreds of sequences a step)
        decodes = all(i.num_query_tokens == 1 and
                      i.seq.num_computed_tokens + 1 == len(i.seq.token_ids) + i.seq.num_pending
                      for i in out.scheduled)
        batch = build_batch(out.scheduled, self.cache, device, decodes_only=decodes)
        if previous is not None and decodes and batch.seqs == previous.batch.seqs and \
                len(previous.batch.samples) == len(batch.seqs):
            # the steady state: the same sequences in the same order, each one pending token
            # behind (one query row and one sampled row each): the inputs are the tokens
            batch.input_ids.copy_(previous.tokens)
        elif previous is not None:  # inputs still on the device: take them from the previous step's tokens
            src = {slot.seq.seq_id: j for j, slot in enumerate(previous.batch.samples)}
            rows, picks, row = [], [], 0
            for seq, n in zip(batch.seqs, batch.query_lens_cpu):
                at = len(seq.token_ids) - seq.num_computed_tokens  # the pending token's row in this query
                if seq.num_pending and at < n:  # (one at most: only the previous step is in flight)
                    rows.append(row + at)
                    picks.append(src[seq.seq_id])
                row += n
            if rows:
                index = torch.tensor([rows, picks], dtype=torch.long)
                index = (index.pin_memory() if device.type == "cuda" else index).to(device, non_blocking=True)
                batch.input_ids[index[0]] = previous.tokens.index_select(0, index[1])
        logits = self.runner.forward(batch, native_logits=self.decoder.device_tokens_any_dtype)
        tokens = self.decoder.device_tokens(logits, batch)
        host, event = tokens, None
        if tokens.is_cuda:  # pinned, so the copy waits for this step only, not for the next
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.stats.overlapped_steps += previous is not None
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_query_tokens
        counted, max_model_len = set(), self.max_model_len
        for slot in batch.samples:  # the tokens to come count in the sequences' lengths ...
            seq = slot.seq
            length = len(seq.token_ids) + seq.num_pending + 1  # with this step's token
            if length - seq.num_prompt_tokens < seq.params.max_tokens and \
                    length < max_model_len:  # ... unless this one is surely its last
                seq.num_pending += 1
                counted.add(seq.seq_id)
        return _InFlight(out, batch, tokens, host, event, counted, start)

    def _complete(self, step: _InFlight) -> list[RequestState]:
        """Wait for a launched step's tokens and absorb them as a synchronous step would."""
        if step.event is not None:
            waited = time.perf_counter()
            step.event.synchronize()
            self.stats.device_wait_seconds += time.perf_counter() - waited
        tokens = step.host.tolist()
        counted, finished, append, appended = step.counted, SequenceStatus.FINISHED, self._append, 0
        for slot, token in zip(step.batch.samples, tokens):
            seq = slot.seq
            if seq.seq_id in counted:
                seq.num_pending -= 1
            if seq.status is finished:  # aborted, or finished by the step before, while this one ran
                continue
            appended += 1
            append(seq, token)
        self.stats.sample_slots += appended
        return self._absorbed(step.out, step.batch, step.start)

    def _run_batch(self, batch) -> tuple[torch.Tensor, list[list[int]]]:
        """Forward and decode one packed batch (checking the decoder's side of the contract)."""
        logits = self.runner.forward(batch)
        # a step of prefill chunks only (none reaching its prompt's end) samples nothing
        tokens = self.decoder.decode(logits, batch) if batch.samples else []
        if len(tokens) != len(batch.samples) or any(not 1 <= len(t) <= len(s.draft_tokens) + 1
                                                    for s, t in zip(batch.samples, tokens)):
            raise RuntimeError(f"decoding plugin {self.decoder.name!r} broke its contract: it must return 1 to "
                               f"drafts + 1 tokens for each of the {len(batch.samples)} sample slots, got "
                               f"{[len(t) for t in tokens]}")
        return logits, tokens

    def _fail_culprits(self, out, drafts: dict[int, list[int]], forks: dict[int, list[Sequence]]) -> bool:
        """After a failed step: run each scheduled sequence alone; abort the requests whose own
        run raises (recording the error in ``failures``) and drop them from ``out``. Random
        generators are restored afterwards, so the others' sampled tokens are unaffected.
        Returns whether any culprit was found."""
        seqs = [i.seq for i in out.scheduled] + [c for cs in forks.values() for c in cs]
        saved = [(s, s.generator.get_state()) for s in seqs if s.generator is not None]
        culprits: dict[str, BaseException] = {}
        for item in out.scheduled:
            sid = item.seq.seq_id
            alone = build_batch([item], self.cache, self.runner.device, {sid: drafts[sid]} if sid in drafts else {},
                                {sid: forks[sid]} if sid in forks else {})
            try:
                self._run_batch(alone)
            except Exception as exc:
                culprits.setdefault(item.seq.request_id, exc)
        for seq, state in saved:
            seq.generator.set_state(state)
        for request_id, exc in culprits.items():
            self.failures[request_id] = exc
            self.abort(request_id)
        out.scheduled = [i for i in out.scheduled if i.seq.request_id not in culprits]
        return bool(culprits)

    @staticmethod
    def _logprobs(logits: torch.Tensor, batch, tokens: list[list[int]]) -> list[list[TokenLogprob] | None]:
        """For slots whose request asks for logprobs: each accepted token's log-probability
        under the row that produced it, and the top alternatives (one batched log-softmax)."""
        want = [i for i, s in enumerate(batch.samples) if s.seq.params.logprobs is not None]
        out: list[list[TokenLogprob] | None] = [None] * len(batch.samples)
        if not want:
            return out
        rows = [batch.samples[i].first_row + j for i in want for j in range(len(tokens[i]))]
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        picked_rows = logits.index_select(0, index)
        lp = torch.log_softmax(picked_rows if picked_rows.dtype == torch.float64 else picked_rows.float(), dim=-1)
        top_n = max(batch.samples[i].seq.params.logprobs for i in want)
        top = lp.topk(max(top_n, 1), dim=-1) if top_n else None
        chosen = torch.tensor([t for i in want for t in tokens[i]], dtype=torch.long, device=logits.device)
        picked = lp.gather(1, chosen[:, None])[:, 0].tolist()
        top_values = top.values.tolist() if top is not None else None
        top_ids = top.indices.tolist() if top is not None else None
        r = 0
        for i in want:
            n = batch.samples[i].seq.params.logprobs
            entries = []
            for _ in tokens[i]:
                alts = list(zip(top_ids[r][:n], top_values[r][:n])) if top is not None and n else []
                entries.append(TokenLogprob(picked[r], alts))
                r += 1
            out[i] = entries
        return out

    def _sample_memory(self, num_running: int) -> None:
        stats = self.stats
        allocated = self.cache.num_allocated_slots()
        stats.peak_kv_blocks = max(stats.peak_kv_blocks, -(-allocated // self.cache.layout.block_size))
        stats.peak_running = max(stats.peak_running, num_running)
        if stats.steps % WASTE_SAMPLE_STEPS:
            return
        used = self.cache.num_used_slots()
        if used is not None:
            stats.kv_allocated_slots += allocated
            stats.kv_used_slots += used

    def _plan_forks(self, out) -> dict[int, list[Sequence]]:
        """Sequences of n > 1 requests whose prompt completes this step fork now, sampling
        from the parent's logits; their cache is forked after the forward."""
        forks: dict[int, list[Sequence]] = {}
        for item in out.scheduled:
            seq = item.seq
            state = self.requests.get(seq.request_id)
            if state is None or state.forked or state.params.n == 1:
                continue
            if seq.num_computed_tokens + item.num_query_tokens == seq.num_tokens:
                children = []
                for i in range(1, state.params.n):
                    child = seq.fork(i)
                    child.generator = self._generator(state.params, i)
                    children.append(child)
                state.seqs.extend(children)
                forks[seq.seq_id] = children
        return forks

    def _append(self, seq: Sequence, token: int) -> bool:
        """Append a generated token; finish the sequence if a stop rule fires. True if it did."""
        seq.token_ids.append(token)
        self.stats.generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        params = seq.params
        reason = None
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            reason = FinishReason.STOP
        elif params.stop and self.decode_text is not None and self._hit_stop_string(seq):
            reason = FinishReason.STOP
        elif (length := len(seq.token_ids)) - seq.num_prompt_tokens >= params.max_tokens or \
                length + seq.num_pending >= self.max_model_len:  # (properties spelled out: every token)
            reason = FinishReason.LENGTH
        if reason is not None:
            self._finish(seq, reason)
            return True
        return False

    def _hit_stop_string(self, seq: Sequence) -> bool:
        """Whether the output now contains a stop string (``stop_text_len``: where the first
        begins). Checked after every token, so only an occurrence ending in the newest
        token's text is new: it lies within the last few tokens, and only those are decoded
        (a token is at least a quarter of a character; 8 tokens of margin keep the window's
        own start, where decoding a suffix may differ, out of play). The whole output is
        decoded only to place a hit."""
        stops = [s for s in seq.params.stop if s]
        output = seq.output_token_ids
        window = 4 * max((len(s) for s in stops), default=0) + 8
        if len(output) > window and not any(s in self.decode_text(output[-window:]) for s in stops):
            return False
        text = self.decode_text(output)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            seq.stop_text_len = min(hits)
            return True
        return False

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self._async_verdicts.pop(seq.seq_id, None)
        self.scheduler.finish(seq)
        self.decoder.finish(seq)

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [len(token_ids), vocab] (float32; float64 in a float64 pipeline) at every position of ``token_ids``, run as one
        prefill of its own (teacher forcing): for equivalence checks, KL and perplexity."""
        if not token_ids:
            raise InvalidRequestError("nothing to score: token_ids is empty")
        if len(token_ids) > self.max_model_len:
            raise InvalidRequestError(f"{len(token_ids)} tokens exceed the context window "
                                      f"(max_model_len {self.max_model_len})")
        seq = Sequence("score", token_ids, SamplingParams(max_tokens=1))
        if not self.cache.can_reserve(seq, len(token_ids)):
            raise RequestRejectedError(f"no cache room to score {len(token_ids)} tokens now")
        self.cache.reserve(seq, len(token_ids))
        try:
            batch = build_batch([ScheduledSeq(seq, len(token_ids))], self.cache, self.runner.device,
                                all_logits=True)
            return self.runner.forward(batch)
        finally:
            self.cache.free(seq)

    def pop_finished(self, request_id: str) -> RequestState:
        return self.requests.pop(request_id)

    def snapshot(self) -> dict[str, Any]:
        return {"running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting,
                "free_blocks": self.cache.num_free_blocks, "total_blocks": self.cache.num_blocks}
