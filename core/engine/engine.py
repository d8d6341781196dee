"""The engine: requests in, one step at a time, finished requests out.

One step (``Engine.step``) reads top to bottom:

1. schedule: the scheduler picks the step's sequences and reserves their cache slots;
2. launch: the decoder proposes drafts, the batch is packed, the model runs and the decoder
   turns the logits into tokens (a request whose own run raises fails alone);
3. collect: tokens are appended and the stop rule checked, rejected drafts rolled back,
   newly full blocks committed, finished requests handed out.

With async scheduling a step is launched ahead (its tokens left on the device, the next step
scheduled and launched before they reach the host) and collected one step later; otherwise
it is collected at once. Launched either way, a step is collected by the same code.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from tessellm.core.engine import contracts
from tessellm.core.engine.batch_builder import build_batch
from tessellm.core.engine.faults import find_culprits
from tessellm.core.engine.grammar import GrammarMask, GrammarSession
from tessellm.core.engine.images import EncoderCache, ImageEncoder, admit_images, images_salt
from tessellm.core.engine.lora import LoraAdapters
from tessellm.core.engine.outputs import StopRule, record_prompt_logprobs, token_logprobs
from tessellm.core.engine.processors import LogitsProcessors
from tessellm.core.engine.request import RequestState
from tessellm.core.engine.scoring import score_tokens
from tessellm.core.engine.stats import WASTE_SAMPLE_STEPS, EngineStats
from tessellm.core.errors import InvalidRequestError, RequestRejectedError
from tessellm.core.interfaces.batch import BatchMetadata, ScheduledSeq, SchedulerOutput
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.interfaces.decoder import Decoder
from tessellm.core.interfaces.logits import LogitsProcessor
from tessellm.core.interfaces.multimodal import ImageInput
from tessellm.core.interfaces.scheduler import Scheduler
from tessellm.core.interfaces.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from tessellm.core.model.kernel_builds import build_log
from tessellm.core.model.lora import LoraAdapter
from tessellm.core.model.runner import ModelRunner
from tessellm.core.version import api_minor
from tessellm.core.parallel.stages import split_for_microbatches
from tessellm.core.parallel.sync import RankSync

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """One synchronous step, packed: the scheduler's choice, the decoder's drafts
    (seq_id -> tokens), the children forking from a sequence whose prompt completes
    (seq_id -> sequences; n > 1), and the batch built from all three; on a pipeline stage
    also ``parts``, the same sequences cut into micro-batches (None: one)."""

    out: SchedulerOutput
    drafts: dict[int, list[int]]
    forks: dict[int, list[Sequence]]
    batch: BatchMetadata
    parts: list[BatchMetadata] | None = None


@dataclass
class LaunchedStep:
    """A step run up to its sampled tokens. Collected at once (synchronous): ``tokens``, each
    sample slot's accepted tokens, and the ``logits`` its logprobs read. Launched ahead
    (async scheduling): ``device_tokens`` [samples] stay on the device, where the next step
    takes its inputs from, ``host`` is their copy on its way (complete once ``ready``, a CUDA
    event, or None on the CPU), and ``holds_pending`` the sequences whose ``num_pending``
    counts this step's token."""

    out: SchedulerOutput
    batch: BatchMetadata
    start: float
    tokens: list[list[int]] | None = None
    logits: torch.Tensor | None = None
    device_tokens: torch.Tensor | None = None
    host: torch.Tensor | None = None
    ready: Any = None
    holds_pending: set[int] | None = None


class Engine:
    """Owns the live requests and advances them one step at a time.

    ``add_request`` validates and admits (raising ``InvalidRequestError`` or
    ``RequestRejectedError``); ``step`` runs one step and returns the requests that finished;
    ``abort`` stops a request and frees its cache; ``failures`` holds the requests aborted
    because their own run raised, until the caller that waits for them pops the entry.
    """

    def __init__(self, runner: ModelRunner, cache: CacheManager, scheduler: Scheduler, decoder: Decoder,
                 *, stop: StopRule, vocab_size: int, seed: int = 0, sync: RankSync | None = None,
                 grammar: GrammarSession | None = None, processors: list[LogitsProcessor] = (),
                 lora: LoraAdapters | None = None, async_scheduling: bool = False,
                 max_images_per_prompt: int = 8, encoder_cache_tokens: int = 16384):
        self.async_scheduling = async_scheduling
        """Whether a step whose every sequence samples on the device is launched before the
        step before's tokens reach the host (vLLM's and SGLang's overlap scheduling)."""
        self._in_flight: LaunchedStep | None = None  # launched ahead, not collected
        self._device_ok: dict[int, bool] = {}  # seq_id -> _samples_on_device, kept once it cannot change
        self.runner = runner
        self.sync = sync  # tensor parallel: keeps this rank in lockstep with rank 0
        self.cache = cache
        self.scheduler = scheduler
        self.decoder = decoder
        self.grammar = grammar or GrammarSession(None, decoder.num_lookahead_tokens)
        # every transformation of the logits a request may ask for, the grammar's mask last
        self.processors = LogitsProcessors([*processors, GrammarMask(self.grammar)])
        self.stop = stop
        self.max_model_len = stop.max_model_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.requests: dict[str, RequestState] = {}
        self.failures: dict[str, BaseException] = {}
        self.stats = EngineStats()
        self._seeded = 0  # generators seeded from ``seed`` so far
        self._finished: dict[str, RequestState] = {}  # finished, not yet handed out by ``step``
        self._kv_check = contracts.KVWriteCheck(runner.backend, cache, runner.spec.num_layers)
        self.lora = lora
        """The adapters this engine serves (None: LoRA is off)."""
        self._lora_waiting: list[Sequence] = []  # admitted, waiting for a device slot for their adapter
        self.max_images_per_prompt = max_images_per_prompt
        self.images: ImageEncoder | None = None
        """The encoder step of a model that takes images (None: a text-only model)."""
        if runner.spec.vision is not None:
            self.images = ImageEncoder(runner.model.encode_images, runner.spec.hidden_size,
                                       EncoderCache(encoder_cache_tokens), self.stats)
        self._with_images: set[int] = set()  # live sequences whose prompt has images
        self.lock = threading.RLock()
        """Held by whoever drives the engine from a thread: an ``LLM`` call for its whole run, a
        server's engine core on a thread of the same process for each pass of its loop. Two
        threads never step or change the engine at once (a served ``LLM`` may still be
        called: its call waits for the core's pass, and the core for the call)."""

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, priority: int = 0, cache_salt: str | None = None, lora: str | None = None,
                    images: list[ImageInput] | None = None) -> RequestState:
        """Admit a request (``lora``: the registered adapter it runs under, None for the base
        model; ``images``: the prompt's images, processed by the model's ``ImageProcessor``,
        whose placeholders the prompt holds); ``InvalidRequestError`` or
        ``RequestRejectedError`` (an unknown adapter: ``LoraAdapterError``) if it cannot be
        served."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        binding, multimodal = self.admit(prompt_token_ids, params, images)
        salt = self._lora_salt(lora, cache_salt)
        if multimodal is not None and api_minor(getattr(self.cache, "api_version", "1.0")) < 19:
            salt = images_salt(salt, multimodal.images)  # a cache that does not read Sequence.images
        seq = Sequence(request_id, prompt_token_ids, params, priority=priority, cache_salt=salt)
        seq.multimodal = multimodal
        seq.generator = self._generator(params, 0)
        seq.lora = lora
        seq.joint = self.decoder.joint(params)
        seq.group_size = self.decoder.sequences_per_request(params)
        if lora is None or self._give_slot(seq):
            self._schedule_new(seq)  # raises RequestRejectedError if it can never fit
        else:
            self._lora_waiting.append(seq)  # every slot is held: it starts when one is let go
        self.cache.prefetch(seq)  # a tiered cache starts reading its prefix from disk now
        state = RequestState(request_id, params, [seq])
        self.requests[request_id] = state
        self.stats.prompt_tokens += len(prompt_token_ids)
        if multimodal is not None:
            self._with_images.add(seq.seq_id)
            self.stats.image_tokens += multimodal.num_image_tokens
        self.processors.add(seq, binding)
        if self.sync is not None:
            self.sync.record("add", request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
                             priority=priority, cache_salt=cache_salt, lora=lora)
        return state

    def admit(self, prompt_token_ids: list[int], params: SamplingParams,
              images: list[ImageInput] | None = None) -> tuple[Any, Any]:
        """The admission rules a request meets before it is queued (the conformance suites
        apply them too, to skip what the engine would refuse): the prompt (not empty, in the
        vocabulary, its images (``_admit_images``), room to generate), the decoder's (fields
        newer than its plugin API, its ``extra_args``, its ``check``), structured output
        without ``min_tokens``, and the logits processors' (names, arguments; a grammar
        compiles). InvalidRequestError naming the rule; else the request's processor binding
        and its images as a ``MultimodalPrompt`` (None without images)."""
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty; give at least one token", field="prompt")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                      field="prompt")
        multimodal = self._admit_images(prompt_token_ids, images) if images else None
        if len(prompt_token_ids) >= self.max_model_len:
            of = f" ({multimodal.num_image_tokens} of them for its {len(images)} images)" if multimodal else ""
            raise InvalidRequestError(f"prompt has {len(prompt_token_ids)} tokens{of}; the context window "
                                      f"(max_model_len) is {self.max_model_len}, leaving no room to generate",
                                      field="images" if multimodal else "prompt")
        self.decoder.validate_request_fields(params)
        self.decoder.validate_request_args(params)
        self.decoder.check(params)
        if params.structured_output is not None and params.min_tokens:
            raise InvalidRequestError("min_tokens cannot be combined with structured output: the grammar decides "
                                      "where the output ends", field="min_tokens")
        return self.processors.bind(params), multimodal  # bind compiles a grammar; refuses bad processor arguments

    def _admit_images(self, prompt_token_ids: list[int], images: list[ImageInput]) -> Any:
        """The prompt's images checked and, for an M-RoPE model, positioned (a
        ``MultimodalPrompt``); InvalidRequestError naming the problem."""
        if self.sync is not None:
            raise InvalidRequestError("images are not served under tensor or pipeline parallelism; serve this model "
                                      "with parallel.tensor=1 and parallel.pipeline=1 to send images", field="images")
        return admit_images(self.runner.spec, self.runner.model, prompt_token_ids, list(images),
                            limit=self.max_images_per_prompt, step_tokens=self.scheduler.max_step_tokens)

    # ------------------------------------------------------------------ LoRA adapters

    def _lora_salt(self, lora: str | None, cache_salt: str | None) -> str | None:
        """The request's prefix-cache key: its salt, with a digest of the adapter's weights
        folded in (K/V computed under one adapter is never another's, nor that of a reloaded
        one with other weights, in this process or, through a disk tier, the next)."""
        if lora is None:
            return cache_salt
        if self.lora is None:
            raise InvalidRequestError(f"request names LoRA adapter {lora!r}, but this pipeline serves no adapters; "
                                      f"start it with lora.adapters (tessellm serve --lora NAME=PATH) or "
                                      f"lora.enabled=true", field="lora")
        adapter = self.lora.get(lora)  # LoraAdapterError naming the loaded ones
        return f"{cache_salt or ''}\x1flora:{adapter.digest()}"

    def _give_slot(self, seq: Sequence) -> bool:
        slot = self.lora.acquire(seq.lora)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _schedule_new(self, seq: Sequence) -> None:
        try:
            self.scheduler.add([seq])
        except BaseException:
            self._let_go_of_slot(seq)
            raise

    def _let_go_of_slot(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.lora.release(seq.lora_slot)
            seq.lora_slot = -1

    def _admit_lora_waiting(self) -> None:
        """Start the requests that waited for a slot, in arrival order, as slots come free (a
        waiting request whose adapter is resident starts at once: none holds up another)."""
        waiting, self._lora_waiting = self._lora_waiting, []
        for seq in waiting:
            if seq.is_finished:
                continue
            if not self._give_slot(seq):
                self._lora_waiting.append(seq)
                continue
            try:
                self._schedule_new(seq)
            except Exception as exc:  # e.g. RequestRejectedError: fail it alone, as its admission would have
                self._lora_waiting.append(seq)  # so finishing it does not ask the scheduler to forget it
                self.failures[seq.request_id] = exc
                self.abort(seq.request_id)

    def load_lora(self, name: str, path: str, adapter: LoraAdapter | None = None) -> None:
        """Register adapter ``name`` from the PEFT folder ``path`` (``LoraAdapterError`` if
        it is not one this model can serve, or the name is taken); ``adapter``: the folder
        already read (``lora.reader.read``) off the engine's thread. Tensor-parallel followers
        read the folder themselves (each its own slices)."""
        if self.lora is None:
            raise InvalidRequestError("this pipeline serves no LoRA adapters; start it with lora.enabled=true "
                                      "(or lora.runtime_updates=true) to load them at run time")
        self.lora.register(name, path, adapter)
        if self.sync is not None:
            self.sync.record("load_lora", name=name, path=path)

    def unload_lora(self, name: str) -> None:
        """Unregister adapter ``name``: new requests for it are refused at once; running ones
        finish under it."""
        if self.lora is None:
            raise InvalidRequestError("this pipeline serves no LoRA adapters")
        self.lora.unregister(name)
        if self.sync is not None:
            self.sync.record("unload_lora", name=name)

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator:
        if params.seed is not None:
            # sample 0 keeps the seed; others derive from it, so seeds s and s + 1 never share a stream
            seed = params.seed if index == 0 else (params.seed * 1_000_003 + index) % 2**63
        else:
            self._seeded += 1
            seed = self.seed * 1_000_003 + self._seeded
        return torch.Generator().manual_seed(seed)

    def abort(self, request_id: str) -> None:
        """Stop the request and free everything it holds; a no-op for an unknown id."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        if self.sync is not None:
            self.sync.record("abort", request_id=request_id)
        self._finished.pop(request_id, None)
        for seq in state.seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)  # a sequence waiting for a LoRA slot leaves that queue

    def has_unfinished(self) -> bool:
        return self._in_flight is not None or bool(self.scheduler.unfinished()) or bool(self._lora_waiting)

    def pop_finished(self, request_id: str) -> RequestState:
        return self.requests.pop(request_id)

    def snapshot(self) -> dict[str, Any]:
        return {"running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting,
                "free_blocks": self.cache.num_free_blocks, "total_blocks": self.cache.num_blocks}

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestState]:
        """Run one step; return the requests that finished (in it, or in a step that then
        raised: those are handed out by the next call). With async scheduling, the requests
        the step before finished."""
        builds = build_log.total
        try:
            if self.sync is not None:
                self.sync.begin_step()
            self._step()
        except BaseException:
            if self.sync is not None:  # the ranks' collectives may no longer line up: stop for good
                self.sync.broken = True
            raise
        finally:
            if build_log.total != builds:
                self._note_kernel_builds(build_log.total - builds)
        finished, self._finished = list(self._finished.values()), {}
        return finished

    def _step(self) -> None:
        """Schedule, launch, collect: at once, or (async scheduling, every sequence sampling on
        the device) the step before's after this one is launched."""
        start = time.perf_counter()
        if self._in_flight is not None and not self._can_overlap():
            self._collect_in_flight()  # the next schedule needs its tokens
        out = self._schedule()
        start = self.stats.add_phase("schedule", start)
        if self._with_images and not out.is_empty:
            self._encode_images(out)
        if out.is_empty:
            if self._in_flight is not None:
                self._collect_in_flight()
            else:
                self._check_idle()
            return
        step = self._launch_ahead(out, start) if self.async_scheduling and self._launchable(out) else None
        if step is not None:
            previous, self._in_flight = self._in_flight, step
            if previous is not None:
                self._collect(previous)
            return
        if self._in_flight is not None:  # a synchronous step: nothing may stay in flight
            self._collect_in_flight()
            out.scheduled = [i for i in out.scheduled if not i.seq.is_finished]
            if not out.scheduled:
                return
        step = self._launch(out, start)
        if step is not None:
            self._collect(step)

    def _schedule(self) -> SchedulerOutput:
        if self._lora_waiting:
            self._admit_lora_waiting()
        out = self.scheduler.schedule()
        if self.sync is not None:
            self.sync.schedule(out)
        self.stats.preemptions += len(out.preempted)
        if any(item.seq.joint for item in out.scheduled):
            self._hold_split_groups(out)
        return out

    def _encode_images(self, out: SchedulerOutput) -> None:
        """The encoder step: the images the step's queries reach get their embeddings; a
        request whose image cannot be encoded fails alone and leaves the step."""
        failed = self.images.prepare(out.scheduled, self.scheduler.name)
        for request_id, exc in failed.items():
            self.failures[request_id] = exc
            self.abort(request_id)
        if failed:
            out.scheduled = [item for item in out.scheduled if not item.seq.is_finished]

    def _hold_split_groups(self, out: SchedulerOutput) -> None:
        """A joint request (beam search) samples only when every one of its live sequences
        does in the same step: members that would sample while another is still being
        recomputed (after a preemption) wait for it (their slots stay reserved)."""
        sampling: dict[str, list[int]] = {}
        for i, item in enumerate(out.scheduled):
            seq = item.seq
            if seq.joint and seq.num_computed_tokens + item.num_query_tokens == seq.num_tokens:
                sampling.setdefault(seq.request_id, []).append(i)
        held = set()
        for request_id, rows in sampling.items():
            state = self.requests.get(request_id)
            if state is None or not state.forked:
                continue  # the prompt's own step: its beams fork from it now
            live = sum(1 for s in state.seqs if not s.is_finished)
            if len(rows) < live:
                held.update(rows)
        if held:
            out.scheduled = [item for i, item in enumerate(out.scheduled) if i not in held]

    # ------------------------------------------------------------------ joint requests (beam search)

    def reassign(self, group: list[Sequence], parents: list[int]) -> None:
        """``group[j]`` becomes a copy of ``group[parents[j]]`` as the group was before the
        call: its tokens, log-probabilities and (sharing blocks) its cache."""
        before = {p: (list(group[p].token_ids), list(group[p].logprobs))
                  for j, p in enumerate(parents) if p != j}  # only the parents copied from
        holders: dict[int, Sequence] = {}
        for j, p in enumerate(parents):
            if p != j and p not in holders:  # hold the parent's blocks while members are rewritten
                if not self.cache.can_fork(group[p]):
                    raise RuntimeError(f"cache {self.cache.name!r} cannot fork sequence {group[p].seq_id} to regroup "
                                       f"the beams of request {group[p].request_id!r}; beam search needs a cache "
                                       f"that shares blocks (paged)")
                holder = holders[p] = group[p].fork(group[p].sample_index)
                holder.num_computed_tokens = group[p].num_computed_tokens
                self.cache.fork(group[p], holder)
        for j, p in enumerate(parents):
            if p != j:
                self.cache.fork(holders[p], group[j])
                group[j].token_ids[:] = before[p][0]
                group[j].logprobs[:] = before[p][1]
        for holder in holders.values():
            self.cache.free(holder)

    def end_group(self, group: list[Sequence], results: list[tuple[list[int], float, str]]) -> None:
        """The joint request of ``group`` ends: its first ``len(results)`` sequences hold the
        results (generated tokens, score, finish reason), best first; the others are dropped."""
        state = self.requests[group[0].request_id]
        for seq in group:
            if not seq.is_finished:
                self._finish(seq, FinishReason.STOP)  # its blocks are indexed and freed as they are
        kept = group[:len(results)]
        for i, (seq, (tokens, score, reason)) in enumerate(zip(kept, results)):
            del seq.token_ids[seq.num_prompt_tokens:]
            seq.token_ids.extend(tokens)
            seq.logprobs.clear()
            seq.score, seq.sample_index = score, i
            seq.finish_reason = FinishReason.STOP if reason == "stop" else FinishReason.LENGTH
        state.seqs = kept

    def _check_idle(self) -> None:
        """An empty batch with requests unfinished: the scheduler broke its contract, and
        nothing would ever run them. Each fails with the one-line error (``failures``)."""
        if not self.has_unfinished():
            return
        error = contracts.idle_scheduler_error(self.scheduler, self.scheduler.num_waiting, self.scheduler.num_running)
        stuck = {seq.request_id for seq in self.scheduler.unfinished()}
        for request_id in stuck:
            self.failures[request_id] = error
            self.abort(request_id)
        logger.error("%s; failed %d requests", error, len(stuck))

    def _launch(self, out: SchedulerOutput, start: float) -> LaunchedStep | None:
        """Prepare ``out`` (drafts, forks, the packed batch) and run it to its tokens on the
        host; a request whose own run raises fails alone. None: every request of it failed."""
        drafts = self.decoder.propose(out)
        if self.sync is not None:
            drafts = self.sync.drafts(out, drafts)
        if any(len(d) > self.decoder.num_lookahead_tokens for d in drafts.values()):
            raise contracts.broken(self.decoder, f"propose returned more drafts than num_lookahead_tokens "
                                                 f"({self.decoder.num_lookahead_tokens}), the slots reserved")
        plan = self._pack(out, drafts, self._plan_forks(out))
        self.stats.add_phase("prepare", start)
        result = self._run_isolating_faults(plan)
        if result is None:  # every request of the step failed alone
            self.stats.steps += 1
            return None
        plan, logits, tokens = result
        self._advance(plan)
        if plan.batch.prompt_rows:
            record_prompt_logprobs(logits, plan.batch)
        return LaunchedStep(plan.out, plan.batch, start, tokens, logits)

    # ------------------------------------------------------------------ launched ahead (async scheduling)
    #
    # Scheduling needs token counts, not token values: a launched step's sampled tokens count
    # in their sequences' lengths at once (``Sequence.num_pending``) and stay on the device,
    # where the next step takes its inputs from them. So decodes, prefill chunks and admissions
    # can all be planned ahead, as long as every sequence picks its tokens on the device (the
    # decoder's ``samples_on_device``; no drafts, no logprobs). What a launched step finishes
    # is learnt a step late: a sequence ended by a stop token runs one wasted row, and its
    # place is offered to the queue one step later, as in vLLM.

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

    def _launch_ahead(self, out: SchedulerOutput, start: float) -> LaunchedStep | None:
        """``out`` run up to its sampled tokens, which stay on the device (a copy to the host
        is queued); nothing about the sequences changes unless it all succeeds. None if it
        raised: the step then runs synchronously, where a failing request fails alone."""
        previous = self._in_flight
        try:
            batch = self._pack_ahead(out, previous)
            plan = self.processors.plan(batch)
            phase = self.stats.add_phase("prepare", start)
            # processors run on float32 logits, as in the synchronous step, so both pick the same tokens
            logits = self._forward(batch, native_logits=self.decoder.device_tokens_any_dtype and not plan)
            phase = self.stats.add_phase("forward", phase)
            tokens = self.decoder.device_tokens(self.processors.apply(logits, plan), batch)
            contracts.check_device_tokens(self.decoder, tokens, batch)
        except Exception:
            return None
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
        return LaunchedStep(out, batch, start, device_tokens=tokens, host=host, ready=ready,
                            holds_pending={s.seq_id for s in continuing})

    def _pack_ahead(self, out: SchedulerOutput, previous: LaunchedStep | None) -> BatchMetadata:
        """``out``'s batch, its rows of tokens still on the device filled from ``previous``'s."""
        # (lengths spelled out in this method's per-sequence loops: hundreds of sequences a step)
        decodes = all(i.num_query_tokens == 1 and
                      i.seq.num_computed_tokens + 1 == len(i.seq.token_ids) + i.seq.num_pending
                      for i in out.scheduled)
        batch = build_batch(out.scheduled, self.cache, self.runner.device, decodes_only=decodes,
                            multimodal=bool(self._with_images))
        if self._kv_check.always:
            contracts.check_slots_not_held(self.cache, contracts.query_slots(batch),
                                           list(self.scheduler.running_sequences()))
        if previous is not None:
            _inputs_from(previous, batch, decodes)
        return batch

    def _pack(self, out: SchedulerOutput, drafts: dict[int, list[int]],
              forks: dict[int, list[Sequence]]) -> StepPlan:
        for item in out.scheduled:
            seq = item.seq
            if seq.num_cached_tokens is None:  # its first step: what the prefix cache gave it
                seq.num_cached_tokens = seq.num_computed_tokens
                if seq.num_computed_tokens and seq.params.prompt_logprobs is not None and not seq.prompt_logprobs:
                    raise RuntimeError(
                        f"cache plugin {self.cache.name!r} gave a request that asks for prompt logprobs "
                        f"{seq.num_computed_tokens} cached prompt tokens; match_prefix must return 0 for such a "
                        f"sequence (its prompt positions must run through the model)")
        batch = build_batch(out.scheduled, self.cache, self.runner.device, drafts, forks,
                            multimodal=bool(self._with_images))
        if self._kv_check.always:
            contracts.check_slots_not_held(self.cache, contracts.query_slots(batch),
                                           list(self.scheduler.running_sequences()))
        return StepPlan(out, drafts, forks, batch, self._micro_batches(out.scheduled, drafts, forks))

    def _micro_batches(self, items: list[ScheduledSeq], drafts: dict[int, list[int]],
                       forks: dict[int, list[Sequence]]) -> list[BatchMetadata] | None:
        """The step's sequences cut into the runner's micro-batches (contiguous runs of near
        equal tokens, each sequence whole with its drafts and forks): pipeline stages work on
        different ones at once. None where the runner takes one batch."""
        if self.runner.microbatches < 2 or len(items) < 2:
            return None
        counts = [i.num_query_tokens + len(drafts.get(i.seq.seq_id, ())) for i in items]
        wanted = min(self.runner.microbatches, sum(counts) // self.runner.microbatch_min_tokens)
        if wanted < 2:
            return None
        parts = []
        for start, end in split_for_microbatches(counts, wanted):
            run = items[start:end]
            ids = {i.seq.seq_id for i in run}
            parts.append(build_batch(run, self.cache, self.runner.device,
                                     {k: v for k, v in drafts.items() if k in ids},
                                     {k: v for k, v in forks.items() if k in ids}))
        return parts

    def _run_isolating_faults(self, plan: StepPlan) -> tuple[StepPlan, torch.Tensor, list[list[int]]] | None:
        """Forward and decode ``plan``. If that raises, run each request alone, abort the ones
        whose own run raises (``failures``) and run the rest again; re-raise when no single
        request reproduces the error. None: no request is left to run. Under tensor or
        pipeline parallelism a step that raises is fatal: the ranks cannot rerun requests alone
        in step."""
        if self.sync is not None:
            return (plan, *self._forward_and_decode(plan.batch, plan.parts))
        try:
            return (plan, *self._forward_and_decode(plan.batch, plan.parts))
        except Exception:
            culprits = self._find_culprits(plan)
            if not culprits:
                raise
        for request_id, exc in culprits.items():
            self.failures[request_id] = exc
            self.abort(request_id)
        out = plan.out
        out.scheduled = [i for i in out.scheduled if i.seq.request_id not in culprits]
        if not out.scheduled:
            return None
        kept = {i.seq.seq_id for i in out.scheduled}
        plan = self._pack(out, {k: v for k, v in plan.drafts.items() if k in kept},
                          {k: v for k, v in plan.forks.items() if k in kept})
        return (plan, *self._forward_and_decode(plan.batch, plan.parts))

    def _find_culprits(self, plan: StepPlan) -> dict[str, BaseException]:
        def run_alone(item: ScheduledSeq) -> None:
            sid = item.seq.seq_id
            drafts = {sid: plan.drafts[sid]} if sid in plan.drafts else {}
            forks = {sid: plan.forks[sid]} if sid in plan.forks else {}
            self._forward_and_decode(build_batch([item], self.cache, self.runner.device, drafts, forks,
                                                 multimodal=bool(self._with_images)))

        children = [c for cs in plan.forks.values() for c in cs]
        return find_culprits(plan.out.scheduled, children, run_alone)

    def _forward_and_decode(self, batch: BatchMetadata, parts: list[BatchMetadata] | None = None
                            ) -> tuple[torch.Tensor, list[list[int]]]:
        """The batch's logits (as the model gave them: logprobs read these) and each sample
        slot's accepted tokens (the decoder's side of the contract checked); ``parts``, its
        micro-batches on a pipeline stage."""
        start = time.perf_counter()
        logits = self._forward(batch, parts=parts) if parts else self._forward(batch)
        start = self.stats.add_phase("forward", start)
        # the decoder reads the sample rows only; prompt-scoring rows follow them
        sampled = logits[:batch.num_sample_rows] if batch.prompt_rows else logits
        sampled = self.processors.apply(sampled, self.processors.plan(batch))
        # a step of prefill chunks only (none reaching its prompt's end) samples nothing
        tokens = self.decoder.decode(sampled, batch) if batch.samples else []
        if self.sync is not None and batch.samples:
            tokens = self.sync.tokens(tokens)
        contracts.check_decoded(self.decoder, tokens, batch, logits.shape[-1])
        self.stats.add_phase("sample", start)
        return logits, tokens

    def _forward(self, batch: BatchMetadata, **kwargs: Any) -> torch.Tensor:
        """The model's forward over ``batch``; on the engine's first (or, with
        ``TESSELLM_CHECK_CONTRACTS``, every) forward, checked to store every layer's new K/V."""
        check = self._kv_check
        if not check.wanted():
            return self.runner.forward(batch, **kwargs)
        marked = check.mark(batch)
        logits = self.runner.forward(batch, **kwargs)
        check.verify(batch, marked)
        return logits

    def _advance(self, plan: StepPlan) -> None:
        """Every query token (chunk, last token, drafts) now has KV in the cache; children of
        a completed prompt take over its cache (or recompute it where it cannot be shared)."""
        for item in plan.out.scheduled:
            item.seq.num_computed_tokens += item.num_query_tokens + len(plan.drafts.get(item.seq.seq_id, ()))
        for parent_id, children in plan.forks.items():
            parent = next(i.seq for i in plan.out.scheduled if i.seq.seq_id == parent_id)
            for child in children:
                if child.is_finished:  # its group ended in this very step (beam search, max_tokens 1)
                    continue
                if self.cache.can_fork(parent):
                    child.num_computed_tokens = parent.num_computed_tokens
                    self.cache.fork(parent, child)
                else:
                    child.num_computed_tokens = 0
                self.scheduler.adopt(child)
            self.requests[parent.request_id].forked = True

    def _collect_in_flight(self) -> None:
        step, self._in_flight = self._in_flight, None
        self._collect(step)

    def _collect(self, step: LaunchedStep) -> None:
        """Take a launched step's tokens (waiting for them if they are on their way from the
        device), append them, and end the step."""
        collecting = time.perf_counter()
        if step.ready is not None:
            step.ready.synchronize()
            self.stats.device_wait_seconds += time.perf_counter() - collecting
        if step.tokens is None:  # launched ahead: one token per sample slot
            step.tokens = [[t] for t in step.host.tolist()]
        self._append_tokens(step)
        self._end_step(step.out, step.batch, step.start)
        self.stats.add_phase("process", collecting)

    def _append_tokens(self, step: LaunchedStep) -> None:
        """Append each slot's accepted tokens (with their logprobs) until the stop rule fires,
        rolling back the KV of drafts the decoder rejected. A step launched ahead already
        counts its tokens as pending (``holds_pending``) and its processors took them on the
        device."""
        batch, tokens, holds = step.batch, step.tokens, step.holds_pending
        lps_of = token_logprobs(step.logits, batch, tokens) if step.logits is not None else None
        stats, bound, appended, now = self.stats, self.processors.bound, [], time.perf_counter()
        finished, check = SequenceStatus.FINISHED, self.stop.check
        for i, (slot, accepted) in enumerate(zip(batch.samples, tokens)):
            seq = slot.seq
            if holds and seq.seq_id in holds:
                seq.num_pending -= 1
            if seq.status is finished:  # aborted meanwhile, or its request failed in this loop (grammar)
                continue
            stats.sample_slots += 1
            lps = lps_of[i] if lps_of is not None else None
            tracked = bool(bound) and holds is None and seq.seq_id in bound  # (no processor live: one test per slot)
            if not tracked and lps is None and not slot.draft_tokens:  # the common case, spelled out
                token = accepted[0]
                seq.token_ids.append(token)
                stats.generated_tokens += 1
                if seq.first_token_time is None:
                    seq.first_token_time = now
                reason = check(seq, token)
                if reason is not None:
                    self._finish(seq, reason)
                continue
            if tracked:
                appended.append((seq, len(seq.token_ids)))
            stats.draft_tokens += len(slot.draft_tokens)
            stats.accepted_draft_tokens += len(accepted) - 1
            rejected = len(slot.draft_tokens) - (len(accepted) - 1)
            if rejected > 0:
                seq.num_computed_tokens -= rejected
                self.cache.truncate(seq, seq.num_computed_tokens)
            self._append_accepted(seq, accepted, lps, tracked and seq.params.structured_output is not None)
        if appended:  # the processors of the sequences still running learn their new tokens
            self.processors.accept([(seq, seq.token_ids[start:]) for seq, start in appended if not seq.is_finished])

    def _append_accepted(self, seq: Sequence, accepted: list[int], lps: list | None, constrained: bool) -> None:
        for i, token in enumerate(accepted):
            if constrained and not self.grammar.accept(seq, token):
                self._refused_by_grammar(seq, token)
                return
            if lps is not None:
                seq.logprobs.append(lps[i])
            if self._append(seq, token):
                return
            if constrained and self.grammar.is_complete(seq):  # ended by the grammar (ignore_eos)
                self._finish(seq, FinishReason.STOP)
                return

    def _refused_by_grammar(self, seq: Sequence, token: int) -> None:
        """A decoder picked a token its masked logits ruled out: fail that request alone."""
        self.failures[seq.request_id] = RuntimeError(
            f"decoding plugin {self.decoder.name!r} picked token {token}, which the request's grammar "
            f"({seq.params.structured_output.describe()}) forbids: a decoder must pick from the logits it is given")
        self.abort(seq.request_id)

    def _append(self, seq: Sequence, token: int) -> bool:
        """Append a generated token; finish the sequence if the stop rule fires. True if it did."""
        seq.token_ids.append(token)
        self.stats.generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        reason = self.stop.check(seq, token)
        if reason is None:
            return False
        self._finish(seq, reason)
        return True

    def _end_step(self, out: SchedulerOutput, batch: BatchMetadata, start: float) -> None:
        """After a step's tokens are appended: index newly full blocks, count the step, and
        hold the requests it finished for ``step`` to hand out."""
        finished, commit = SequenceStatus.FINISHED, self.cache.commit
        for item in out.scheduled:
            if item.seq.status is not finished:
                commit(item.seq)
        for slot in batch.samples:
            seq = slot.seq
            if seq.status is finished and seq.request_id not in self._finished:
                state = self.requests.get(seq.request_id)
                if state is not None and state.finished:
                    self._finished[seq.request_id] = state
        self._sample_memory(len(out.scheduled))
        self.stats.steps += 1
        self.stats.step_seconds.append(time.perf_counter() - start)

    def _plan_forks(self, out: SchedulerOutput) -> dict[int, list[Sequence]]:
        """Sequences of n > 1 requests whose prompt completes this step fork now, sampling
        from the parent's logits; their cache is forked after the forward."""
        forks: dict[int, list[Sequence]] = {}
        for item in out.scheduled:
            seq = item.seq
            state = self.requests.get(seq.request_id)
            width = seq.group_size  # params.n, or a beam search's num_beams
            if state is None or state.forked or width == 1:
                continue
            if seq.num_computed_tokens + item.num_query_tokens == seq.num_tokens:
                children = []
                for i in range(1, width):
                    child = seq.fork(i)
                    child.joint, child.group_size = seq.joint, seq.group_size
                    child.generator = self._generator(state.params, i)
                    children.append(child)
                state.seqs.extend(children)
                forks[seq.seq_id] = children
                if seq.seq_id in self._with_images:
                    self._with_images.update(child.seq_id for child in children)
                binding = self.processors.binding(seq)
                for child in children:
                    self.processors.add(child, binding)
                    if child.lora_slot >= 0:  # each sample holds the adapter's slot until it finishes
                        self.lora.pin(child.lora_slot)
        return forks

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        # index the blocks it filled before the scheduler frees them: a request that ends in
        # the step its prompt completes (max_tokens 1: scoring) never reaches _end_step's commit
        if seq.num_cached_tokens is not None and not seq.num_pending:  # it ran, and every computed token is known
            self.cache.commit(seq)
        self._device_ok.pop(seq.seq_id, None)
        if seq.multimodal is not None:
            self._with_images.discard(seq.seq_id)
            seq.multimodal.embeds.clear()  # a fork recomputing after a preemption finds them again
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.processors.remove(seq)
        if seq in self._lora_waiting:  # never reached the scheduler
            self._lora_waiting.remove(seq)
        else:
            self.scheduler.finish(seq)
        self.decoder.finish(seq)
        self._let_go_of_slot(seq)

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

    def _note_kernel_builds(self, count: int) -> None:
        self.stats.kernel_builds += count
        logger.info("step %d built %d new Triton kernel variant(s) and stalled for the compile (kernels built so "
                    "far: %s); start-up warm-up did not cover this step's shapes", self.stats.steps, count,
                    ", ".join(f"{k} x{n}" for k, n in build_log.by_kernel.items()))

    # ------------------------------------------------------------------ scoring

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [len(token_ids), vocab] (float32; float64 in a float64 pipeline) at every
        position of ``token_ids``, run as one prefill of its own (teacher forcing): for
        equivalence checks, KL and perplexity."""
        if self.sync is not None:
            self.sync.score(token_ids)
        return score_tokens(self.runner, self.cache, token_ids, self.max_model_len)


def _inputs_from(previous: LaunchedStep, batch: BatchMetadata, decodes: bool) -> None:
    """Fill ``batch``'s rows of tokens still on the device from the previous step's."""
    if decodes and batch.seqs == previous.batch.seqs and len(previous.batch.samples) == len(batch.seqs):
        # the steady state: the same sequences in the same order, each one pending token
        # behind (one query row and one sampled row each): the inputs are the tokens
        batch.input_ids.copy_(previous.device_tokens)
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
        batch.input_ids[index[0]] = previous.device_tokens.index_select(0, index[1])
