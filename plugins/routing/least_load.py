"""``least-load``: each request goes to the replica with the fewest requests in flight."""

from __future__ import annotations

from typing import Sequence

from tessellm.core.hookspecs import hookimpl
from tessellm.core.interfaces.routing import ReplicaState, RouteRequest, RoutingPolicy, least_loaded


class LeastLoad(RoutingPolicy):
    """The replica with the fewest requests in flight (ties: fewest routed so far, then the
    lowest index), so a replica slowed by long requests gets fewer new ones."""

    name = "least-load"
    api_version = "1.19"
    description = "each request to the replica with the fewest requests in flight"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        return least_loaded(replicas).index


@hookimpl
def register_routing(register):
    register(LeastLoad)
