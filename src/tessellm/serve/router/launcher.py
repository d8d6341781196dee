"""Replica processes on this machine: ``tessellm serve`` children on free local ports (or
from a base port), each with its share of the CPU cores for torch, their output passed on
prefixed with the replica's name, started together and waited for until each /health
answers, stopped when the parent ends (normally, on SIGTERM or SIGINT, or killed: Linux's
parent-death signal). Supervised (``ReplicaGroup.supervise``): a replica that exits is
logged with its status and started again on its port after a backoff, unless restarts are
off or it keeps failing; when no replica is left the group gives up."""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tessellm.core.errors import TessellmError

START_TIMEOUT_S = 900.0
TAIL_LINES = 30
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0
"""A replica that ran this long before it exited starts its backoff over."""

logger = logging.getLogger("tessellm.router")


class ReplicaStartError(TessellmError, RuntimeError):
    """A replica process exited, or did not answer /health in time, while starting."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free on ``host`` now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def replica_threads(num_replicas: int) -> int:
    """Torch threads per replica on the CPU: the cores shared out, at least one each."""
    return max(1, cpu_cores() // num_replicas)


def _die_with_parent() -> None:  # pragma: no cover (runs in the child before exec)
    """Linux: the child gets SIGTERM when its parent dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 (another libc: the parent's own cleanup still stops it)
        pass


@dataclass
class ReplicaProcess:
    """One ``tessellm serve`` child: its name (for messages), port, process and output tail."""

    name: str
    port: int
    process: subprocess.Popen
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    reader: threading.Thread | None = None
    exits: int = 0
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)
    given_up: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pass_output_on(self) -> None:
        """A thread copying the child's output to ours, each line prefixed, the last kept."""
        def copy() -> None:
            for line in self.process.stdout:
                self.tail.append(line.rstrip("\n"))
                sys.stderr.write(f"[{self.name}] {line}")
        self.reader = threading.Thread(target=copy, name=f"tessellm-{self.name}-output", daemon=True)
        self.reader.start()

    def describe(self) -> dict[str, Any]:
        return {"pid": self.process.pid, "port": self.port, "exits": self.exits, "restarts": self.restarts,
                "running": self.process.poll() is None}

    def failure(self, what: str) -> ReplicaStartError:
        tail = "\n".join(f"  {line}" for line in self.tail) or "  (no output)"
        return ReplicaStartError(f"{self.name} ({self.url}) {what}; its last output:\n{tail}")


class ReplicaGroup:
    """Replicas started from ``serve_args`` (one argument list per replica, each ``tessellm
    serve``'s arguments but host and port), ``threads`` torch threads each. Use as a context
    manager: it starts them and waits for their health, and stops them however it is left."""

    def __init__(self, serve_args: list[list[str]], names: list[str], threads: int,
                 start_timeout_s: float = START_TIMEOUT_S, base_port: int | None = None):
        self.serve_args, self.names, self.threads = serve_args, names, threads
        self.start_timeout_s = start_timeout_s
        self.base_port = base_port
        self.replicas: list[ReplicaProcess] = []
        self._stopping = False

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def __enter__(self) -> ReplicaGroup:
        try:
            self.start()
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        for i, (name, args) in enumerate(zip(self.names, self.serve_args)):
            port = free_port() if self.base_port is None else self.base_port + i
            replica = ReplicaProcess(name, port, self._spawn(args, port))
            replica.pass_output_on()
            self.replicas.append(replica)
            logger.info("%s: pid %d on port %d", name, replica.process.pid, port)

    def _spawn(self, args: list[str], port: int) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads),
               "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "tessellm", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, env=env, preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    def supervise(self, *, restart: bool = True, max_restarts: int = 5, on_exit: Any = None, on_restart: Any = None,
                  on_give_up: Any = None, first_backoff_s: float = FIRST_BACKOFF_S) -> None:
        """Watch every replica: one that exits is logged with its status (``on_exit(index)``)
        and, with ``restart``, started again on its port after a backoff (``on_restart(index)``);
        after ``max_restarts`` exits in a row each within ``STABLE_S`` of its start it stays
        down. When no replica is left running or restarting, ``on_give_up(why)``."""
        for index, replica in enumerate(self.replicas):
            threading.Thread(target=self._watch, args=(index, replica, restart, max_restarts, on_exit, on_restart,
                                                       on_give_up, first_backoff_s),
                             name=f"tessellm-{replica.name}-watcher", daemon=True).start()

    def _watch(self, index: int, replica: ReplicaProcess, restart: bool, max_restarts: int, on_exit: Any,
               on_restart: Any, on_give_up: Any, first_backoff_s: float) -> None:
        quick = 0
        while True:
            status = replica.process.wait()
            if self._stopping:
                return
            replica.exits += 1
            quick = 0 if time.monotonic() - replica.started_at >= STABLE_S else quick + 1
            logger.error("%s (pid %d, port %d) exited with status %s", replica.name, replica.process.pid,
                         replica.port, status)
            if on_exit is not None:
                on_exit(index)
            if not restart or quick > max_restarts:
                replica.given_up = True
                logger.error("%s stays down (%s)", replica.name, "restarts are off" if not restart else
                             f"{quick} exits in a row within {STABLE_S:.0f} s of a start")
                if all(r.given_up for r in self.replicas) and on_give_up is not None:
                    on_give_up(f"every replica exited and none will be restarted")
                return
            delay = min(first_backoff_s * 2 ** max(quick - 1, 0), MAX_BACKOFF_S)
            time.sleep(delay)
            if self._stopping:
                return
            replica.process = self._spawn(self.serve_args[index], replica.port)
            replica.started_at = time.monotonic()
            replica.restarts += 1
            replica.pass_output_on()
            logger.warning("%s restarted after %.1f s: pid %d on port %d", replica.name, delay, replica.process.pid,
                           replica.port)
            if on_restart is not None:
                on_restart(index)

    def wait_healthy(self) -> None:
        """Until every replica's /health answers 200; a replica that exits first, or is still
        silent after ``start_timeout_s``, raises ReplicaStartError naming it with its output."""
        import httpx

        deadline = time.monotonic() + self.start_timeout_s
        waiting = list(self.replicas)
        while waiting:
            for replica in list(waiting):
                if replica.process.poll() is not None:
                    if replica.reader is not None:
                        replica.reader.join(timeout=5)  # its output's last lines, read to the end
                    raise replica.failure(f"exited with status {replica.process.returncode} while starting")
                try:
                    if httpx.get(replica.url + "/health", timeout=2.0).status_code == 200:
                        waiting.remove(replica)
                except httpx.TransportError:
                    pass
            if waiting and time.monotonic() > deadline:
                raise waiting[0].failure(f"did not answer /health within {self.start_timeout_s:.0f} s")
            if waiting:
                time.sleep(0.2)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every replica, then SIGKILL those still running after ``timeout_s``."""
        self._stopping = True
        for replica in self.replicas:
            if replica.process.poll() is None:
                replica.process.terminate()
        deadline = time.monotonic() + timeout_s
        for replica in self.replicas:
            try:
                replica.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                replica.process.kill()
                replica.process.wait()


def exit_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread, so the replicas are stopped by the
    code that started them (uvicorn restores this handler and re-raises the signal after its
    own graceful shutdown)."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)
