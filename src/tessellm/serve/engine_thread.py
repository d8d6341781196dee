"""One engine loop for many concurrent clients: the engine steps on a background thread;
coroutines submit requests and receive each step's new tokens and text as they are produced.

Every touch of the engine happens on its thread: coroutines only put commands (add, abort,
or a call such as loading a LoRA adapter) on a queue and read per-request asyncio queues
that the thread fills with ``loop.call_soon_threadsafe``. So requests from all connections
are batched by the configured scheduler, and a client that goes away aborts its request,
which frees its blocks.

The engine thread hands out token ids only (its work per step is proportional to the new
tokens); each request's coroutine turns them into text as it reads them (``RequestText``:
incremental, a few tokens decoded per step), so detokenizing never lengthens a step. The
thread also records the server's metrics per engine request (``ServerMetrics``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from tessellm.core.engine.request import RequestState
from tessellm.core.engine.llm import prompt_logprobs_of
from tessellm.core.errors import RequestRejectedError
from tessellm.core.parallel.group import TensorParallelError
from tessellm.core.engine.gc_freeze import frozen_heap
from tessellm.core.interfaces.sequence import (FinishReason, SamplingParams, Sequence, SequenceStatus,
                                               TokenLogprob)
from tessellm.serve.detokenize import RequestText


logger = logging.getLogger("tessellm.server")


@dataclass
class SampleDelta:
    """What one sample gained in a step: new token ids and text, and its finish reason."""

    index: int
    token_ids: list[int]
    text: str
    """Filled in by the coroutine that reads the request's stream (``RequestText``)."""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    """One per new token, when the request asked for logprobs."""
    stop_text_len: int | None = None
    """On a sample's final delta: where a stop string begins in the text of its whole output
    (the text ends there), or None."""


@dataclass
class StepOutput:
    """A request's progress in one step; ``finished`` once every sample has finished."""

    request_id: str
    samples: list[SampleDelta]
    finished: bool
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """On a request's first output, when it asked for prompt logprobs: one per prompt token
    (None for the first)."""


class RequestFailed(RuntimeError):
    """The engine raised while stepping this request; the request is aborted."""


class ServerBusy(RequestRejectedError):
    """The waiting queue is full: retry later (a server answers 429)."""


@dataclass
class _Stream:
    """A request's link to its coroutine; the engine thread owns every field but ``queue``'s
    reading end."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float  # time.perf_counter() when the coroutine submitted the request
    emitted: dict[int, int] = field(default_factory=dict)  # sample index -> tokens sent
    done: set[int] = field(default_factory=set)  # samples whose final delta was sent
    started: bool = False  # an output was sent
    first_token_seen: bool = False  # its time to first token was recorded

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineThread:
    """Runs ``llm.engine`` on one background thread for many coroutines.

    ``generate(request_id, prompt_ids, params)`` is an async iterator of ``StepOutput``; it
    raises the engine's ``InvalidRequestError`` / ``RequestRejectedError`` on admission and
    ``RequestFailed`` if stepping fails. Leaving the iterator early (a client disconnect;
    the server closes the iterator as soon as it sees one) aborts the request: the engine
    thread stops it before its next step, and ``aborts`` records, for the most recent aborted
    requests, the engine steps counted when the abort was asked for and when it was done.
    ``metrics`` (a ``ServerMetrics``) records every engine request's admission, tokens,
    latencies and end; ``on_step`` (by default ``metrics.on_step``: the gauges) runs after
    every step, and after commands that changed the engine while it had no step to run.
    ``max_waiting`` bounds requests admitted but not yet running: beyond it ``generate``
    raises ``RequestRejectedError`` at once (a server answers 429).
    """

    def __init__(self, llm: Any, *, max_waiting: int | None = None,
                 on_step: Callable[[Any], None] | None = None, metrics: Any | None = None):
        self.llm = llm
        self.engine = llm.engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.on_step = on_step if on_step is not None or metrics is None else metrics.on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tessellm-engine", daemon=True)
        self.errors = 0  # steps that raised
        self.aborts: deque[tuple[str, int, int]] = deque(maxlen=1000)
        """(request id, engine steps when its abort was asked for, engine steps when it was done)."""
        # Hugging Face fast tokenizers may raise "Already borrowed" when one thread encodes while
        # another decodes: every tokenizer call of the server and the engine (its stop rule) takes this lock
        self.tokenizer_lock = getattr(llm.pipeline, "tokenizer_lock", None) or threading.Lock()

    # ------------------------------------------------------------------ coroutine side

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        close = getattr(self.llm, "close", None)
        if close is not None and not self._thread.is_alive():
            close()  # e.g. a disk KV tier's queued writes reach the disk before the process exits

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       **kwargs: Any) -> AsyncIterator[StepOutput]:
        arrival = time.perf_counter()
        if self.max_waiting is not None and self.num_waiting() >= self.max_waiting:
            if self.metrics is not None:
                self.metrics.request_rejected("busy")
            raise ServerBusy(f"the server is busy: {self.num_waiting()} requests are waiting "
                             f"(limit {self.max_waiting}); retry later")
        loop = asyncio.get_running_loop()
        if params.structured_output is not None:  # compile off the engine's thread (cached: once per grammar)
            await loop.run_in_executor(None, self.engine.grammar.compile, params.structured_output)
        stream = _Stream(loop, asyncio.Queue(), arrival)
        text = RequestText(self._decode, params.stop)  # detokenized here, as the outputs are read
        self._commands.put(("add", request_id, prompt_ids, params, kwargs, stream))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it
                    raise item
                yield text.fill(item)
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop ``request_id`` before the engine's next step (any thread; unknown ids are ignored)."""
        self._commands.put(("abort", request_id, self.engine.stats.steps))
        self._wake.set()

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(self.engine, *args)`` run on the engine thread between two steps (a change of
        the engine's state, such as loading a LoRA adapter); its result, or its exception.
        ``fn`` runs to its end even if the caller is cancelled while waiting."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(("call", fn, args, loop, future))
        self._wake.set()
        return await future

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        with frozen_heap():  # for the loop's life: full collections skip the pipeline's objects
            while not self._stopping:
                try:
                    self._iteration()
                except Exception:  # a bug outside stepping (publishing, metrics): log it, keep serving
                    self.errors += 1
                    logger.exception("tessellm engine loop: error outside a step")

    def _iteration(self) -> None:
        """One pass: take commands, step if there is work, publish what the step produced."""
        changed = self._drain_commands()
        if not self.engine.has_unfinished():
            if changed and self.on_step is not None:  # no step follows to refresh the gauges
                self.on_step(self.engine)
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            return
        try:
            self.engine.step()  # fails only the requests whose own forward raises
        except TensorParallelError as exc:  # another rank is gone: this one cannot step again
            self.errors += 1
            self._fail_running(exc)
            logger.critical("%s; the server stops", exc)
            os._exit(1)
        except Exception as exc:  # a fault no single request reproduces: fail the running ones
            self.errors += 1
            self._fail_running(exc)
        for request_id in [r for r in self.engine.failures if r in self._streams]:
            self.errors += 1
            exc = self.engine.failures.pop(request_id)
            self._streams.pop(request_id).put(RequestFailed(
                f"the engine failed while running this request: {type(exc).__name__}: {exc}"))
            self._record_aborted("failed")
        self.engine.failures.clear()  # any other entry belongs to a request nobody waits for
        self._publish()
        if self.on_step is not None:
            self.on_step(self.engine)

    def _drain_commands(self) -> bool:
        """Carry out the queued adds and aborts; whether there were any."""
        changed = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return changed
            changed = True
            if command[0] == "add":
                self._add(*command[1:])
            elif command[0] == "call":
                self._call(*command[1:])
            else:
                _, request_id, asked_at = command
                if self._streams.pop(request_id, None) is not None:  # not yet ended: its end is this abort
                    self._record_aborted("cancelled")
                if request_id in self.engine.requests:
                    self.engine.abort(request_id)
                    self.aborts.append((request_id, asked_at, self.engine.stats.steps))

    def _add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, kwargs: dict[str, Any],
             stream: _Stream) -> None:
        try:
            self.engine.add_request(request_id, prompt_ids, params, **kwargs)
        except Exception as exc:
            if self.metrics is not None:
                self.metrics.request_rejected("invalid")
            stream.put(exc)
            return
        self._streams[request_id] = stream
        if self.metrics is not None:
            self.metrics.request_admitted(len(prompt_ids))

    def _call(self, fn: Callable[..., Any], args: tuple, loop: asyncio.AbstractEventLoop,
              future: asyncio.Future) -> None:
        try:
            result, error = fn(self.engine, *args), None
        except Exception as exc:  # handed to the caller, whose answer reports it
            result, error = None, exc
        loop.call_soon_threadsafe(_settle, future, result, error)

    def _fail_running(self, exc: Exception) -> None:
        """Fail and abort the requests that were running when the step raised (the step's
        batch); waiting requests are untouched."""
        running = {s.request_id for s in self.engine.scheduler.unfinished() if s.status is SequenceStatus.RUNNING}
        for request_id in running:
            stream = self._streams.pop(request_id, None)
            self.engine.abort(request_id)
            if stream is not None:
                self._record_aborted("failed")
                stream.put(RequestFailed(f"the engine failed while running this request: "
                                         f"{type(exc).__name__}: {exc}"))

    def _publish(self) -> None:
        """Hand each request's new tokens to its coroutine (no text: its reader decodes them)."""
        generated = 0
        for request_id, stream in list(self._streams.items()):
            state: RequestState | None = self.engine.requests.get(request_id)
            if state is None:
                continue
            if state.seqs[0].joint and not state.finished:
                continue  # beams are regrouped every step: their tokens are final only at the end
            deltas = [d for d in (self._delta(stream, seq) for seq in state.seqs) if d is not None]
            if not deltas and not state.finished:
                continue
            generated += sum(len(d.token_ids) for d in deltas)
            self._record_first_token(stream, state)
            first = state.seqs[0]
            completion = sum(s.num_output_tokens for s in state.seqs)
            out = StepOutput(request_id, deltas, state.finished, first.num_prompt_tokens, completion,
                             first.num_cached_tokens or 0, None if stream.started else prompt_logprobs_of(first))
            stream.started = True
            if state.finished:
                self.engine.pop_finished(request_id)
                del self._streams[request_id]
                self._record_finished(stream, state)
            stream.put(out)
        if generated and self.metrics is not None:
            self.metrics.tokens_generated(generated)

    def _delta(self, stream: _Stream, seq: Sequence) -> SampleDelta | None:
        """The tokens ``seq`` gained since its last delta (a slice of the new ones only)."""
        index = seq.sample_index
        if index in stream.done:
            return None
        sent = stream.emitted.get(index, 0)
        new = seq.token_ids[seq.num_prompt_tokens + sent:]
        if not new and not seq.is_finished:
            return None
        stream.emitted[index] = sent + len(new)
        reason = cut = None
        if seq.is_finished:
            stream.done.add(index)
            reason, cut = (seq.finish_reason.value if seq.finish_reason else None), seq.stop_text_len
        lps = seq.logprobs[sent:sent + len(new)] if seq.params.logprobs is not None else None
        return SampleDelta(index, new, "", reason, lps, cut)

    # ------------------------------------------------------------------ metrics (engine thread)

    def _record_first_token(self, stream: _Stream, state: RequestState) -> None:
        if stream.first_token_seen or self.metrics is None:
            return
        times = [s.first_token_time for s in state.seqs if s.first_token_time is not None]
        if times:
            stream.first_token_seen = True
            self.metrics.request_first_token(min(times) - stream.arrival)

    def _record_finished(self, stream: _Stream, state: RequestState) -> None:
        if self.metrics is None:
            return
        now = time.perf_counter()
        ends = [s.finish_time or now for s in state.seqs]
        reason = "length" if any(s.finish_reason is FinishReason.LENGTH for s in state.seqs) else "stop"
        samples = [(s.num_output_tokens, end - s.first_token_time)
                   for s, end in zip(state.seqs, ends) if s.first_token_time is not None]
        self.metrics.request_finished(reason, max(ends) - stream.arrival, samples)

    # A request's stream is registered when the engine admits it and dropped once, when it
    # ends: finished (``_publish``), cancelled (an abort command) or failed. Each end is
    # recorded where its stream is dropped, so every admitted request is counted once.

    def _record_aborted(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.request_aborted(reason)

    # ------------------------------------------------------------------ tokenizer

    def with_tokenizer(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` holding the tokenizer lock (any thread)."""
        with self.tokenizer_lock:
            return fn(*args, **kwargs)

    def _decode(self, ids: list[int]) -> str:
        return self.with_tokenizer(self.llm.tokenizer.decode, ids, skip_special_tokens=True)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Hand a call's outcome to its caller (the event loop's thread), unless it stopped waiting."""
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
