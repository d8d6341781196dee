"""``round-robin``: each request goes to the next healthy replica in turn."""

from __future__ import annotations

from typing import Sequence

from tessellm.core.hookspecs import hookimpl
from tessellm.core.interfaces.routing import ReplicaState, RouteRequest, RoutingPolicy
from tessellm.core.plugin import PluginOptions


class RoundRobin(RoutingPolicy):
    """Replicas in turn, whatever their load or the prompt (the baseline to compare with)."""

    name = "round-robin"
    api_version = "1.19"
    description = "each request to the next healthy replica in turn"

    def __init__(self, options: PluginOptions, num_replicas: int):
        super().__init__(options, num_replicas)
        self.next = 0  # the replica index whose turn it is

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        # the first offered replica at or after the turn, wrapping around (an unhealthy one is skipped)
        chosen = min(replicas, key=lambda r: (r.index - self.next) % self.num_replicas)
        self.next = (chosen.index + 1) % self.num_replicas
        return chosen.index


@hookimpl
def register_routing(register):
    register(RoundRobin)
