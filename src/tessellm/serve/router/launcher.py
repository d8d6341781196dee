"""Replica processes on this machine: ``tessellm serve`` children on free local ports, each
with its share of the CPU cores for torch, their output passed on prefixed with the
replica's name, started together and waited for until each /health answers, stopped when
the parent ends (normally, on SIGTERM or SIGINT, or killed: Linux's parent-death signal)."""

from __future__ import annotations

import collections
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

    def failure(self, what: str) -> ReplicaStartError:
        tail = "\n".join(f"  {line}" for line in self.tail) or "  (no output)"
        return ReplicaStartError(f"{self.name} ({self.url}) {what}; its last output:\n{tail}")


class ReplicaGroup:
    """Replicas started from ``serve_args`` (one argument list per replica, each ``tessellm
    serve``'s arguments but host and port), ``threads`` torch threads each. Use as a context
    manager: it starts them and waits for their health, and stops them however it is left."""

    def __init__(self, serve_args: list[list[str]], names: list[str], threads: int,
                 start_timeout_s: float = START_TIMEOUT_S):
        self.serve_args, self.names, self.threads = serve_args, names, threads
        self.start_timeout_s = start_timeout_s
        self.replicas: list[ReplicaProcess] = []

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
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads),
               "PYTHONUNBUFFERED": "1"}
        for name, args in zip(self.names, self.serve_args):
            port = free_port()
            command = [sys.executable, "-m", "tessellm", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       text=True, env=env, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            replica = ReplicaProcess(name, port, process)
            replica.pass_output_on()
            self.replicas.append(replica)

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
