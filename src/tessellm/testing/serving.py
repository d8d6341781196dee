"""Serving an app for a test: uvicorn on a free port of 127.0.0.1, in a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
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
