"""``tessellm serve``: an OpenAI-compatible HTTP server on FastAPI.

POST /v1/completions (serve/completions.py), /v1/chat/completions (serve/chat.py) and
/v1/responses (serve/responses.py), streamed as server-sent events when ``stream`` is true;
GET /v1/models and /v1/models/{id}, the base model and its LoRA adapters, and vLLM's POST
/v1/load_lora_adapter and /v1/unload_lora_adapter (serve/models.py: a request's ``model``
may name an adapter); vLLM's POST /tokenize and /detokenize; POST /v1/embeddings
(serve/embeddings.py), /v1/rerank and /v1/score (serve/rerank.py) for a pipeline with a pooler
(each route answers a pipeline of another task 400, naming what it serves); /health and
/metrics (Prometheus), /version and /ping. One ``EngineClient`` (serve/engine_client.py) sends every
connection's requests to one engine core, in its own process (``tessellm serve``'s default)
or on a thread (an ``LLM`` handed to ``build_app``), so requests from all clients are batched
by the configured scheduler. Every error is OpenAI's error body
(serve/http_errors.py): a user error is a 400 naming the field, never a 500; a full waiting
queue is a 429; a failure inside the engine fails the requests it was running with a 500 and
the server keeps serving. A client that leaves is logged once (499) and its requests aborted.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import Any

from tessellm.extras import require

require("fastapi", "serve")
from fastapi import FastAPI  # noqa: E402
from fastapi.responses import PlainTextResponse  # noqa: E402
from starlette.concurrency import run_in_threadpool  # noqa: E402
from starlette.datastructures import Headers  # noqa: E402

import tessellm.serve.responses  # noqa: E402
from tessellm.serve import chat, completions, embeddings, models, rerank  # noqa: E402
from tessellm.serve.context import ServerContext  # noqa: E402
from tessellm.serve.engine_client import EngineClient  # noqa: E402
from tessellm.serve.engine_thread import EngineThread  # noqa: E402
from tessellm.core.engine.gc_freeze import frozen_heap  # noqa: E402
from tessellm.core.errors import ConfigError  # noqa: E402
from tessellm.core.version import __version__  # noqa: E402
from tessellm.serve.errors import error  # noqa: E402
from tessellm.serve.images import has_images  # noqa: E402
from tessellm.serve.http_errors import RequestError, add_error_handlers  # noqa: E402
from tessellm.serve.metrics import ServerMetrics  # noqa: E402
from tessellm.serve.sampling import check_model  # noqa: E402
from tessellm.serve.schema import DetokenizeRequest, TokenizeRequest  # noqa: E402
from tessellm.serve.streaming import ClientGone, client_gone  # noqa: E402
from tessellm.serve.tools import ToolCalling, render_chat  # noqa: E402


def build_app(engine: Any, *, model_name: str | None = None, api_key: str | None = None,
              max_request_bytes: int = 1 << 20, max_waiting: int | None = 1024,
              stream_interval: int = 1) -> FastAPI:
    """The server's app around ``engine``: an ``EngineClient`` (an engine core process's,
    serve/engine_process.py), or a loaded ``LLM``, whose engine core then runs on a thread
    of this process while the app does. ``stream_interval``: a stream's events after its
    first come every that many tokens (and at its end)."""
    if stream_interval < 1:
        raise ConfigError(f"stream_interval must be at least 1, got {stream_interval}")
    if isinstance(engine, EngineClient):
        client, llm = engine, None
        client.max_waiting = max_waiting
    else:
        llm = engine
        client = EngineThread(llm, max_waiting=max_waiting)
    client.stream_interval = stream_interval
    metrics = client.metrics = client.metrics or ServerMetrics(client.info)  # it records each request's metrics
    ctx = server_context(client, llm, model_name or client.info.model, int(time.time()))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await client.attach()
        if isinstance(client, EngineThread):
            client.start()
        # the start-up heap (torch, transformers, the tokenizer) out of the collector's full
        # passes: the objects each stream's outputs create would otherwise trigger passes over
        # all of it, tens of milliseconds each, many times a second at GPU step rates
        with frozen_heap():
            yield
        client.shutdown()

    app = FastAPI(title="tessellm", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.llm, app.state.ctx = client, metrics, llm, ctx
    app.add_middleware(Guard, max_request_bytes=max_request_bytes, api_key=api_key)
    add_error_handlers(app)
    app.add_exception_handler(ClientGone, client_gone)
    add_info_routes(app, ctx, metrics)
    models.add_routes(app, ctx)
    add_tokenizer_routes(app, ctx)
    completions.add_routes(app, ctx)
    chat.add_routes(app, ctx)
    tessellm.serve.responses.add_routes(app, ctx)
    embeddings.add_routes(app, ctx)
    rerank.add_routes(app, ctx)
    return app


def server_context(client: EngineClient, llm: Any, model_name: str, created: int) -> ServerContext:
    """The shared context, with the LoRA adapters the engine registered at start (later
    changes go through ``client.call``)."""
    info = client.info
    served = models.ServedModels(model_name, info.model, created, info.max_model_len, info.lora_adapters,
                                 runtime_updates=info.lora_runtime_updates)
    return ServerContext(client, model_name, created, served, llm)


class Guard:
    """Refuses a request before it reaches a route: a body over ``max_request_bytes`` (413)
    and, when the server has an API key, a /v1/ request without it (401). Plain ASGI, so a
    streamed answer passes through untouched and its client's disconnect reaches it."""

    def __init__(self, app: Any, max_request_bytes: int, api_key: str | None):
        self.app, self.max_request_bytes, self.api_key = app, max_request_bytes, api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(Headers(scope=scope), scope["path"])
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, headers: Headers, path: str) -> Any:
        size = headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_request_bytes:
            return error(413, f"request body of {size} bytes exceeds the limit of {self.max_request_bytes}",
                         code="request_too_large")
        if self.api_key is not None and path.startswith("/v1/"):
            if headers.get("authorization", "") != f"Bearer {self.api_key}":
                return error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                             kind="authentication_error", code="invalid_api_key")
        return None


def add_info_routes(app: FastAPI, ctx: ServerContext, metrics: ServerMetrics) -> None:
    """/health, /ping, /version and /metrics."""

    @app.get("/health")
    async def health():
        engine = ctx.engine
        core = engine.transport.describe()
        if not engine.alive:
            return error(503, engine.down_reason or "the engine core is not serving", kind="server_error",
                         extra={"engine_core": core})
        return {"status": "ok", "engine_core": core}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """vLLM's (SageMaker's) liveness probe: 200 while the engine serves, like /health."""
        return await health()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return PlainTextResponse(body, media_type=content_type)


def add_tokenizer_routes(app: FastAPI, ctx: ServerContext) -> None:
    """vLLM's POST /tokenize (a text, or chat messages through the chat template, to token
    ids) and POST /detokenize (token ids to text)."""
    tokenizer = ctx.engine.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(ctx, body.model)
        if body.messages is not None and has_images(body.messages):  # images read off the event loop
            ids = await run_in_threadpool(tokenize_ids, ctx, body)
        else:
            ids = tokenize_ids(ctx, body)
        strs = ctx.engine.with_tokenizer(tokenizer.convert_ids_to_tokens, ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": ctx.engine.info.max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(ctx, body.model)
        bad = [t for t in body.tokens if not 0 <= t < len(tokenizer)]
        if bad:
            raise RequestError(400, f"tokens: token id {bad[0]} is outside the tokenizer's vocabulary "
                                    f"[0, {len(tokenizer)})", param="tokens")
        return {"prompt": ctx.engine.with_tokenizer(tokenizer.decode, body.tokens)}


def tokenize_ids(ctx: ServerContext, body: TokenizeRequest) -> list[int]:
    """The token ids of the request's prompt, or of its messages rendered as the chat route
    renders them (special tokens added by default for a prompt, not for messages)."""
    tokenizer = ctx.engine.tokenizer
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return ctx.engine.with_tokenizer(tokenizer, body.prompt, add_special_tokens=special)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(400, f"model {ctx.model_name!r} has no chat template; send prompt instead of messages",
                           param="messages")
    calling = ToolCalling(body.tools, None, None) if body.tools else None
    if has_images(body.messages):  # the images' placeholders expanded, as the chat route sends them
        return chat.chat_prompt(ctx, body, calling)[0]
    try:
        with ctx.engine.tokenizer_lock:
            text = render_chat([m.model_dump() for m in body.messages], tokenizer, calling, **body.template_ending())
            return tokenizer(text, add_special_tokens=bool(body.add_special_tokens))["input_ids"]
    except Exception as exc:  # a template that rejects these messages (roles out of order, ...)
        raise RequestError(400, f"messages could not be rendered with the chat template: {exc}",
                           param="messages") from None
