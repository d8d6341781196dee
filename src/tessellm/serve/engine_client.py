"""The API side of the engine: many coroutines' requests to one engine core, their outputs
back as they are produced.

``EngineClient`` sends each request as a message (serve/engine_protocol.py: token ids and
sampling, never text) to the engine core (serve/engine_core.py), which runs in its own
process (serve/engine_process.py, the server's default) or on a thread of this one
(``ThreadTransport``, for debugging and tests), and reads the core's messages on the event
loop: each request's new token ids go to the coroutine that waits for them, which turns them
into text as it reads them (``RequestText``: incremental, a few tokens per step). So
tokenizing, chat templates, detokenizing and HTTP never share an interpreter with the engine's
step in the process mode, and every step's outputs cross as one message.

Leaving a request's iterator early (a client disconnect) sends an abort at once: the core
carries it out before its next step. The server's metrics are recorded here from what the
core reports (admitted, refused, finished, aborted, and its gauges), with latencies measured
on this side, as a client sees them. When the core process dies, every request in flight
fails with ``EngineDead`` and the client reports itself not alive until the core is back
(``on_core_exit`` decides whether it comes back: serve/supervise.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from tessellm.core.config import ImagesConfig
from tessellm.core.engine.llm import encode_prompt
from tessellm.core.errors import RequestRejectedError
from tessellm.core.interfaces.sequence import SamplingParams, TokenLogprob
from tessellm.serve.detokenize import RequestText, direct_decode
from tessellm.serve.engine_protocol import (EngineDead, EngineInfo, RequestFailed, RequestKind, decode_error,
                                            decode_logprobs, encode_images, encode_params, is_compact, pack,
                                            register_kind, unpack)

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


class ServerBusy(RequestRejectedError):
    """The waiting queue is full: retry later (a server answers 429)."""


def _generate_payload(prompt_ids: list[int], params: SamplingParams, *, priority: int = 0,
                      cache_salt: str | None = None, lora: str | None = None,
                      images: list[Any] | None = None, stream_interval: int = 1) -> dict[str, Any]:
    payload = {"prompt": list(prompt_ids), "params": encode_params(params), "priority": priority,
               "cache_salt": cache_salt, "lora": lora}
    if stream_interval > 1:
        payload["stream_interval"] = stream_interval
    if images:
        payload["images"] = encode_images(images)
    return payload


class GenerateReader:
    """A generate request's records turned into ``StepOutput``s as its reader takes them:
    several records waiting (a reader that fell behind) become one output, each sample's
    tokens and logprobs joined. Keeps what a compact record leaves out: the prompt's and
    cached tokens (from the first record) and the completion's count."""

    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")

    def __init__(self) -> None:
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0

    def __call__(self, records: list[list[Any]]) -> StepOutput:
        samples: dict[int, SampleDelta] = {}
        finished, prompt_lps = False, None
        for record in records:
            if is_compact(record):
                self.completion_tokens += len(record[1])
                _join(samples, 0, record[1], None, None, None)
                continue
            _, finished, deltas, self.prompt_tokens, self.completion_tokens, self.cached_tokens, lps = record
            if prompt_lps is None:
                prompt_lps = decode_logprobs(lps)
            for index, ids, reason, sample_lps, cut in deltas:
                _join(samples, index, ids, reason, decode_logprobs(sample_lps), cut)
        return StepOutput(records[-1][0], list(samples.values()), finished, self.prompt_tokens,
                          self.completion_tokens, self.cached_tokens, prompt_lps)


def _join(samples: dict[int, SampleDelta], index: int, ids: list[int], reason: str | None,
          lps: list[TokenLogprob] | None, cut: int | None) -> None:
    """Add a record's tokens of sample ``index`` to what ``samples`` holds of it (a record's
    lists are its own: unpacked for this reader alone)."""
    before = samples.get(index)
    if before is None:
        samples[index] = SampleDelta(index, ids, "", reason, lps, cut)
        return
    before.token_ids.extend(ids)
    if lps is not None:
        before.logprobs = (before.logprobs or []) + lps
    before.finish_reason, before.stop_text_len = reason, cut


def _generate_samples(record: list[Any]) -> list[tuple[int, int, str | None]]:
    return [(index, len(ids), reason) for index, ids, reason, _, _ in record[2]]


GENERATE = register_kind(RequestKind("generate", _generate_payload, GenerateReader, merges=True,
                                     samples=_generate_samples))


class _Inbox:
    """A request's outputs waiting for its reader (on the event loop)."""

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.ready = asyncio.Event()

    def put_nowait(self, item: Any) -> None:
        self.items.append(item)
        self.ready.set()

    async def take(self, read: Callable[[list[Any]], Any], merges: bool) -> Any:
        """The next output, ``read`` from the next record; with ``merges``, from every record
        waiting (a reader that fell behind catches up in one event). An exception waiting is
        returned alone."""
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        item = self.items.popleft()
        if isinstance(item, BaseException):
            return item
        records = [item]
        while merges and self.items and not isinstance(self.items[0], BaseException):
            records.append(self.items.popleft())
        return read(records)


@dataclass
class _Request:
    """What the API side keeps of a request until the core reports its end: where its
    outputs go (None once its reader left), and its times for the metrics."""

    kind: RequestKind
    queue: _Inbox | None
    arrival: float
    admitted: bool = False
    first: dict[int, float] = field(default_factory=dict)  # sample -> time its first token arrived
    last: dict[int, float] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)


class EngineClient:
    """Requests to one engine core through ``transport`` (``ThreadTransport`` or
    serve/engine_process.py's ``ProcessTransport``).

    ``generate(request_id, prompt_ids, params, **kwargs)`` is an async iterator of
    ``StepOutput``; it raises the core's ``InvalidRequestError`` / ``RequestRejectedError``
    (``field``: the request field it is about) on admission, ``ServerBusy`` when
    ``max_waiting`` requests wait already, ``RequestFailed`` if stepping fails and
    ``EngineDead`` when the core is not running. ``call(method, *args)`` runs a named call
    between two steps (serve/engine_core.py ``CORE_CALLS``). ``aborts`` records, for the most
    recent aborted requests, the core's steps started when this side asked and when the
    core did it.
    """

    def __init__(self, transport: Any, tokenizer: Any, tokenizer_lock: threading.Lock | None = None, *,
                 max_waiting: int | None = None, metrics: Any | None = None):
        self.transport = transport
        self.tokenizer = tokenizer
        self.tokenizer_lock = tokenizer_lock or threading.Lock()
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.stream_interval = 1
        """After a request's first tokens, its outputs come once a sample holds this many new
        tokens, and at its end (``--stream-interval``): fewer, larger events under load."""
        self.info: EngineInfo = transport.info
        self.requests: dict[str, _Request] = {}
        self.aborts: deque[tuple[str, int, int]] = deque(maxlen=1000)
        """(request id, core steps started when its abort was asked for, and when it was done)."""
        self.gauges: dict[str, Any] = {}
        self.failed_requests = 0  # requests failed by the engine (their own run, a step, the core's exit)
        self.on_core_exit: Callable[[int | None], None] | None = None
        self.image_processor_factory: Callable[[], Any] | None = None
        """Builds the model's ``ImageProcessor`` on first use (None: the model takes no images)."""
        self._image_processor: Any = None
        self.images: Any = ImagesConfig()
        """The config's ``images`` section: what a request's images may be (how many, whether
        http(s) URLs are fetched, within what size and time)."""
        """Called on the event loop when the core process exits (its status), after every
        request in flight has failed."""
        self.on_core_ready: Callable[[dict[str, Any]], None] | None = None
        """Called on the event loop when a restarted core is ready (its gauges)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._early: list[Any] = []  # what the core said before the loop was attached
        self._early_lock = threading.Lock()
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._down_reason: str | None = None
        self._direct_decode = direct_decode(tokenizer)
        transport.connect(self._deliver)

    # ------------------------------------------------------------------ lifecycle

    async def attach(self) -> None:
        """Start receiving on the running event loop (the server's lifespan; else the first
        request's)."""
        self._attach(asyncio.get_running_loop())

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._early_lock:
            self._loop = loop
            early, self._early = self._early, []
        for item in early:
            self._receive(item)
        read_on = getattr(self.transport, "read_on", None)
        if read_on is not None:  # a transport the loop reads itself (the core process's sockets)
            read_on(loop, self._receive)

    def shutdown(self) -> None:
        self.transport.stop()

    @property
    def alive(self) -> bool:
        return self._down_reason is None and self.transport.alive

    @property
    def down_reason(self) -> str | None:
        """Why the core is not serving (None: it is)."""
        if self._down_reason is not None:
            return self._down_reason
        return None if self.transport.alive else "the engine loop is not running"

    def _deliver(self, item: Any) -> None:
        """From the transport's thread: a packed message (bytes; a thread core's) or the core's
        exit (an int or None status, wrapped as ``("exit", status)``)."""
        loop = self._loop
        if loop is None:
            with self._early_lock:
                if self._loop is None:
                    self._early.append(item)
                    return
            loop = self._loop
        try:
            loop.call_soon_threadsafe(self._receive, item)
        except RuntimeError:  # the loop is closed: the server is stopping
            pass

    def _receive(self, item: Any) -> None:
        if isinstance(item, tuple):
            drain = getattr(self.transport, "drain", None)
            if drain is not None:  # the dead core's last messages first
                drain()
            self._core_exited(*item[1:])
            return
        message = unpack(item)
        if message[0] == "step":
            self._on_step(*message[1:])
        elif message[0] == "result":
            self._on_result(*message[1:])
        elif message[0] == "ready":  # a restarted core
            self.info = EngineInfo.from_wire(message[1])
            self._down_reason = None
            logger.info("engine core (pid %d) is serving again", self.info.pid)
            if self.on_core_ready is not None:
                self.on_core_ready(self.info.gauges)
        elif message[0] == "fatal":  # a restarted core that could not build its pipeline
            logger.error("the engine core could not start: %s", message[1])

    # ------------------------------------------------------------------ requests

    def num_waiting(self) -> int:
        """Requests admitted and not yet running, by the core's last gauges, plus those sent
        and not yet admitted."""
        unadmitted = sum(1 for r in self.requests.values() if not r.admitted)
        return int(self.gauges.get("waiting", 0)) + unadmitted

    def check_room(self) -> None:
        """ServerBusy when ``max_waiting`` requests wait already."""
        if self.max_waiting is not None and self.num_waiting() >= self.max_waiting:
            if self.metrics is not None:
                self.metrics.request_rejected("busy")
            raise ServerBusy(f"the server is busy: {self.num_waiting()} requests are waiting "
                             f"(limit {self.max_waiting}); retry later")

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 **kwargs: Any) -> AsyncIterator[StepOutput]:
        """The request's outputs as it runs, their text detokenized here as they are read."""
        text, read = RequestText(self._decode, params.stop), GenerateReader()
        kwargs.setdefault("stream_interval", self.stream_interval)
        return self.submit(GENERATE, request_id, GENERATE.encode(prompt_ids, params, **kwargs),
                           read=lambda records: text.fill(read(records)))

    async def submit(self, kind: RequestKind, request_id: str, payload: dict[str, Any], *,
                     check_room: bool = True, read: Callable[[list[Any]], Any] | None = None) -> AsyncIterator[Any]:
        """Send a request of ``kind`` and yield its outputs until it finishes (``read``: what
        turns its records into outputs, the kind's reader by default); ``check_room`` False:
        the caller checked the waiting queue once for a batch of them (``check_room()``),
        which is admitted whole."""
        if self._loop is not asyncio.get_running_loop():
            self._attach(asyncio.get_running_loop())
        if not self.alive:
            raise EngineDead(f"the engine is not serving: {self.down_reason}")
        if check_room:
            self.check_room()
        if request_id in self.requests:
            raise RequestRejectedError(f"request id {request_id!r} is already in use")
        inbox, read = _Inbox(), read or kind.reader()
        self.transport.send(pack(["add", request_id, kind.name, payload]))  # EngineDead if it cannot reach the core
        self.requests[request_id] = _Request(kind, inbox, time.perf_counter())
        finished = False
        try:
            while True:
                item = await inbox.take(read, kind.merges)
                if isinstance(item, BaseException):
                    finished = True  # the core already dropped it
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop ``request_id`` before the core's next step (unknown ids are ignored)."""
        request = self.requests.get(request_id)
        if request is None or request.queue is None:
            return
        request.queue = None  # its reader is gone; the core's answer (aborted, or finished) ends it
        if self.alive:
            try:
                self.transport.send(pack(["abort", [request_id], time.monotonic()]))
            except EngineDead:  # the core is gone: its exit fails what it held
                pass

    async def call(self, method: str, *args: Any) -> Any:
        """The core's ``method(*args)`` run between two steps; its result, or its exception.
        The call runs to its end even if the caller is cancelled while waiting."""
        if not self.alive:
            raise EngineDead(f"the engine is not serving: {self.down_reason}")
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self.transport.send(pack(["call", call_id, method, list(args)]))
        self._calls[call_id] = future
        return await future

    # ------------------------------------------------------------------ what the core says

    def _on_step(self, records: list, errors: list, admitted: list, aborted: list, gauges: dict | None) -> None:
        metrics, now = self.metrics, time.perf_counter()
        for request_id, prompt_tokens in admitted:
            request = self.requests.get(request_id)
            if request is not None:
                request.admitted = True
            if metrics is not None:
                metrics.request_admitted(prompt_tokens)
        for request_id, *error in errors:
            self._end_with_error(request_id, decode_error(error))
        generated = 0
        for record in records:  # kept as they came: each request's reader turns them into outputs
            request = self.requests.get(record[0])
            if request is None:
                continue
            compact = is_compact(record)
            if compact:
                generated += self._track(request, 0, len(record[1]), None, now)
            else:
                for index, count, reason in request.kind.samples(record):
                    generated += self._track(request, index, count, reason, now)
            if request.queue is not None:
                request.queue.put_nowait(record)
            if not compact and record[1]:  # finished
                del self.requests[record[0]]
                self._record_finished(request, now)
        if generated and metrics is not None:
            metrics.tokens_generated(generated)
        for request_id, asked, done in aborted:
            self.aborts.append((request_id, asked, done))
            if self.requests.pop(request_id, None) is not None and metrics is not None:
                metrics.request_aborted("cancelled")
        if gauges is not None:
            self.gauges = gauges
            if metrics is not None:
                cpu = {"engine": gauges["cpu"], "api": time.process_time() - self.transport.cpu_in_this_process(gauges)}
                metrics.on_gauges(gauges, cpu)

    def _end_with_error(self, request_id: str, exc: BaseException) -> None:
        request = self.requests.pop(request_id, None)
        failed = isinstance(exc, RequestFailed)
        if failed:
            self.failed_requests += 1
        if self.metrics is not None:
            if failed:
                self.metrics.request_aborted("failed")
            else:
                self.metrics.request_rejected("invalid")
        if request is not None and request.queue is not None:
            request.queue.put_nowait(exc)

    def _track(self, request: _Request, index: int, count: int, reason: str | None, now: float) -> int:
        """Note the times of a sample's new tokens (a request's first token's: TTFT); the
        tokens counted."""
        if count:
            if index not in request.first:
                request.first[index] = now
                if len(request.first) == 1 and self.metrics is not None:
                    self.metrics.request_first_token(now - request.arrival)
            request.last[index] = now
            request.tokens[index] = request.tokens.get(index, 0) + count
        if reason is not None:
            request.reasons[index] = reason
        return count

    def _record_finished(self, request: _Request, now: float) -> None:
        if self.metrics is None:
            return
        reason = "length" if "length" in request.reasons.values() else "stop"
        samples = [(request.tokens[i], request.last[i] - request.first[i]) for i in request.first]
        self.metrics.request_finished(reason, now - request.arrival, samples)

    def _on_result(self, call_id: int, ok: bool, value: Any) -> None:
        future = self._calls.pop(call_id, None)
        if future is None or future.cancelled():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(decode_error(value))

    def _core_exited(self, status: int | None) -> None:
        """The core process is gone: every request in flight and every call fails now."""
        pid = self.info.pid
        self._down_reason = f"the engine core process (pid {pid}) exited with status {status}"
        logger.error("%s; failing %d requests in flight", self._down_reason, len(self.requests))
        message = f"{self._down_reason} while this request ran; the request is lost"
        for request_id in list(self.requests):
            request = self.requests[request_id]
            if request.admitted and self.metrics is not None:
                self.metrics.request_aborted("failed")
            self.failed_requests += 1
            if request.queue is not None:
                request.queue.put_nowait(EngineDead(message))
        self.requests.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDead(f"{self._down_reason} before answering"))
        self._calls.clear()
        self.gauges = {}
        if self.on_core_exit is not None:
            self.on_core_exit(status)

    # ------------------------------------------------------------------ tokenizer

    @property
    def image_processor(self) -> Any:
        """The model's ``ImageProcessor`` (run here, where prompts are tokenized), built on
        first use; None for a model that takes no images."""
        if self._image_processor is None and self.image_processor_factory is not None:
            with self.tokenizer_lock:
                if self._image_processor is None:
                    self._image_processor = self.image_processor_factory()
                    self.image_processor_factory = None
        return self._image_processor

    def with_tokenizer(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` holding the tokenizer lock (any thread)."""
        with self.tokenizer_lock:
            return fn(*args, **kwargs)

    def encode(self, prompt: str) -> list[int]:
        """A completion's text prompt as token ids (as ``LLM.encode``)."""
        return self.with_tokenizer(encode_prompt, self.tokenizer, prompt)

    def _decode(self, ids: list[int]) -> str:
        with self.tokenizer_lock:
            return self._direct_decode(ids)


class ThreadTransport:
    """The engine core on a thread of this process, around an ``LLM`` built here: the same
    messages as the process, through queues (``--engine-core thread``, and tests)."""

    def __init__(self, llm: Any):
        from tessellm.serve.engine_core import EngineCore, engine_info

        self.llm = llm
        self.info = engine_info(llm)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._deliver: Callable[[Any], None] | None = None
        self.core = EngineCore(llm, self._send, cpu_clock=time.thread_time)
        self._thread = threading.Thread(target=self._run, name="tessellm-engine", daemon=True)

    def connect(self, deliver: Callable[[Any], None]) -> None:
        self._deliver = deliver

    def start(self) -> None:
        self._thread.start()

    def _send(self, data: bytes) -> None:
        self._deliver(data)

    def _run(self) -> None:
        self.core.run(self._receive)

    def _receive(self, timeout: float) -> list[bytes]:
        try:
            first = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return []
        out = [first]
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def send(self, data: bytes) -> None:
        self._inbox.put(data)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(pack(["stop"]))
            self._thread.join(timeout=30)
        close = getattr(self.llm, "close", None)
        if close is not None and not self._thread.is_alive():
            close()  # e.g. a disk KV tier's queued writes reach the disk before the process exits

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def cpu_in_this_process(self, gauges: dict[str, Any]) -> float:
        """The core's CPU seconds counted in this process's (its thread's)."""
        return gauges["cpu"]

    def describe(self) -> dict[str, Any]:
        return {"mode": "thread", "pid": self.info.pid, "alive": self.alive}
