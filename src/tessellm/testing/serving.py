"""Serving for a test or a benchmark: an app with uvicorn on a free port of 127.0.0.1, in a
thread (``serving``), or ``tessellm serve`` as a subprocess (``ServeProcess``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def serving(app: Any, start_timeout: float = 30.0) -> Iterator[str]:
    """Run ``app`` with uvicorn on a free port of 127.0.0.1; yields the base URL and stops
    the server on exit."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + start_timeout
    while not srv.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError(f"the server did not start within {start_timeout:.0f} s")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


def _status_ok(health: dict) -> bool:
    return health.get("status") == "ok"


class ServeProcess:
    """``tessellm serve *args`` on a free port of 127.0.0.1 as a subprocess in its own process
    group (its replicas and engine core with it). As a context manager: entered once /health
    answers 200 with a body ``ready`` accepts, left by SIGTERM to the group (SIGKILL after
    ``stop_timeout`` seconds). A server that exits first, or is not ready within
    ``start_timeout`` seconds, raises RuntimeError."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None,
                 ready: Callable[[dict], bool] = _status_ok, start_timeout: float = 300.0,
                 stop_timeout: float = 60.0, stderr: Any = subprocess.DEVNULL):
        from tessellm.serve.router.launcher import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready, self.start_timeout, self.stop_timeout = ready, start_timeout, stop_timeout
        self.proc = subprocess.Popen([sys.executable, "-m", "tessellm", "serve", *args, "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=stderr, env=env, start_new_session=True)

    def __enter__(self) -> "ServeProcess":
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tessellm serve exited with status {self.proc.returncode} before it was ready")
            try:
                answer = httpx.get(self.url + "/health", timeout=2)
                if answer.status_code == 200 and self.ready(answer.json()):
                    return
            except (httpx.TransportError, ValueError):  # not listening yet, or a body that is not JSON
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"tessellm serve was not ready within {self.start_timeout:.0f} s")
            time.sleep(0.3)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:  # the whole group has exited
            self.proc.wait()
            return
        try:
            self.proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
