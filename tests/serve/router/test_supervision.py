"""Replica processes are supervised (``ReplicaGroup.supervise``): an exit is logged with its
status and counted, the replica started again on its port after a backoff, and when every
replica is down for good the group gives up (``serve --data-parallel`` then exits 1). Cheap
stand-in processes play the replicas."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

from tessellm.serve.router.launcher import ReplicaGroup, ReplicaProcess


class StandIns(ReplicaGroup):
    """Replicas that run ``code`` instead of tessellm serve."""

    def __init__(self, code: str, count: int = 2):
        super().__init__([[]] * count, [f"replica {i}" for i in range(count)], 1, base_port=41000)
        self.code = code

    def _spawn(self, args, port):
        return subprocess.Popen([sys.executable, "-c", self.code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)


def wait(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_an_exited_replica_is_logged_counted_and_restarted_on_its_port(caplog):
    caplog.set_level(logging.INFO, logger="tessellm.router")
    group = StandIns("import sys, time; time.sleep(0.3); sys.exit(3)", count=1)
    group.start()
    assert [r.port for r in group.replicas] == [41000]
    exits, restarts = [], []
    try:
        group.supervise(restart=True, max_restarts=5, on_exit=exits.append, on_restart=restarts.append,
                        first_backoff_s=0.01)
        wait(lambda: len(restarts) >= 2)
    finally:
        group.stop()
    replica: ReplicaProcess = group.replicas[0]
    assert exits[:2] == [0, 0] and replica.restarts >= 2 and replica.port == 41000
    lines = [r.getMessage() for r in caplog.records]
    assert any("replica 0 (pid" in m and "port 41000) exited with status 3" in m for m in lines), lines
    assert any(m.startswith("replica 0 restarted") for m in lines)


def test_without_restarts_the_group_gives_up_when_every_replica_is_down():
    group = StandIns("import sys; sys.exit(1)")
    group.start()
    why: list[str] = []
    done = threading.Event()
    group.supervise(restart=False, on_give_up=lambda w: (why.append(w), done.set()))
    assert done.wait(30) and "every replica exited" in why[0]
    assert all(r.given_up and r.exits == 1 for r in group.replicas)


def test_a_replica_that_keeps_failing_at_start_stays_down():
    group = StandIns("import sys; sys.exit(1)", count=1)
    group.start()
    done = threading.Event()
    try:
        group.supervise(restart=True, max_restarts=2, first_backoff_s=0.01, on_give_up=lambda w: done.set())
        assert done.wait(30)
    finally:
        group.stop()
    assert group.replicas[0].restarts == 2 and group.replicas[0].exits == 3
