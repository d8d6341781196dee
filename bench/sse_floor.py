"""The floor under a streaming server's costs on this machine, with no engine and no tessellm
code beyond its request schema: CPU microseconds per server-sent event of uvicorn (on uvloop
and httptools, as ``tessellm serve`` runs) and of the raw-socket client reading them; and CPU
milliseconds per request of a burst of streamed requests.

N clients each hold one streamed response open; a ticker wakes every stream every
``--tick-ms`` (an engine step), and each stream then writes one event of the size of a
streamed completion chunk. Two servers: ``fastapi`` (a route returning Starlette's
``StreamingResponse``, as tessellm's routes do) and ``asgi`` (a bare ASGI app calling
``send`` per event). The server measures its own CPU seconds over the ticks; the client its
own. Compare with ``bench/serve_stub.py``'s CPU per step of the API side and the client:
whatever the server does per event above this floor is tessellm's.

``--burst N``: a FastAPI route taking tessellm's ``CompletionRequest`` body (validated by
FastAPI as tessellm's route is) and answering with a ``StreamingResponse`` of three events
after 1 ms; N clients post a streamed completion each, all at once, three bursts; the
server's CPU per request and each burst's time (what admitting ``bench/serve_stub.py``'s N
requests costs before tessellm's own code). With ``--tessellm``, the same bursts against
``tessellm serve`` on ``bench/serve_stub.py``'s stub model (its API process's CPU from
/metrics), for the difference.

    .venv/bin/python bench/sse_floor.py --clients 64 --ticks 400
    .venv/bin/python bench/sse_floor.py --burst 256
    .venv/bin/python bench/sse_floor.py --burst 256 --tessellm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EVENT = ('data: {"id": "cmpl-0123456789abcdef0123456789abcdef", "object": "text_completion", "created": 1, '
         '"model": "stub", "choices": [{"index": 0, "text": " word", "logprobs": null, "finish_reason": null}]}\n\n')


def run_loop(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# ---------------------------------------------------------------------------- the server (a subprocess)


class Ticks:
    """Every stream waits on the current tick's event; the ticker sets it and starts the next."""

    def __init__(self, count: int, tick_s: float):
        self.count, self.tick_s, self.done = count, tick_s, 0
        self.event = asyncio.Event()

    async def run(self) -> None:
        while self.done < self.count:
            await asyncio.sleep(self.tick_s)
            event, self.event = self.event, asyncio.Event()
            self.done += 1
            event.set()

    async def events(self):
        for _ in range(self.count):
            await self.event.wait()
            yield EVENT


def build_app(kind: str, ticks: Ticks):
    if kind == "burst":
        return burst_app()
    if kind == "fastapi":
        from fastapi import FastAPI
        from fastapi.responses import StreamingResponse

        app = FastAPI()

        @app.post("/stream")
        async def stream():
            return StreamingResponse(ticks.events(), media_type="text/event-stream")

        return app

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        async for event in ticks.events():
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def burst_app():
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    from tessellm.serve.schema import CompletionRequest

    app = FastAPI()

    @app.post("/v1/completions")
    async def complete(body: CompletionRequest, request: Request):
        async def events():
            await asyncio.sleep(0.001)
            yield EVENT
            yield 'data: {"usage": {}}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/cpu")
    def cpu():
        return {"cpu_s": time.process_time()}

    return app


async def serve(kind: str, port: int, count: int, tick_s: float, go: Path, result: Path) -> None:
    import uvicorn

    ticks = Ticks(count, tick_s)
    server = uvicorn.Server(uvicorn.Config(build_app(kind, ticks), port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    if kind == "burst":
        await task  # until the client stops it
        return
    while not go.exists():  # every client connected
        await asyncio.sleep(0.01)
    cpu = time.process_time()
    await ticks.run()
    await asyncio.sleep(0.2)  # the last events written
    result.write_text(json.dumps({"cpu_s": time.process_time() - cpu}))
    server.should_exit = True
    await task


# ---------------------------------------------------------------------------- the client (this process)


async def read_stream(port: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    events = 0
    while chunk := await reader.read(1 << 16):
        events += chunk.count(b"data: ")
    writer.close()
    return events


async def clients(port: int, n: int, go: Path) -> tuple[int, float]:
    tasks = [asyncio.create_task(read_stream(port)) for _ in range(n)]
    await asyncio.sleep(1.0)  # connected and waiting
    cpu = time.process_time()
    go.touch()
    events = sum(await asyncio.gather(*tasks))
    return events, time.process_time() - cpu


async def burst(port: int, n: int) -> list[float]:
    body = json.dumps({"model": "stub", "prompt": list(range(3, 67)), "max_tokens": 1, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        while await reader.read(1 << 16):
            pass
        writer.close()

    times = []
    for _ in range(3):
        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        times.append(time.perf_counter() - start)
    return times


def server_cpu(port: int) -> float:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/cpu", timeout=30).json()["cpu_s"]


def wait_listening(port: int) -> None:
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)


def measure_burst(args: argparse.Namespace, folder: Path, port: int) -> dict:
    server = subprocess.Popen([sys.executable, __file__, "--serve", "burst", "--port", str(port), "--folder", str(folder)])
    try:
        wait_listening(port)
        before = server_cpu(port)
        times = run_loop(burst(port, args.burst))
        cpu = server_cpu(port) - before
    finally:
        server.kill()
    return {"server": "burst", "requests": 3 * args.burst, "server_ms_per_request": round(cpu / (3 * args.burst) * 1e3, 3),
            "burst_s": [round(t, 3) for t in times]}


def measure_tessellm_burst(args: argparse.Namespace, folder: Path) -> dict:
    """The bursts against ``tessellm serve`` (engine core process) on the stub model."""
    sys.path.insert(0, str(Path(__file__).parent))
    import serve_stub

    from tessellm.core.model.loader import model_folder, resolve_model
    from tessellm.testing.serving import ServeProcess
    from tessellm.testing.stub_model import make_stub_model

    model = make_stub_model(folder / "stub", model_folder(resolve_model("smollm2-135m")), vocab_size=serve_stub.VOCAB)
    config = folder / "stub.json"
    config.write_text(json.dumps(serve_stub.pipeline_config(model, 2.5)))
    with ServeProcess(["--config", str(config), "--served-model-name", "stub"], env={**os.environ, **serve_stub.STUB_ENV},
                      ready=lambda health: True) as server:
        run_loop(burst(server.port, 16))  # warm-up
        before = serve_stub.scrape(server.url)["cpu:api"]
        times = run_loop(burst(server.port, args.burst))
        time.sleep(0.5)  # the API's CPU counter comes with the core's next gauges
        cpu = serve_stub.scrape(server.url)["cpu:api"] - before
    return {"server": "tessellm", "requests": 3 * args.burst,
            "server_ms_per_request": round(cpu / (3 * args.burst) * 1e3, 3), "burst_s": [round(t, 3) for t in times]}


def measure(kind: str, args: argparse.Namespace, folder: Path, port: int) -> dict:
    go, result = folder / f"go-{kind}", folder / f"result-{kind}.json"
    server = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port), "--ticks", str(args.ticks),
                               "--tick-ms", str(args.tick_ms), "--folder", str(folder)])
    try:
        wait_listening(port)
        events, client_cpu = run_loop(clients(port, args.clients, go))
        server.wait(timeout=120)
    finally:
        server.kill()
    server_cpu = json.loads(result.read_text())["cpu_s"]
    return {"server": kind, "events": events, "server_us_per_event": round(server_cpu / events * 1e6, 1),
            "client_us_per_event": round(client_cpu / events * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--ticks", type=int, default=400)
    ap.add_argument("--tick-ms", type=float, default=5.0)
    ap.add_argument("--port", type=int, default=47290)
    ap.add_argument("--burst", type=int, default=0, help="measure a burst of N streamed requests instead")
    ap.add_argument("--tessellm", action="store_true", help="with --burst: against tessellm serve on the stub model")
    ap.add_argument("--serve", choices=("fastapi", "asgi", "burst"), help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        run_loop(serve(args.serve, args.port, args.ticks, args.tick_ms / 1e3, Path(args.folder) / f"go-{args.serve}",
                       Path(args.folder) / f"result-{args.serve}.json"))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.burst:
            rows = [measure_tessellm_burst(args, Path(tmp)) if args.tessellm else measure_burst(args, Path(tmp), args.port)]
        else:
            rows = [measure(kind, args, Path(tmp), args.port + i) for i, kind in enumerate(("fastapi", "asgi"))]
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
