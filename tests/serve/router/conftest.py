"""Fake replicas for router tests: small FastAPI apps that answer /v1/completions (streamed
and not) with text naming themselves, /v1/models, /health and /metrics, and that can be told
to fail: before their first byte, mid-stream, or by answering /health with 503."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

WORDS = ["alpha", "beta", "gamma", "delta"]


@dataclass
class FakeState:
    """What a fake replica does next, and what it saw."""

    name: str
    healthy: bool = True
    fail: str | None = None  # None, "before_first_byte" or "mid_stream" (of a streamed answer)
    bodies: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)
    release: asyncio.Event | None = None  # set by a test: a mid-stream failure waits for it
    closed: int = 0  # answers whose client (the router) went away before their end


def completion_chunk(text: str, index: int = 0) -> bytes:
    payload = {"id": "cmpl-x", "object": "text_completion", "choices": [{"index": index, "text": text,
                                                                          "finish_reason": None}]}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def fake_replica(name: str) -> tuple[FastAPI, FakeState]:
    state = FakeState(name)
    app = FastAPI()
    registry = CollectorRegistry()
    admitted = Counter("tessellm_requests_admitted", "Engine requests the engine admitted", registry=registry)
    Gauge("tessellm_requests_running", "Sequences running", registry=registry).set(0)

    @app.get("/health")
    async def health():
        return {"status": "ok"} if state.healthy else JSONResponse({"error": "down"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": state.name}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state.bodies.append(body)
        state.headers.append(dict(request.headers))
        admitted.inc()
        if body.get("wait_for_disconnect"):  # an answer that never comes: the client must leave
            while not await request.is_disconnected():
                await asyncio.sleep(0.01)
            state.closed += 1
            return JSONResponse({}, status_code=499)
        if not body.get("stream"):
            return {"id": "cmpl-x", "object": "text_completion", "model": "fake",
                    "choices": [{"index": 0, "text": f"{state.name}: " + " ".join(WORDS), "finish_reason": "length",
                                 "logprobs": None}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": len(WORDS), "total_tokens": 3 + len(WORDS)}}
        return StreamingResponse(events(state, body), media_type="text/event-stream")

    return app, state


async def events(state: FakeState, body: dict):
    if state.fail == "before_first_byte":
        raise ConnectionAbortedError("the fake replica fails before its first event")
    try:
        yield completion_chunk(f"{state.name}:")
        for i, word in enumerate(WORDS * (1000 if body.get("endless") else 1)):
            if state.fail == "mid_stream" and i == 2:
                if state.release is not None:
                    await state.release.wait()
                raise ConnectionAbortedError("the fake replica dies mid-stream")
            yield completion_chunk(" " + word)
            await asyncio.sleep(0.01 if body.get("endless") else 0)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 3, "completion_tokens": len(WORDS), "total_tokens": 3 + len(WORDS)}
            yield b"data: " + json.dumps({"id": "cmpl-x", "choices": [], "usage": usage}).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    except asyncio.CancelledError:
        state.closed += 1
        raise


# ---------------------------------------------------------------- fixtures

import socket  # noqa: E402

import pytest  # noqa: E402

from tessellm.testing.serving import serving  # noqa: E402


@pytest.fixture
def fakes():
    """Two fake replicas on free ports: yields [(url, state), (url, state)]."""
    (app0, state0), (app1, state1) = fake_replica("r0"), fake_replica("r1")
    with serving(app0) as url0, serving(app1) as url1:
        yield [(url0, state0), (url1, state1)]


@pytest.fixture
def dead_url():
    """A local URL where nothing listens (a port the OS just handed out and took back)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def dropping_url():
    """A local URL whose server answers /health but closes the connection of any other request
    without a byte of answer (a replica that dies while it works on a request)."""
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.05)  # accept wakes up to see the test's end
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:  # a timeout: look at stop again
                continue
            conn.settimeout(10)
            with conn:
                if conn.recv(65536).startswith(b"GET /health "):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n"
                                 b"connection: close\r\n\r\n{\"status\":\"ok\"}")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(timeout=10)
    server.close()


@pytest.fixture
def router():
    """Factory: ``router(urls, policy="round-robin", **config)`` serves a router over ``urls``
    and returns its base URL (stopped at the test's end)."""
    from contextlib import ExitStack

    from tessellm.serve.router.app import build_router_app
    from tessellm.serve.router.config import router_config

    stack = ExitStack()

    def make(urls: list[str], policy: str = "round-robin", api_key: str | None = None, mirror=None, **fields) -> str:
        config = router_config(replicas=urls, policy=policy, health_interval_s=fields.pop("health_interval_s", 0.05),
                               **fields)
        return stack.enter_context(serving(build_router_app(config, api_key=api_key, mirror=mirror)))

    with stack:
        yield make
