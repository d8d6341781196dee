"""Keeping a server's engine core running: when the core process exits, its exit is logged
with its status and counted, and a new core is started after a backoff (1 s, doubling to
``MAX_BACKOFF_S``); the count of quick failures in a row is bounded (a core that dies again
within ``STABLE_S`` of its start counts as one more). With restarts off, or after
``max_restarts`` quick failures in a row, the server can no longer serve: ``give_up`` is
called (``tessellm serve`` then exits with status 1, unless ``--keep-running``, where it
stays up answering 503 and /health says why).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

logger = logging.getLogger("tessellm.server")

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0
"""A core that served this long before it exited starts the backoff over."""


class CoreSupervisor:
    """Restarts ``client``'s engine core (a ``ProcessTransport``'s) when it exits."""

    def __init__(self, client: Any, *, restart: bool = True, max_restarts: int = 5,
                 give_up: Callable[[str], None] | None = None, first_backoff_s: float = FIRST_BACKOFF_S):
        self.client, self.restart, self.max_restarts = client, restart, max_restarts
        self.give_up = give_up
        self.first_backoff_s = first_backoff_s
        self.quick_failures = 0
        self.started_at = time.monotonic()
        self.restarts = 0
        self.gave_up: str | None = None
        client.on_core_exit = self.core_exited
        client.on_core_ready = self.core_ready

    def core_exited(self, status: int | None) -> None:
        """On the event loop, after the client failed what was in flight."""
        metrics = self.client.metrics
        if metrics is not None:
            metrics.core_exited()
        served = time.monotonic() - self.started_at
        self.quick_failures = 0 if served >= STABLE_S else self.quick_failures + 1
        if not self.restart:
            self._give_up(f"the engine core exited with status {status} and restarts are off (--no-restart)")
            return
        if self.quick_failures > self.max_restarts:
            self._give_up(f"the engine core exited with status {status}, its {self.quick_failures}th exit within "
                          f"{STABLE_S:.0f} s of a start in a row; giving up after {self.max_restarts} restarts")
            return
        delay = min(self.first_backoff_s * 2 ** max(self.quick_failures - 1, 0), MAX_BACKOFF_S)
        logger.warning("restarting the engine core in %.1f s (restart %d)", delay, self.restarts + 1)
        asyncio.get_running_loop().call_later(delay, self._restart)

    def _restart(self) -> None:
        if self.gave_up is not None:
            return
        self.restarts += 1
        self.started_at = time.monotonic()
        process = self.client.transport.restart()
        logger.info("engine core process restarted: pid %d", process.pid)

    def core_ready(self, gauges: dict[str, Any]) -> None:
        if self.client.metrics is not None:
            self.client.metrics.core_restarted(gauges)

    def _give_up(self, why: str) -> None:
        self.gave_up = why
        logger.critical("%s: the server can no longer serve", why)
        if self.give_up is not None:
            self.give_up(why)
