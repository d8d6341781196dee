"""``tessellm serve``: an OpenAI-compatible HTTP server on FastAPI.

POST /v1/completions and /v1/chat/completions (streamed as server-sent events when
``stream`` is true), GET /v1/models, /health and /metrics (Prometheus). One ``EngineThread``
serves every connection, so requests from all clients are batched by the configured
scheduler. A user error is a 400 with OpenAI's error body, never a 500; a full waiting queue
is a 429; a failure inside the engine fails the requests it was running with a 500 and the
server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from contextlib import asynccontextmanager
from functools import cached_property
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, TypeVar

from tessellm.extras import require

require("fastapi", "serve")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse  # noqa: E402

from tessellm.serve.engine_thread import EngineThread, RequestFailed, SampleDelta, ServerBusy, StepOutput
from tessellm.core.errors import InvalidRequestError, RequestRejectedError
from tessellm.core.engine.llm import to_sampling_params
from tessellm.serve.schema import ChatCompletionRequest, CompletionRequest
from tessellm.serve.structured import grammar_of
from tessellm.serve.tools import StreamedChoice, ToolCalling, render_chat
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.serve.metrics import ServerMetrics


T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before its answer was complete."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; or, as soon as the client disconnects first, ``work`` is cancelled
    (which aborts the request it waits on) and ClientGone is raised. Before any byte of the
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
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EngineStream(StreamingResponse):
    """A streamed answer whose body is closed however the response ends: the answer complete,
    the client gone (Starlette then stops iterating the body without closing it), or a write
    that failed. Closing the body closes the engine's stream, which aborts an unfinished
    request at once, rather than when the garbage collector finds the abandoned generator."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


def build_app(llm: Any, *, model_name: str | None = None, api_key: str | None = None,
              max_request_bytes: int = 1 << 20, max_waiting: int | None = 1024) -> FastAPI:
    """The server's app around a loaded ``LLM``; the engine thread runs while the app does."""
    name = model_name or llm.pipeline.config.model
    metrics = ServerMetrics(llm.pipeline)
    engine = EngineThread(llm, max_waiting=max_waiting, on_step=metrics.on_step)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="tessellm", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.llm = engine, metrics, llm

    @app.middleware("http")
    async def guard(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_request_bytes:
            return error(413, f"request body of {size} bytes exceeds the limit of {max_request_bytes}",
                         code="request_too_large")
        if api_key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                             kind="authentication_error", code="invalid_api_key")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
        where = ".".join(loc) or "body"
        return error(400, f"{where}: {first['msg']}", param=where)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return error(503, "the engine loop is not running", kind="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tessellm"}]}

    def check_model(requested: str) -> JSONResponse | None:
        if requested != name:
            return error(400, f"model {requested!r} is not served here; this server serves {name!r}",
                         param="model", code="model_not_found")
        return None

    def sampling(body: Any, max_tokens: int | None, logprobs: int | None, **more: Any) -> SamplingParams:
        """Raises InvalidRequestError naming the field (n over its limit and the like)."""
        if max_tokens is None:
            max_tokens = max(1, llm.pipeline.resolved.max_model_len // 2)
        return to_sampling_params(dict(max_tokens=max_tokens,
                                       temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                       min_p=body.min_p, n=body.n, stop=body.stop_list(), seed=body.seed,
                                       logprobs=logprobs, ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                                       logit_bias=body.bias(), **body.logits_fields(),
                                       extra_args=body.extra_args or {}, **more))

    def piece(token: int) -> str:
        return engine.with_tokenizer(llm.tokenizer.decode, [token])

    def logprobs_json(deltas: list[Any], chat: bool, offset: int = 0,
                      echoed: list[tuple[int, Any]] | None = None) -> dict | None:
        """OpenAI's logprobs object for these deltas' tokens (None if not asked for); a
        completion that echoes its prompt lists ``echoed`` first: (token id, its
        ``TokenLogprob``, or None for the first prompt token)."""
        tokens = [(t, lp) for d in deltas if d.logprobs is not None for t, lp in zip(d.token_ids, d.logprobs)]
        if not any(d.logprobs is not None for d in deltas):
            return None
        tokens = (echoed or []) + tokens
        if chat:
            return {"content": [{"token": piece(t), "logprob": lp.logprob, "bytes": list(piece(t).encode()),
                                 "top_logprobs": [{"token": piece(a), "logprob": v, "bytes": list(piece(a).encode())}
                                                  for a, v in lp.top]} for t, lp in tokens]}
        offsets, at = [], offset
        for t, _ in tokens:
            offsets.append(at)
            at += len(piece(t))
        return {"tokens": [piece(t) for t, _ in tokens],
                "token_logprobs": [None if lp is None else lp.logprob for _, lp in tokens],
                "top_logprobs": [None if lp is None else {piece(a): v for a, v in lp.top} for _, lp in tokens],
                "text_offset": offsets}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if (bad := check_model(body.model)) is not None:
            return bad
        if body.max_tokens == 0 and not body.echo:
            return error(400, "max_tokens: 0 generates nothing; it is allowed only with echo: true (to score the "
                              "prompt)", param="max_tokens")
        try:
            given = body.prompts()
            prompts = [engine.with_tokenizer(llm.encode, p) if isinstance(p, str) else list(p) for p in given]
            # max_tokens 0 with echo: one token is sampled from the prefill's last row and dropped
            params = sampling(body, 1 if body.max_tokens == 0 else body.max_tokens, body.logprobs,
                              prompt_logprobs=body.logprobs if body.echo else None,
                              structured_output=grammar_of(body.response_format, body.structured_outputs))
        except InvalidRequestError as exc:
            return error(400, str(exc), param="prompt")
        echo = None
        if body.echo:  # a token-id prompt's text is decoded once the engine has admitted its ids
            echo = Echo(given, prompts, body.max_tokens == 0,
                        lambda ids: engine.with_tokenizer(llm.tokenizer.decode, ids))
        return await respond(request, body, prompts, params, chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if (bad := check_model(body.model)) is not None:
            return bad
        if body.top_logprobs and not body.logprobs:
            return error(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tokenizer = llm.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            return error(400, f"model {name!r} has no chat template; use /v1/completions", param="messages")
        try:
            calling = body.tool_calling()
            constraint = grammar_of(body.response_format, body.structured_outputs)
            if calling is not None and calling.grammar() is not None:
                if constraint is not None:
                    raise InvalidRequestError(f"tool_choice {calling.mode!r} and response_format/structured_outputs "
                                              f"both constrain the output; give one")
                constraint = calling.grammar()
            params = sampling(body, body.max_completion_tokens or body.max_tokens,
                              (body.top_logprobs or 0) if body.logprobs else None, structured_output=constraint)
        except InvalidRequestError as exc:
            return error(400, str(exc))
        try:
            with engine.tokenizer_lock:
                text = render_chat([m.model_dump() for m in body.messages], tokenizer, calling)
                prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        except Exception as exc:  # a template that rejects these messages (roles out of order, ...)
            return error(400, f"messages could not be rendered with the chat template: {exc}", param="messages")
        return await respond(request, body, [prompt], params, chat=True, calling=calling)

    async def respond(request: Request, body: Any, prompts: list[list[int]], params: SamplingParams, chat: bool,
                      echo: Echo | None = None, calling: ToolCalling | None = None):
        """One engine request per prompt (a completions batch; chat has one), answered as one
        response whose choice ``prompt_index * n + sample`` is that prompt's sample; ``echo``
        puts each prompt (and its log-probabilities) before its choices' completions;
        ``calling`` turns a chat answer that calls tools into ``tool_calls``."""
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        streams = [engine.generate(rid, p, params, cache_salt=body.cache_salt) for rid, p in zip(ids, prompts)]
        start = time.perf_counter()

        async def first_of(p: int, stream: AsyncGenerator[StepOutput, None]) -> StepOutput:
            try:
                return await stream.__anext__()
            except (InvalidRequestError, RequestRejectedError) as exc:  # say which prompt of a batch
                if len(streams) > 1 and not isinstance(exc, ServerBusy):
                    raise type(exc)(f"prompt {p}: {exc}") from exc
                raise

        async def firsts() -> list[StepOutput]:  # every prompt admitted at once, then their first steps
            results = await asyncio.gather(*(first_of(p, s) for p, s in enumerate(streams)), return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            return results

        async def close_all() -> None:
            for s in streams:
                try:
                    await s.aclose()
                except RuntimeError:  # still being cancelled: its own cleanup aborts the request
                    pass

        try:  # admission errors surface here, before any byte is sent
            first = await until_disconnect(request, firsts())
        except ClientGone:
            await close_all()
            return Response(status_code=499)  # nobody reads it: the requests are aborted
        except ServerBusy as exc:
            await close_all()
            return error(429, str(exc), kind="rate_limit_error", code="server_busy")
        except (InvalidRequestError, RequestRejectedError) as exc:
            await close_all()
            return error(400, str(exc))
        except RequestFailed as exc:
            await close_all()
            return error(500, str(exc), kind="server_error")
        ttft = time.perf_counter() - start
        metrics.first_token(ttft)
        n = params.n
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EngineStream(sse(request_id, first, streams, n, chat, include_usage, start, ttft, echo, calling),
                                media_type="text/event-stream")

        async def rest(stream: AsyncGenerator[StepOutput, None]) -> list[StepOutput]:
            return [out async for out in stream]

        try:
            tails = await until_disconnect(request, asyncio.gather(*(rest(s) for s in streams)))
        except ClientGone:
            await close_all()
            return Response(status_code=499)
        except RequestFailed as exc:
            await close_all()
            return error(500, str(exc), kind="server_error")
        lasts = [tail[-1] if tail else head for head, tail in zip(first, tails)]
        for last in lasts:
            metrics.finished(last.completion_tokens, time.perf_counter() - start, ttft)
        texts: dict[int, str] = {}
        reasons: dict[int, str | None] = {}
        deltas: dict[int, list[Any]] = {}
        for p, (head, tail) in enumerate(zip(first, tails)):
            for out in [head, *tail]:
                for d in out.samples:
                    i = p * n + d.index
                    d = echo.delta(d) if echo else d
                    texts[i] = texts.get(i, echo.texts[p] if echo else "") + d.text
                    reasons[i] = d.finish_reason or reasons.get(i)
                    deltas.setdefault(i, []).append(d)
        choices = [({"index": i, **chat_message(texts[i], reasons[i], calling),
                     "logprobs": logprobs_json(deltas[i], True)} if chat else
                    {"index": i, "text": texts[i],
                     "logprobs": logprobs_json(deltas[i], False, echoed=echo and echo.echoed(i // n, first[i // n])),
                     "finish_reason": reasons[i]})
                   for i in sorted(texts)]
        return {"id": request_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": name, "choices": choices,
                "usage": usage(lasts, echo)}

    async def sse(request_id: str, first: list[StepOutput], streams: list[AsyncGenerator[StepOutput, None]], n: int,
                  chat: bool, include_usage: bool, start: float, ttft: float,
                  echo: Echo | None, calling: ToolCalling | None) -> AsyncIterator[str]:
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict], **extra) -> str:
            return "data: " + json.dumps({"id": request_id, "object": kind, "created": created, "model": name,
                                          "choices": choices, **extra}) + "\n\n"

        # each prompt's stream feeds one queue, so a batch's choices interleave as they come
        queue: asyncio.Queue[tuple[int, StepOutput | BaseException]] = asyncio.Queue()

        async def pump(p: int, out: StepOutput, stream: AsyncGenerator[StepOutput, None]) -> None:
            try:
                while True:
                    await queue.put((p, out))
                    if out.finished:
                        return
                    out = await stream.__anext__()
            except BaseException as exc:  # noqa: BLE001 (handed to the response, which ends)
                await queue.put((p, exc))

        pumps = [asyncio.ensure_future(pump(p, f, s)) for p, (f, s) in enumerate(zip(first, streams))]
        started: set[int] = set()
        holders: dict[int, StreamedChoice] = {}  # chat: text held back while it may be a tool call
        offsets: dict[int, int] = {}  # completions: text offset of each choice's next token
        lasts: dict[int, StepOutput] = {}
        try:
            while len(lasts) < len(streams):
                p, out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                choices = []
                for d in out.samples:
                    i = p * n + d.index
                    if chat:
                        delta: dict[str, Any] = {} if i in started else {"role": "assistant"}
                        started.add(i)
                        held = holders.setdefault(i, StreamedChoice(calling))
                        text, reason = held.push(d.text), d.finish_reason
                        if text is not None and (text or reason is None):
                            delta["content"] = text
                        rest = held.close() if reason is not None else None
                        if rest is not None and rest[0] == "tool_calls":
                            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(rest[1])]
                            reason = "tool_calls"
                        elif rest is not None:
                            delta["content"] = delta.get("content", "") + rest[1]
                        lps = logprobs_json([d], True)
                        if delta or reason is not None or lps is not None:
                            choices.append({"index": i, "delta": delta, "logprobs": lps, "finish_reason": reason})
                    else:
                        head, echoed = "", None
                        if echo is not None:  # the prompt comes first, in the choice's first chunk
                            d = echo.delta(d)
                            if i not in started:
                                head, echoed = echo.texts[p], echo.echoed(p, first[p])
                        started.add(i)
                        choices.append({"index": i, "text": head + d.text,
                                        "logprobs": logprobs_json([d], False, offsets.get(i, 0), echoed),
                                        "finish_reason": d.finish_reason})
                        offsets[i] = offsets.get(i, 0) + sum(len(piece(t)) for t in
                                                             [*(t for t, _ in echoed or ()), *d.token_ids])
                if choices:
                    yield chunk(choices)
                if out.finished:
                    lasts[p] = out
                    metrics.finished(out.completion_tokens, time.perf_counter() - start, ttft)
            if include_usage:
                yield chunk([], usage=usage([lasts[p] for p in sorted(lasts)], echo))
        except RequestFailed as exc:
            yield "data: " + json.dumps({"error": {"message": str(exc), "type": "server_error"}}) + "\n\n"
        finally:  # however it ends: an unfinished engine stream aborts its request when closed
            for task in pumps:
                task.cancel()
            for stream in streams:
                await stream.aclose()
        yield "data: [DONE]\n\n"

    return app


def chat_message(text: str, reason: str | None, calling: ToolCalling | None) -> dict[str, Any]:
    """A chat choice's message and finish reason: tool calls where the answer is one."""
    calls = calling.parse(text) if calling is not None else None
    if calls:
        return {"message": {"role": "assistant", "content": None, "tool_calls": calls}, "finish_reason": "tool_calls"}
    return {"message": {"role": "assistant", "content": text}, "finish_reason": reason}


@dataclass
class Echo:
    """A completions request with ``echo``: each prompt's text and token ids go before its
    choices' completions; ``score_only`` (max_tokens 0) drops the one token sampled.
    ``texts`` are the prompts as given, token-id prompts decoded (read only after the
    engine admitted them: an id outside the vocabulary is its 400, not a decoder's error)."""

    given: list[Any]
    prompt_ids: list[list[int]]
    score_only: bool
    decode: Callable[[list[int]], str]

    @cached_property
    def texts(self) -> list[str]:
        return [p if isinstance(p, str) else self.decode(ids) for p, ids in zip(self.given, self.prompt_ids)]

    def delta(self, d: SampleDelta) -> SampleDelta:
        """``d`` as the response shows it: nothing generated when only scoring."""
        if not self.score_only:
            return d
        return SampleDelta(d.index, [], "", "length" if d.finish_reason else None,
                           [] if d.logprobs is not None else None)

    def echoed(self, p: int, first: StepOutput) -> list[tuple[int, Any]] | None:
        """Prompt ``p``'s (token id, log-probability) pairs, when the request asked for logprobs."""
        if first.prompt_logprobs is None:
            return None
        return list(zip(self.prompt_ids[p], first.prompt_logprobs))


def usage(outs: list[StepOutput], echo: Echo | None = None) -> dict[str, Any]:
    """The usage object over a response's requests (one per prompt)."""
    prompt = sum(o.prompt_tokens for o in outs)
    completion = 0 if echo is not None and echo.score_only else sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outs)}}
