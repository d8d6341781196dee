"""The engine core in its own process: ``tessellm serve``'s default.

The API process (HTTP, chat templates, tokenizing, detokenizing) binds two ZeroMQ sockets
on Unix-domain paths of a private folder; the core process (spawned, not forked: no copy of
the server's threads or sockets) builds the pipeline from the same config, connects, says
``ready`` with what the API side needs to know (``EngineInfo``), then runs ``EngineCore``'s
loop: requests, aborts and calls in on one socket, outputs out on the other, as msgpack
(serve/engine_protocol.py). It dies with its parent (Linux's parent-death signal).

``ProcessTransport`` is the API side's end: the event loop reads the core's messages
itself (the socket's descriptor is one of those it watches; no thread in between, as vLLM's
API server reads its engine core's), and a watcher thread tells the ``EngineClient`` when
the process exits, with its status. ``restart()`` starts a new core on the same sockets
(serve/supervise.py decides when).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import tempfile
import threading
import time
from typing import Any, Callable

from tessellm.core.errors import TessellmError
from tessellm.extras import require

zmq = require("zmq", "serve")
from tessellm.serve.engine_protocol import EngineDead, EngineInfo, pack, unpack

logger = logging.getLogger("tessellm.server")

START_TIMEOUT_S = 900.0


class EngineStartError(TessellmError, RuntimeError):
    """The engine core process exited, or said it could not build the pipeline, while starting."""


def _die_with_parent() -> None:
    """Linux: SIGTERM when the parent dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 (another libc: the parent's own cleanup still stops it)
        pass


def core_main(config: dict[str, Any], inbox: str, outbox: str, log_level: int) -> None:  # pragma: no cover (child)
    """The core process: build the pipeline, say ready (or why not), run the loop."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process stops us
    logging.basicConfig(level=log_level, format="%(levelname)s:     [engine core] %(message)s")
    logging.getLogger("tessellm.server").setLevel(logging.INFO)
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    pull.connect(inbox)
    push.connect(outbox)
    try:
        from tessellm.core.engine.llm import LLM
        from tessellm.serve.engine_core import EngineCore, engine_info

        llm = LLM(config)
    except BaseException as exc:  # noqa: BLE001 (a config or model error: the parent reports it)
        push.send(pack(["fatal", f"{type(exc).__name__}: {exc}"]))
        push.close(linger=2000)
        raise SystemExit(1) from None
    core = EngineCore(llm, push.send)
    signal.signal(signal.SIGTERM, lambda *_: setattr(core, "stopping", True))
    push.send(pack(["ready", engine_info(llm).to_wire()]))
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)

    def receive(timeout: float) -> list[bytes]:
        out: list[bytes] = []
        if timeout > 0 and not poller.poll(int(timeout * 1000)):
            return out
        while True:
            try:
                out.append(pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return out

    try:
        core.run(receive)
    finally:
        close = getattr(llm, "close", None)
        if close is not None:
            close()  # a disk KV tier's queued writes
        push.close(linger=1000)
        pull.close(linger=0)


class ProcessTransport:
    """The API side's end of an engine core process built from ``config``."""

    def __init__(self, config: Any, *, start_timeout_s: float = START_TIMEOUT_S):
        self.config = config.model_dump(mode="json") if hasattr(config, "model_dump") else dict(config)
        self.start_timeout_s = start_timeout_s
        self._folder = tempfile.TemporaryDirectory(prefix="tessellm-core-")
        self.inbox = f"ipc://{self._folder.name}/in"  # API -> core
        self.outbox = f"ipc://{self._folder.name}/out"  # core -> API
        self._context = zmq.Context()
        self._push = self._context.socket(zmq.PUSH)
        self._push.bind(self.inbox)
        self._pull = self._context.socket(zmq.PULL)
        self._pull.bind(self.outbox)
        self._send_lock = threading.Lock()
        self._deliver: Callable[[Any], None] | None = None
        self.process: multiprocessing.process.BaseProcess | None = None
        self.info: EngineInfo | None = None
        self.starts = 0
        self._stopping = False
        self._reading: tuple[Any, Callable[[bytes], None]] | None = None  # (event loop, receive)

    # ------------------------------------------------------------------ starting

    def start(self) -> EngineInfo:
        """Spawn the core and wait until it is ready (``EngineStartError`` if it cannot be)."""
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(target=core_main, name="tessellm-engine-core", daemon=True,
                                     args=(self.config, self.inbox, self.outbox, logging.WARNING))
        self.process.start()
        self.starts += 1
        self.info = self._wait_ready(self.process)
        logger.info("engine core process started: pid %d", self.info.pid)
        return self.info

    def _wait_ready(self, process: Any) -> EngineInfo:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._pull.poll(200):
                message = unpack(self._pull.recv())
                if message[0] == "ready":
                    return EngineInfo.from_wire(message[1])
                if message[0] == "fatal":
                    process.join(timeout=10)
                    raise EngineStartError(f"the engine core could not start: {message[1]}")
                continue  # a dead core's last words
            if not process.is_alive():
                raise EngineStartError(f"the engine core process exited with status {process.exitcode} while "
                                       f"starting (see its output above)")
            if time.monotonic() > deadline:
                process.kill()
                raise EngineStartError(f"the engine core did not start within {self.start_timeout_s:.0f} s")

    def connect(self, deliver: Callable[[Any], None]) -> None:
        """Hand the process's exit to ``deliver`` (from a watcher thread); its messages go to
        the ``receive`` of ``read_on``."""
        self._deliver = deliver
        self._watch(self.process)

    def read_on(self, loop: asyncio.AbstractEventLoop, receive: Callable[[bytes], None]) -> None:
        """Read the core's messages on ``loop`` (from the thread that runs it), each handed to
        ``receive`` as it is read: the socket's descriptor is watched by the loop, no thread
        of ours between them. Called again with another loop, moves there. Until then the
        messages wait in the socket."""
        fd = self._pull.getsockopt(zmq.FD)
        if self._reading is not None and self._reading[0] is not loop and not self._reading[0].is_closed():
            self._reading[0].remove_reader(fd)
        self._reading = (loop, receive)
        loop.add_reader(fd, self.drain)
        self.drain()  # what came before: the descriptor signals changes, not what is waiting

    def _watch(self, process: Any) -> None:
        def wait() -> None:
            multiprocessing.connection.wait([process.sentinel])
            process.join()
            if not self._stopping and process is self.process:
                time.sleep(0.05)  # let the reader pass on the core's last messages first
                self._deliver(("exit", process.exitcode))

        threading.Thread(target=wait, name="tessellm-core-watcher", daemon=True).start()

    def drain(self) -> None:
        """Every message waiting, to ``receive`` (on the loop of ``read_on``). ZeroMQ's
        descriptor only says that something changed: the socket's own events say whether a
        message is there, and are read until none is."""
        if self._reading is None or self._stopping:
            return
        receive = self._reading[1]
        while self._pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                data = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                receive(data)
            except Exception:  # a bug handling one message: the others are still read
                logger.exception("a message from the engine core could not be handled")

    def restart(self) -> EngineInfo:
        """A new core on the same sockets (its messages reach the client as before, its
        ``ready`` among them)."""
        spawn = multiprocessing.get_context("spawn")
        process = spawn.Process(target=core_main, name="tessellm-engine-core", daemon=True,
                                args=(self.config, self.inbox, self.outbox, logging.WARNING))
        process.start()
        self.process = process
        self.starts += 1
        self._watch(process)
        return process

    # ------------------------------------------------------------------ running

    def send(self, data: bytes) -> None:
        """Queue a message for the core; never blocks (the event loop calls it): with no core
        connected (it exited, or a new one is starting) ``EngineDead``."""
        with self._send_lock:
            try:
                self._push.send(data, zmq.NOBLOCK)
            except zmq.Again:
                raise EngineDead("the engine core process is not connected (it exited, or is restarting)") from None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def cpu_in_this_process(self, gauges: dict[str, Any]) -> float:
        return 0.0  # the core's CPU time is its own process's

    def describe(self) -> dict[str, Any]:
        return {"mode": "process", "pid": self.process.pid if self.process else None, "alive": self.alive,
                "starts": self.starts}

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the core to stop, then SIGTERM and SIGKILL it if it lingers."""
        if self._stopping:
            return
        self._stopping = True
        process = self.process
        if process is not None and process.is_alive():
            try:
                self.send(pack(["stop"]))
            except (EngineDead, zmq.ZMQError):  # not connected: SIGTERM below stops it
                process.terminate()
            process.join(timeout=timeout_s)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        if self._reading is not None and not self._reading[0].is_closed():
            try:
                self._reading[0].remove_reader(self._pull.getsockopt(zmq.FD))
            except RuntimeError:  # a loop being torn down
                pass
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._context.term()
        self._folder.cleanup()
