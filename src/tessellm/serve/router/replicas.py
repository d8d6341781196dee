"""The router's replicas: each one's state (health, requests in flight), the routing policy's
calls (choose, routed, finished, replica_down), and the health probes that take a replica out
and bring it back."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from tessellm.core.errors import ContractError
from tessellm.core.interfaces.routing import ReplicaState, RouteRequest, RoutingPolicy, least_loaded
from tessellm.serve.router.metrics import RouterMetrics

logger = logging.getLogger("tessellm.router")

HEALTH_TIMEOUT_S = 5.0
PROBES_TO_FAIL = 2
"""Consecutive failed health probes that take a replica out (a busy replica may be slow to
answer one); a refused connection, or a request that fails, takes it out at once."""
GENERATING = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
"""The routes whose requests the policy routes (and hears of); any other request goes to the
least loaded replica without the policy."""


@dataclass
class Replica:
    """One replica and what the router knows of it."""

    index: int
    url: str
    healthy: bool = False  # until its first probe answers
    in_flight: int = 0
    routed: int = 0
    failed: int = 0
    last_error: str = ""
    failed_probes: int = 0

    def state(self) -> ReplicaState:
        return ReplicaState(self.index, self.url, self.healthy, self.in_flight, self.routed, self.failed)

    def describe(self) -> dict[str, Any]:
        return {"replica": self.index, "url": self.url, "healthy": self.healthy, "in_flight": self.in_flight,
                "routed": self.routed, "failed": self.failed, "last_error": self.last_error or None}


class ReplicaPool:
    """The replicas behind one router, the policy that picks among them, and the HTTP client
    that reaches them (an ``httpx.AsyncClient``). Used from one event loop only."""

    def __init__(self, urls: list[str], policy: RoutingPolicy, client: Any, metrics: RouterMetrics,
                 health_interval_s: float = 1.0):
        self.replicas = [Replica(i, url) for i, url in enumerate(urls)]
        self.policy, self.client, self.metrics = policy, client, metrics
        self.health_interval_s = health_interval_s

    @staticmethod
    def by_policy(request: RouteRequest) -> bool:
        return request.path in GENERATING

    def choose(self, request: RouteRequest, exclude: set[int] = frozenset()) -> Replica | None:
        """The replica the policy picks among the healthy ones not in ``exclude`` (the least
        loaded for a request that does not generate); None when there is none."""
        offered = [r.state() for r in self.replicas if r.healthy and r.index not in exclude]
        if not offered:
            return None
        if not self.by_policy(request):
            return self.replicas[least_loaded(offered).index]
        index = self.policy.choose(request, offered)
        if index not in {s.index for s in offered}:
            raise ContractError(f"routing policy {self.policy.name!r} chose replica {index!r}, which is not one of "
                                f"those offered ({', '.join(str(s.index) for s in offered)}); see docs/plugins.md "
                                f"'Writing a routing policy'")
        return self.replicas[index]

    def begin(self, request: RouteRequest, replica: Replica) -> None:
        replica.in_flight += 1
        replica.routed += 1
        self.metrics.requests.labels(str(replica.index)).inc()
        if self.by_policy(request):
            self.policy.routed(request, replica.index)

    def end(self, request: RouteRequest, replica: Replica, ok: bool) -> None:
        replica.in_flight -= 1
        if not ok:
            replica.failed += 1
        if self.by_policy(request):
            self.policy.finished(request, replica.index, ok)

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Take ``replica`` out until a health probe answers again."""
        replica.last_error = reason
        if replica.healthy:
            replica.healthy = False
            logger.warning("replica %d (%s) is out: %s", replica.index, replica.url, reason)
            self.policy.replica_down(replica.index)

    def mark_up(self, replica: Replica) -> None:
        if not replica.healthy:
            replica.healthy = True
            logger.info("replica %d (%s) is healthy", replica.index, replica.url)

    @property
    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas)

    async def probe(self, replica: Replica) -> bool:
        """GET the replica's /health; mark it up or down by the answer."""
        refused = False
        try:
            resp = await self.client.get(replica.url + "/health", timeout=HEALTH_TIMEOUT_S)
            ok = resp.status_code == 200
            reason = "" if ok else f"/health answered {resp.status_code}"
        except Exception as exc:  # noqa: BLE001 (any transport error means: not answering)
            ok, reason = False, f"/health failed: {type(exc).__name__}: {exc or 'no detail'}"
            refused = isinstance(exc, httpx.ConnectError)  # nothing listens there: no need to ask twice
        replica.failed_probes = 0 if ok else replica.failed_probes + 1
        if ok:
            self.mark_up(replica)
        elif refused or replica.failed_probes >= PROBES_TO_FAIL or not replica.healthy:
            self.mark_down(replica, reason)
        return ok

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in self.replicas))

    async def health_loop(self) -> None:
        """Probe every replica each ``health_interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.probe_all()
