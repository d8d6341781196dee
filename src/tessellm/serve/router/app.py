"""The router: one OpenAI-compatible endpoint in front of several ``tessellm serve`` replicas.

POST /v1/completions, /v1/chat/completions and /v1/responses go to the replica the routing
policy picks (proxy.py: streamed answers passed through event by event, retries before the
first byte); GET /v1/models comes from a healthy replica; POST /v1/load_lora_adapter and
/v1/unload_lora_adapter go to every healthy replica; any other route is passed to one.
/health is ok while a replica is; /metrics is every replica's metrics labelled ``replica``
plus the router's own. With a ``Mirror`` (live A/B) every generating request goes to both
replicas, the client gets replica 0's answer, and GET /ab reports the comparison so far.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import Any

from tessellm.extras import require

require("fastapi", "serve")
require("httpx", "serve")
import httpx  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse, Response  # noqa: E402
from starlette.datastructures import Headers  # noqa: E402

from tessellm.core.errors import ConfigError  # noqa: E402
from tessellm.core.interfaces.routing import RouteRequest, RoutingPolicy  # noqa: E402
from tessellm.serve.errors import error  # noqa: E402
from tessellm.serve.router.config import RouterConfig, load_policy  # noqa: E402
from tessellm.serve.router.metrics import RouterMetrics  # noqa: E402
from tessellm.serve.router.prompt import route_request  # noqa: E402
from tessellm.serve.router.proxy import answer_headers, forward, no_replica, request_headers  # noqa: E402
from tessellm.serve.router.replicas import GENERATING, ReplicaPool  # noqa: E402
from tessellm.serve.streaming import ClientGone, client_gone, new_request_id, until_disconnect  # noqa: E402

BROADCAST = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def build_router_app(config: RouterConfig, *, api_key: str | None = None, policy: RoutingPolicy | None = None,
                     mirror: Any = None, group: Any = None) -> FastAPI:
    """The router's app over ``config.replicas``; ``policy`` (default: the config's, loaded
    through the registry); ``mirror``, a ``Mirror``, makes it a live A/B of two replicas;
    ``group``, the ``ReplicaGroup`` that started the replicas here (their processes show in
    /health, their exits and restarts in /metrics)."""
    if mirror is not None and len(config.replicas) != 2:
        raise ConfigError(f"a mirroring router needs exactly two replicas (arm A, arm B), got {len(config.replicas)}")
    policy = policy or load_policy(config.policy, config.policy_options, len(config.replicas))
    metrics = RouterMetrics(len(config.replicas))
    timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
            pool = app.state.pool = ReplicaPool(config.replicas, policy, client, metrics, config.health_interval_s)
            await pool.probe_all()
            health = asyncio.ensure_future(pool.health_loop())
            try:
                yield
            finally:
                health.cancel()
                await asyncio.gather(health, return_exceptions=True)
                if mirror is not None:
                    await mirror.drain()

    app = FastAPI(title="tessellm router", lifespan=lifespan)
    app.state.config, app.state.metrics, app.state.mirror, app.state.group = config, metrics, mirror, group
    app.add_middleware(ApiKeyGuard, api_key=api_key)
    app.add_exception_handler(ClientGone, client_gone)
    add_generating_routes(app, config, mirror)
    add_info_routes(app, mirror)
    add_passthrough_routes(app, config)
    return app


class ApiKeyGuard:
    """With an API key, a /v1/ request without ``Authorization: Bearer KEY`` is a 401 (the
    server's own answer); plain ASGI, so streams pass through untouched."""

    def __init__(self, app: Any, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.api_key is not None and scope["path"].startswith("/v1/"):
            if Headers(scope=scope).get("authorization", "") != f"Bearer {self.api_key}":
                refusal = error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                kind="authentication_error", code="invalid_api_key")
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def parsed(body: bytes) -> Any:
    """The request body as JSON, or None when it is not (its replica will say what is wrong)."""
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


def add_generating_routes(app: FastAPI, config: RouterConfig, mirror: Any) -> None:
    async def generate(request: Request) -> Response:
        body = await request.body()
        path, data = request.url.path, parsed(body)
        route = route_request(path, data)
        headers = request_headers(request.headers)
        if mirror is not None:
            work = mirror.forward(app.state.pool, route, path, body, data, headers)
        else:
            work = forward(app.state.pool, route, "POST", path, body, headers, max_retries=config.max_retries,
                           params=request.query_params)
        # a client that leaves before the answer starts cancels it: the replica's request is closed, and aborted
        return await until_disconnect(request, work, new_request_id("router"))

    for path in GENERATING:
        app.add_api_route(path, generate, methods=["POST"])


def add_info_routes(app: FastAPI, mirror: Any) -> None:
    @app.get("/health")
    async def health():
        pool: ReplicaPool = app.state.pool
        replicas = [r.describe() for r in pool.replicas]
        group = app.state.group
        if group is not None:  # started here: each one's process
            for described, process in zip(replicas, group.replicas):
                described["process"] = process.describe()
        if not pool.any_healthy:
            return JSONResponse({"status": "unavailable", "replicas": replicas}, status_code=503)
        return {"status": "ok", "replicas": replicas}

    @app.get("/metrics")
    async def prometheus():
        pool: ReplicaPool = app.state.pool
        texts = await replica_metrics(pool)
        body, content_type = app.state.metrics.render(texts, pool.policy.stats(), pool.replicas)
        return PlainTextResponse(body, media_type=content_type)

    if mirror is not None:
        @app.get("/ab")
        async def ab_report():
            return mirror.report(tuple(r.url for r in app.state.pool.replicas))


async def replica_metrics(pool: ReplicaPool) -> dict[int, str]:
    """Each healthy replica's /metrics text, by index (a replica that fails to answer is left out)."""
    async def one(replica: Any) -> str | None:
        try:
            resp = await pool.client.get(replica.url + "/metrics", timeout=10.0)
            return resp.text if resp.status_code == 200 else None
        except httpx.TransportError:
            return None

    healthy = [r for r in pool.replicas if r.healthy]
    texts = await asyncio.gather(*(one(r) for r in healthy))
    return {r.index: t for r, t in zip(healthy, texts) if t is not None}


def add_passthrough_routes(app: FastAPI, config: RouterConfig) -> None:
    async def broadcast(request: Request) -> Response:
        """A LoRA adapter change reaches every healthy replica; the answer is the first
        refusal, else the first replica's."""
        pool: ReplicaPool = app.state.pool
        body, headers = await request.body(), request_headers(request.headers)
        healthy = [r for r in pool.replicas if r.healthy]
        if not healthy:
            return no_replica(pool, {})
        sent = await asyncio.gather(*(pool.client.post(r.url + request.url.path, content=body, headers=headers)
                                      for r in healthy), return_exceptions=True)
        for replica, resp in zip(healthy, sent):
            if isinstance(resp, Exception):
                pool.mark_down(replica, f"{type(resp).__name__}: {resp}")
        answers = [(r, s) for r, s in zip(healthy, sent) if not isinstance(s, Exception)]
        if not answers:
            return no_replica(pool, {})
        replica, resp = next(((r, s) for r, s in answers if s.status_code >= 400), answers[0])
        return Response(resp.content, status_code=resp.status_code, headers=answer_headers(resp, replica))

    async def passthrough(request: Request, path: str) -> Response:
        route = RouteRequest("", None, False, "/" + path)
        return await forward(app.state.pool, route, request.method, "/" + path, await request.body(),
                             request_headers(request.headers), max_retries=config.max_retries,
                             params=request.query_params)

    for path in BROADCAST:
        app.add_api_route(path, broadcast, methods=["POST"])
    app.add_api_route("/{path:path}", passthrough, methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
