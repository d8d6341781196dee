"""The engine core's loop: messages in (serve/engine_protocol.py), engine steps, messages out.

One ``EngineCore`` owns an ``LLM``'s engine and touches it from one thread only: in the
engine core process (serve/engine_process.py, the server's default) or on a thread of the
server (``--engine-core thread``, for debugging). Each pass of ``run``:

1. carries out the messages that arrived (adds, aborts, calls), so an abort takes effect
   before the next step;
2. finishes what waited off the loop (a grammar compiled, a LoRA folder read, each on a
   worker thread) and admits or answers it;
3. steps the engine if it holds work (a step that raises fails the requests it was running;
   a request whose own run raised fails alone);
4. sends one ``step`` message: each live request's new token ids, the requests refused,
   failed, admitted and aborted, and the gauges (at most every ``GAUGE_INTERVAL_S``, and
   whenever the engine goes idle).

Request kinds: a kind's handler (``CORE_KINDS``) admits its payload and reports each
request's progress as a record; ``generate`` is the one here, ``pool`` (embeddings and scores)
serve/pooling_kind.py's. Utility calls (``CORE_CALLS``)
run between two steps; one that needs slow work returns ``Deferred``.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from tessellm.core.engine.gc_freeze import frozen_heap
from tessellm.core.engine.llm import prompt_logprobs_of
from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.decoder import Decoder
from tessellm.core.interfaces.sequence import Sequence, SequenceStatus
from tessellm.core.parallel.group import TensorParallelError
from tessellm.serve.engine_protocol import (EngineInfo, decode_images, decode_params, encode_error, encode_logprobs,
                                            is_compact, pack, unpack)
from tessellm.serve.pooling_kind import PoolKind

logger = logging.getLogger("tessellm.server")

GAUGE_INTERVAL_S = 0.02
"""Gauges are sent at most this often while the engine steps (and always when it goes idle)."""
STEP_STARTS_KEPT = 256
"""How many recent steps' start times an abort's age is counted against."""
IDLE_WAIT_S = 1.0
PENDING_WAIT_S = 0.005
"""How long the loop waits for a message while work runs on a worker thread."""


@dataclass
class Deferred:
    """A call's result that needs slow work first: ``future`` (on a worker thread), then
    ``then(its result)`` on the loop."""

    future: Future
    then: Callable[[Any], Any]


@dataclass
class Progress:
    """What a live generate request has been sent: tokens per sample, samples ended, whether
    its first record went out."""

    emitted: dict[int, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    started: bool = False
    interval: int = 1
    """After the first record, one is sent once a sample holds this many new tokens (or
    finished): the payload's ``stream_interval``."""


class GenerateKind:
    """``generate``: a prompt's token ids with its sampling. Payload: ``prompt``, ``params``
    (``SamplingParams`` fields), ``priority``, ``cache_salt``, ``lora``, ``images`` (the
    prompt's processed images, ``encode_images``; absent for a text prompt),
    ``stream_interval`` (after the first record, one every that many new tokens of a sample,
    and at its end; 1 if absent). Record:
    ``[request_id, finished, samples, prompt_tokens, completion_tokens, cached_tokens,
    prompt_logprobs]``, a sample ``[index, new_token_ids, finish_reason, logprobs,
    stop_text_len]``; after the first, a decode step of one sample without logprobs that
    did not finish it is the compact ``[request_id, new_token_ids]``."""

    name = "generate"

    def admit(self, core: "EngineCore", request_id: str, payload: dict[str, Any]) -> Future | None:
        """Add the request; or, for a grammar not compiled yet, a future that compiles it
        (the request is added when it is done)."""
        params = decode_params(payload["params"])
        if params.structured_output is not None and core.engine.grammar.backend is not None:
            return core.pool.submit(_compile, core.engine.grammar, params.structured_output)
        self.add(core, request_id, payload, params)
        return None

    def add(self, core: "EngineCore", request_id: str, payload: dict[str, Any], params: Any = None) -> None:
        params = params or decode_params(payload["params"])
        core.engine.add_request(request_id, payload["prompt"], params, priority=payload.get("priority", 0),
                                cache_salt=payload.get("cache_salt"), lora=payload.get("lora"),
                                images=decode_images(payload.get("images")))
        core.admitted.append([request_id, len(payload["prompt"])])

    def record(self, core: "EngineCore", request_id: str, progress: Progress) -> list[Any] | None:
        """The request's progress since its last record (None: nothing new)."""
        state = core.engine.requests.get(request_id)
        if state is None:
            return None
        seqs = state.seqs
        if progress.started and len(seqs) == 1:  # the common case, spelled out: a running sample's decode step
            seq = seqs[0]
            if not seq.is_finished and seq.params.logprobs is None and not seq.joint:
                sent = progress.emitted.get(0, 0)
                held = len(seq.token_ids) - seq.num_prompt_tokens
                if held - sent < progress.interval:
                    return None
                progress.emitted[0] = held
                return [request_id, seq.token_ids[seq.num_prompt_tokens + sent:]]  # compact
        if state.seqs[0].joint and not state.finished:
            return None  # beams are regrouped every step: their tokens are final only at the end
        if progress.started and not state.finished and not self._due(progress, seqs):
            return None
        samples = [s for s in (self._sample(progress, seq) for seq in state.seqs) if s is not None]
        if not samples and not state.finished:
            return None
        first = state.seqs[0]
        completion = sum(s.num_output_tokens for s in state.seqs)
        prompt_lps = None if progress.started else encode_logprobs(prompt_logprobs_of(first))
        progress.started = True
        if state.finished:
            core.engine.pop_finished(request_id)
        return [request_id, state.finished, samples, first.num_prompt_tokens, completion,
                first.num_cached_tokens or 0, prompt_lps]

    @staticmethod
    def _due(progress: Progress, seqs: list[Sequence]) -> bool:
        """Whether a running request's samples hold enough new tokens (``progress.interval``),
        or one finished, for a record."""
        for seq in seqs:
            if seq.sample_index in progress.done:
                continue
            held = len(seq.token_ids) - seq.num_prompt_tokens - progress.emitted.get(seq.sample_index, 0)
            if seq.is_finished or held >= progress.interval:
                return True
        return False

    @staticmethod
    def _sample(progress: Progress, seq: Sequence) -> list[Any] | None:
        index = seq.sample_index
        if index in progress.done:
            return None
        sent = progress.emitted.get(index, 0)
        new = seq.token_ids[seq.num_prompt_tokens + sent:]
        if not new and not seq.is_finished:
            return None
        progress.emitted[index] = sent + len(new)
        reason = cut = None
        if seq.is_finished:
            progress.done.add(index)
            reason, cut = (seq.finish_reason.value if seq.finish_reason else None), seq.stop_text_len
        lps = encode_logprobs(seq.logprobs[sent:sent + len(new)]) if seq.params.logprobs is not None else None
        return [index, new, reason, lps, cut]


def _compile(grammar: Any, spec: Any) -> Any:
    """A request's grammar compiled (on a worker thread); a refusal is about its ``structured_output``."""
    try:
        return grammar.compile(spec)
    except InvalidRequestError as exc:
        if exc.field is None:
            exc.field = "structured_output"
        raise


CORE_KINDS: dict[str, Any] = {"generate": GenerateKind(), "pool": PoolKind()}
"""Request kinds the core admits, by name (the API side's are serve/engine_protocol.py's
``REQUEST_KINDS``)."""


def _load_lora(core: "EngineCore", name: str, path: str) -> Deferred:
    lora = core.llm.pipeline.lora
    if lora is None:
        raise InvalidRequestError("this pipeline serves no LoRA adapters; start it with lora.enabled=true "
                                  "(or lora.runtime_updates=true) to load them at run time")

    def register(adapter: Any) -> str:
        core.engine.load_lora(name, path, adapter)
        return core.engine.lora.get(name).path

    return Deferred(core.pool.submit(lora.reader.read, name, path), register)  # read off the loop


def _unload_lora(core: "EngineCore", name: str) -> None:
    core.engine.unload_lora(name)


CORE_CALLS: dict[str, Callable[..., Any]] = {"load_lora": _load_lora, "unload_lora": _unload_lora}
"""Utility calls by name: ``fn(core, *args)`` -> a result (msgpack-able) or ``Deferred``."""


def engine_info(llm: Any) -> EngineInfo:
    pipeline, engine = llm.pipeline, llm.engine
    lora = engine.lora
    return EngineInfo(model=pipeline.config.model, max_model_len=pipeline.resolved.max_model_len,
                      vocab_size=pipeline.spec.vocab_size, decoder=engine.decoder.name,
                      joint_decoding=type(engine.decoder).joint is not Decoder.joint,
                      lora=lora is not None,
                      lora_adapters={n: a.path for n, a in lora.adapters.items()} if lora is not None else {},
                      lora_runtime_updates=lora is not None and pipeline.config.lora.runtime_updates,
                      total_blocks=pipeline.cache.num_blocks, pid=os.getpid(), request_kinds=sorted(CORE_KINDS),
                      gauges=gauges(engine, 0.0), **pooling_info(pipeline))


def pooling_info(pipeline: Any) -> dict[str, Any]:
    """What the API side needs of a pipeline's pooling: its task, its pooler, and how an
    embedding pipeline scores pairs (the checkpoint's similarity, the prompts of each side)."""
    from tessellm.core.engine.embed import similarity_prompts

    said = pipeline.checkpoint_pooling
    query_prompt, document_prompt = similarity_prompts(said)
    return {"task": pipeline.task, "pooler": None if pipeline.pooler is None else pipeline.pooler.name,
            "similarity": said.similarity, "query_prompt": query_prompt, "document_prompt": document_prompt}


def gauges(engine: Any, cpu_seconds: float) -> dict[str, Any]:
    """What /metrics shows of the engine: queue, blocks, prefix cache, tiers, LoRA, steps."""
    cache, stats = engine.cache, engine.stats
    prefix = cache.prefix_cache_stats()
    lora = engine.lora
    return {"running": engine.scheduler.num_running, "waiting": engine.scheduler.num_waiting,
            "free_blocks": cache.num_free_blocks, "total_blocks": cache.num_blocks,
            "prefix": [prefix.queried_tokens, prefix.hit_tokens, prefix.hit_rate],
            "tiers": {name: dict(c) for name, c in prefix.tiers.items()},
            "lora": None if lora is None else [len(lora.adapters), len(lora.resident()), lora.num_pinned(), lora.loads],
            "steps": stats.steps, "phases": dict(stats.phase_seconds), "cpu": cpu_seconds}


class EngineCore:
    """The loop around ``llm.engine``; ``send(bytes)`` hands a packed message to the API side."""

    def __init__(self, llm: Any, send: Callable[[bytes], None], *, cpu_clock: Callable[[], float] = time.process_time):
        self.llm = llm
        self.engine = llm.engine
        self.send = send
        self.cpu_clock = cpu_clock  # the core's CPU time: its process's, or its thread's
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tessellm-core-worker")
        self.live: dict[str, tuple[Any, Progress]] = {}
        self.waiting_admission: list[tuple[Future, Any, str, dict[str, Any]]] = []
        self.deferred_calls: list[tuple[int, Deferred]] = []
        self.records: list[list[Any]] = []
        self.errors: list[list[Any]] = []
        self.admitted: list[list[Any]] = []
        self.aborted: list[list[Any]] = []
        self.step_errors = 0  # steps that raised, and bugs outside steps
        self.stopping = False
        self.steps_started = 0
        self._step_starts: deque[float] = deque(maxlen=STEP_STARTS_KEPT)  # time.monotonic() of recent steps
        self._gauges_sent = 0.0
        self._changed = True  # something the gauges show changed since they were sent

    @property
    def has_pending(self) -> bool:
        return bool(self.waiting_admission or self.deferred_calls)

    # ------------------------------------------------------------------ messages in

    def handle(self, data: bytes) -> None:
        message = unpack(data)
        what = message[0]
        self._changed = True
        if what == "add":
            self._add(*message[1:])
        elif what == "abort":
            self._abort(message[1], message[2])
        elif what == "call":
            self._call(*message[1:])
        elif what == "stop":
            self.stopping = True
        else:
            logger.error("engine core: unknown message %r ignored", what)

    def _add(self, request_id: str, kind_name: str, payload: dict[str, Any]) -> None:
        kind = CORE_KINDS.get(kind_name)
        try:
            if kind is None:
                raise InvalidRequestError(f"this engine serves no {kind_name!r} requests; it serves "
                                          f"{', '.join(sorted(CORE_KINDS))}")
            waiting = kind.admit(self, request_id, payload)
        except Exception as exc:  # refused at admission: the request's error, not the loop's
            self.errors.append([request_id, *encode_error(exc)])
            return
        if waiting is not None:
            self.waiting_admission.append((waiting, kind, request_id, payload))
        else:
            self.live[request_id] = (kind, Progress(interval=payload.get("stream_interval", 1)))

    def _abort(self, request_ids: list[str], asked_at: float) -> None:
        # The steps started by the time the API side asked (its time.monotonic(): one clock for
        # every process of the host), not the steps its last gauges showed, which lag.
        asked = self.steps_started - sum(1 for start in self._step_starts if start > asked_at)
        for request_id in request_ids:
            self.waiting_admission = [w for w in self.waiting_admission if w[2] != request_id]
            if self.live.pop(request_id, None) is not None or request_id in self.engine.requests:
                self.engine.abort(request_id)
                self.aborted.append([request_id, asked, self.steps_started])

    def _call(self, call_id: int, method: str, args: list[Any]) -> None:
        fn = CORE_CALLS.get(method)
        try:
            if fn is None:
                raise InvalidRequestError(f"unknown engine call {method!r}; known: {', '.join(sorted(CORE_CALLS))}")
            result = fn(self, *args)
        except Exception as exc:  # handed to the caller, whose answer reports it
            self.send(pack(["result", call_id, False, encode_error(exc)]))
            return
        if isinstance(result, Deferred):
            self.deferred_calls.append((call_id, result))
        else:
            self.send(pack(["result", call_id, True, result]))

    def settle_pending(self) -> None:
        """Admit the requests whose grammar compiled, answer the calls whose work finished."""
        waiting, self.waiting_admission = self.waiting_admission, []
        for future, kind, request_id, payload in waiting:
            if not future.done():
                self.waiting_admission.append((future, kind, request_id, payload))
                continue
            try:
                future.result()
                kind.add(self, request_id, payload)
            except Exception as exc:
                self.errors.append([request_id, *encode_error(exc)])
                continue
            self.live[request_id] = (kind, Progress(interval=payload.get("stream_interval", 1)))
            self._changed = True
        calls, self.deferred_calls = self.deferred_calls, []
        for call_id, deferred in calls:
            if not deferred.future.done():
                self.deferred_calls.append((call_id, deferred))
                continue
            try:
                result = [True, deferred.then(deferred.future.result())]
            except Exception as exc:
                result = [False, encode_error(exc)]
            self.send(pack(["result", call_id, *result]))
            self._changed = True

    # ------------------------------------------------------------------ the loop

    def run(self, receive: Callable[[float], list[bytes]]) -> None:
        """Until a ``stop`` message: ``receive(timeout)`` returns the messages that arrived
        (waiting up to ``timeout`` seconds for the first)."""
        with frozen_heap():  # for the loop's life: full collections skip the pipeline's objects
            while not self.stopping:
                busy = self.engine.has_unfinished()
                wait = 0.0 if busy else (PENDING_WAIT_S if self.has_pending else IDLE_WAIT_S)
                arrived = receive(wait)
                with self.engine.lock:  # an LLM call on a thread of this process waits for the pass
                    for data in arrived:
                        self.handle(data)
                    try:
                        self.iteration()
                    except Exception:  # a bug outside stepping (publishing, gauges): log it, keep serving
                        self.step_errors += 1
                        logger.exception("tessellm engine core: error outside a step")
        self.pool.shutdown(wait=False, cancel_futures=True)

    def iteration(self) -> None:
        """Settle what waited, step if there is work, send what happened."""
        if self.has_pending:
            self.settle_pending()
        stepped = self.engine.has_unfinished()
        if stepped:
            self._step()
        output = time.perf_counter()
        for request_id, exc in [(r, e) for r, e in self.engine.failures.items() if r in self.live]:
            self._fail(request_id, exc)
        self.engine.failures.clear()  # any other entry belongs to a request nobody waits for
        self._collect_records()
        if stepped:
            stats = self.engine.stats
            stats.phase_seconds["output"] = stats.phase_seconds.get("output", 0.0) + time.perf_counter() - output
        self.flush(stepped)

    def _step(self) -> None:
        self.steps_started += 1
        self._step_starts.append(time.monotonic())
        try:
            self.engine.step()  # fails only the requests whose own forward raises
        except TensorParallelError as exc:  # another rank is gone: this one cannot step again
            self.step_errors += 1
            self._fail_running(exc)
            self.flush(True)
            logger.critical("%s; the engine core stops", exc)
            os._exit(1)
        except Exception as exc:  # a fault no single request reproduces: fail the running ones
            self.step_errors += 1
            logger.error("tessellm engine core: a step failed (%s: %s); its running requests fail",
                         type(exc).__name__, exc)
            self._fail_running(exc)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        self.live.pop(request_id, None)
        self.errors.append([request_id, "RequestFailed",
                            f"the engine failed while running this request: {type(exc).__name__}: {exc}", None])

    def _fail_running(self, exc: Exception) -> None:
        """Fail and abort the requests that were running when the step raised (the step's
        batch); waiting requests are untouched."""
        running = {s.request_id for s in self.engine.scheduler.unfinished() if s.status is SequenceStatus.RUNNING}
        for request_id in running:
            self.engine.abort(request_id)
            if request_id in self.live:
                self._fail(request_id, exc)

    def _collect_records(self) -> None:
        for request_id, (kind, progress) in list(self.live.items()):
            record = kind.record(self, request_id, progress)
            if record is None:
                continue
            self.records.append(record)
            if not is_compact(record) and record[1]:  # finished
                del self.live[request_id]

    def flush(self, stepped: bool) -> None:
        """Send what this pass produced, with the gauges when they are due."""
        now = time.monotonic()
        idle = not self.engine.has_unfinished()
        due = self._changed or stepped
        g = None
        if due and (idle or now - self._gauges_sent >= GAUGE_INTERVAL_S):
            g = gauges(self.engine, self.cpu_clock())
            self._gauges_sent, self._changed = now, False
        if not (self.records or self.errors or self.admitted or self.aborted or g is not None):
            return
        message = ["step", self.records, self.errors, self.admitted, self.aborted, g]
        self.records, self.errors, self.admitted, self.aborted = [], [], [], []
        self.send(pack(message))

    def fail_everything(self, reason: str) -> None:
        """Fail every live request (the core is going away)."""
        for request_id in list(self.live):
            self.engine.abort(request_id)
            self.errors.append([request_id, "RequestFailed", reason, None])
        self.live.clear()
        self.flush(True)
