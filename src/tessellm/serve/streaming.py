"""What every generating route shares between its request and its answer: admitting a
response's prompts to the engine (one engine request each), waiting for their outputs while
watching for the client to leave, reading them as one stream of server-sent events, usage
and log-probabilities.

A client that leaves, at any point, is answered 499 and logged once at info level on
``tessellm.server``; its engine requests are aborted before the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from tessellm.core.errors import InvalidRequestError, LoraAdapterError, RequestRejectedError
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.serve.context import ServerContext
from tessellm.serve.engine_client import SampleDelta, ServerBusy, StepOutput
from tessellm.serve.engine_protocol import EngineDead, RequestFailed
from tessellm.serve.http_errors import RequestError
from tessellm.serve.sampling import admission_param

logger = logging.getLogger("tessellm.server")
T = TypeVar("T")
EngineStreamT = AsyncGenerator[StepOutput, None]

SSE_DONE = "data: [DONE]\n\n"


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def log_client_gone(request_id: str, request: Request | None, when: str) -> None:
    """The one line a client that left is logged with: its request, its status (499)."""
    route = f" {request.method} {request.url.path}" if request is not None else ""
    logger.info("%s%s 499: the client disconnected %s; its engine requests are aborted", request_id, route, when)


class ClientGone(Exception):
    """The client closed its connection before its answer was complete (answered 499)."""

    def __init__(self, request_id: str):
        super().__init__(request_id)
        self.request_id = request_id


async def client_gone(request: Request, exc: ClientGone) -> Response:
    """The app's handler of ClientGone: the log line, and a 499 nobody reads."""
    log_client_gone(exc.request_id, request, "before the answer")
    return Response(status_code=499)


async def until_disconnect(request: Request, work: Awaitable[T], request_id: str) -> T:
    """``work``'s result; or, as soon as the client disconnects first, ``work`` is cancelled
    (which aborts the requests it waits on) and ClientGone is raised. Before any byte of the
    answer is sent, only the ASGI ``http.disconnect`` message tells that the client left
    (a closed socket, a client timeout)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself is cancelled (the server shuts down)
        task.cancel()
        gone.cancel()
        raise
    gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone(request_id)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EngineStream(StreamingResponse):
    """A streamed answer that ends cleanly however it ends: the answer complete; the client
    gone (Starlette cancels the body's iteration, or a write fails); the body is closed
    either way, which aborts its unfinished engine requests at once. A client that left
    before the last byte is logged once (499), with no traceback."""

    def __init__(self, body: AsyncIterator[str], request: Request, request_id: str, release: Callable[[], None]):
        super().__init__(body, media_type="text/event-stream")
        self.request, self.request_id, self.release = request, request_id, release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        complete = False

        async def send_watched(message: dict) -> None:
            nonlocal complete
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True

        try:
            await super().__call__(scope, receive, send_watched)
        except (OSError, ClientDisconnect):  # a write to a closed connection (ASGI 2.4 servers)
            pass
        finally:  # the body's own cleanup is synchronous: no await to be cancelled here
            await self.body_iterator.aclose()
            self.release()  # a body closed before it started never ran its own cleanup
        if not complete:
            log_client_gone(self.request_id, self.request, "mid-stream")


@dataclass
class Admitted:
    """A response's engine requests, admitted: one per prompt (``ids``, ``streams``), each
    with its first output; ``params.n`` samples each; ``lora``: the LoRA adapter they run
    under (None: the base model)."""

    ctx: ServerContext
    request_id: str
    ids: list[str]
    streams: list[EngineStreamT]
    first: list[StepOutput]
    params: SamplingParams
    lora: str | None = None

    @property
    def model(self) -> str:
        """The model the answer names: the adapter, or the base model."""
        return self.lora or self.ctx.model_name

    async def rest(self, request: Request) -> list[list[StepOutput]]:
        """Every prompt's outputs to its end, the first included (ClientGone if the client
        leaves first; RequestError 500 if the engine fails)."""

        async def tail(stream: EngineStreamT) -> list[StepOutput]:
            return [out async for out in stream]

        try:
            tails = await until_disconnect(request, asyncio.gather(*(tail(s) for s in self.streams)),
                                           self.request_id)
        except (ClientGone, RequestFailed) as exc:
            await close_streams(self.streams)
            if isinstance(exc, RequestFailed):
                raise RequestError(500, str(exc), kind="server_error") from None
            raise
        return [[head, *tail] for head, tail in zip(self.first, tails)]

    def merged(self) -> "MergedOutputs":
        return MergedOutputs(self)


async def admit(ctx: ServerContext, request: Request, request_id: str, prompts: list[list[int]],
                params: SamplingParams, body: Any, prompt_param: str, lora: str | None = None,
                images: list[list[Any] | None] | None = None) -> Admitted:
    """One engine request per prompt, all admitted at once (under the LoRA adapter ``lora``,
    None for the base model), and their first outputs. Refusals are RequestErrors naming the
    field (``prompt_param`` for the prompt): 400, 404 when the adapter was unloaded since the
    model was checked, 429 when the waiting queue is full, 500 when the engine fails;
    ClientGone if the client leaves first. Nothing is left running after any of them.
    ``images``: per prompt, its processed images (None: none)."""
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    salt = getattr(body, "cache_salt", None)
    pictures = images or [None] * len(prompts)
    streams = [ctx.engine.generate(rid, p, params, cache_salt=salt, lora=lora, **({"images": i} if i else {}))
               for rid, p, i in zip(ids, prompts, pictures)]
    try:
        first = await until_disconnect(request, _first_outputs(streams), request_id)
    except ClientGone:
        await close_streams(streams)
        raise
    except ServerBusy as exc:
        await close_streams(streams)
        raise RequestError(429, str(exc), kind="rate_limit_error", code="server_busy") from None
    except InvalidRequestError as exc:  # RequestRejectedError too: it can never run
        await close_streams(streams)
        raise RequestError(400, str(exc), param=admission_param(exc, body, prompt_param)) from None
    except LoraAdapterError as exc:
        await close_streams(streams)
        raise RequestError(404, str(exc), param="model", code="model_not_found") from None
    except EngineDead as exc:
        await close_streams(streams)
        raise RequestError(503, str(exc), kind="server_error", code="engine_unavailable") from None
    except RequestFailed as exc:
        await close_streams(streams)
        raise RequestError(500, str(exc), kind="server_error") from None
    return Admitted(ctx, request_id, ids, streams, first, params, lora)


async def _first_outputs(streams: list[EngineStreamT]) -> list[StepOutput]:
    """Each stream's first output, all awaited at once (the first failure is raised, naming
    its prompt in a batch)."""

    async def first_of(p: int, stream: EngineStreamT) -> StepOutput:
        try:
            return await stream.__anext__()
        except (InvalidRequestError, RequestRejectedError) as exc:
            if len(streams) > 1 and not isinstance(exc, ServerBusy):
                raise type(exc)(f"prompt {p}: {exc}", field=exc.field) from exc
            raise

    results = await asyncio.gather(*(first_of(p, s) for p, s in enumerate(streams)), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def close_streams(streams: list[EngineStreamT]) -> None:
    """Close engine streams (aborting what is unfinished), from a handler's own task."""
    for stream in streams:
        try:
            await stream.aclose()
        except RuntimeError:  # still being cancelled: its own cleanup aborts the request
            pass


@dataclass
class MergedOutputs:
    """A response's engine streams read as one, each prompt's outputs as they come: with
    several prompts, every stream is read by its own task into one queue; a single stream
    is read directly. ``close()`` is synchronous (it runs where the answer ends, even in a
    cancelled task): it stops the readers and aborts the engine requests not finished."""

    admitted: Admitted
    lasts: dict[int, StepOutput] = field(default_factory=dict)
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _readers: list[asyncio.Future] = field(default_factory=list)
    _head: StepOutput | None = None
    """A single stream's first output, not handed out yet."""

    def __post_init__(self) -> None:
        a = self.admitted
        if len(a.streams) == 1:
            self._head = a.first[0]
            return
        self._readers = [asyncio.ensure_future(self._read(p, out, stream))
                         for p, (out, stream) in enumerate(zip(a.first, a.streams))]

    async def _read(self, p: int, out: StepOutput, stream: EngineStreamT) -> None:
        try:
            while True:
                self._queue.put_nowait((p, out))
                if out.finished:
                    return
                out = await stream.__anext__()
        except Exception as exc:  # noqa: BLE001 (handed to the reader of the queue, whose answer ends)
            self._queue.put_nowait((p, exc))

    @property
    def done(self) -> bool:
        return len(self.lasts) == len(self.admitted.streams)

    async def next(self) -> tuple[int, StepOutput]:
        """The next output of any prompt, as (prompt index, output); raises the engine's error."""
        if self._readers:
            p, out = await self._queue.get()
            if isinstance(out, BaseException):
                raise out
        elif self._head is not None:
            p, out, self._head = 0, self._head, None
        else:
            p, out = 0, await self.admitted.streams[0].__anext__()
        if out.finished:
            self.lasts[p] = out
        return p, out

    def close(self) -> None:
        for reader in self._readers:
            reader.cancel()
        for p, request_id in enumerate(self.admitted.ids):
            if p not in self.lasts:
                self.admitted.ctx.engine.abort(request_id)


StepChoices = Callable[[int, StepOutput], list[dict]]


def event_stream(request: Request, admitted: Admitted, step_choices: StepChoices, chunk: Callable[..., dict],
                 usage_of: Callable[[list[StepOutput]], dict], options: Any = None) -> EngineStream:
    """A streamed answer of server-sent events: a chunk for each output that has choices to
    show (``step_choices(prompt index, output)``, shaped by ``chunk(choices, **extra)``),
    then, with ``stream_options.include_usage``, a last chunk with ``usage_of(each prompt's
    last output)``, then ``[DONE]``; with ``stream_options.continuous_usage_stats`` every
    chunk carries the usage so far. An engine failure ends it with an error event; a client
    that leaves ends it (its requests are aborted, and it is logged once)."""
    outputs = admitted.merged()
    final = usage_of if options is not None and options.include_usage else None
    running = usage_of if options is not None and options.continuous_usage_stats else None
    body = sse_events(outputs, step_choices, chunk, final, running)
    return EngineStream(body, request, admitted.request_id, release=outputs.close)


async def sse_events(outputs: MergedOutputs, step_choices: StepChoices, chunk: Callable[..., dict],
                     final_usage: Callable[[list[StepOutput]], dict] | None,
                     running_usage: Callable[[list[StepOutput]], dict] | None = None) -> AsyncIterator[str]:
    latest: dict[int, StepOutput] = {}
    try:
        while not outputs.done:
            p, out = await outputs.next()
            latest[p] = out
            choices = step_choices(p, out)
            if choices and running_usage is not None:
                yield sse(chunk(choices, usage=running_usage([latest[q] for q in sorted(latest)])))
            elif choices:
                yield sse(chunk(choices))
        if final_usage is not None:
            yield sse(chunk([], usage=final_usage([outputs.lasts[p] for p in sorted(outputs.lasts)])))
    except RequestFailed as exc:
        yield sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
    finally:  # however it ends; synchronous, so a cancelled task still runs all of it
        outputs.close()
    yield SSE_DONE


def sse(payload: dict) -> str:
    return "data: " + json.dumps(payload) + "\n\n"


def usage(outs: list[StepOutput], score_only: bool = False) -> dict[str, Any]:
    """The usage object over a response's engine requests (one per prompt); ``score_only``
    (a completion with echo and max_tokens 0) generated nothing it shows."""
    prompt = sum(o.prompt_tokens for o in outs)
    completion = 0 if score_only else sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outs)}}


@dataclass
class Choice:
    """One choice of a whole (not streamed) answer: its prompt and its samples' deltas."""

    index: int
    prompt: int
    deltas: list[SampleDelta] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    @property
    def finish_reason(self) -> str | None:
        return next((d.finish_reason for d in reversed(self.deltas) if d.finish_reason), None)


def choices_of(outputs: list[list[StepOutput]], n: int) -> list[Choice]:
    """A whole answer's choices, in order: choice ``prompt_index * n + sample``."""
    choices: dict[int, Choice] = {}
    for p, outs in enumerate(outputs):
        for out in outs:
            for d in out.samples:
                i = p * n + d.index
                choices.setdefault(i, Choice(i, p)).deltas.append(d)
    return [choices[i] for i in sorted(choices)]


def token_piece(ctx: ServerContext, token: int) -> str:
    """One token's text, as log-probabilities show it."""
    return ctx.engine.with_tokenizer(ctx.tokenizer.decode, [token])


def logprob_pairs(deltas: list[SampleDelta]) -> list[tuple[int, Any]] | None:
    """(token id, its ``TokenLogprob``) of each token of ``deltas``; None if not asked for."""
    if not any(d.logprobs is not None for d in deltas):
        return None
    return [(t, lp) for d in deltas if d.logprobs is not None for t, lp in zip(d.token_ids, d.logprobs)]


def logprobs_content(ctx: ServerContext, deltas: list[SampleDelta]) -> dict | None:
    """The chat API's logprobs object (``{"content": [{token, logprob, bytes,
    top_logprobs}]}``) of these deltas' tokens; None if the request did not ask for them."""
    pairs = logprob_pairs(deltas)
    if pairs is None:
        return None

    def entry(token: int, logprob: float) -> dict:
        text = token_piece(ctx, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(a, v) for a, v in lp.top]}
                        for t, lp in pairs]}
