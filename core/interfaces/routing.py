"""The routing-policy interface: which data-parallel replica serves a request.

A router (``tessellm router``, ``tessellm serve --data-parallel N``) puts several engine
replicas behind one endpoint. For every generating request it builds a ``RouteRequest`` (the
prompt text it can see), lists the replicas that may take it as ``ReplicaState`` snapshots
(healthy ones, less those a retry already tried) and asks its policy to ``choose`` one. It then
tells the policy what became of the request: ``routed`` when it was sent, ``finished`` when its
answer ended (or failed), and ``replica_down`` when a replica stopped answering (its cache is
gone, or soon will be).

The router calls a policy from one event loop, one call at a time: a policy needs no lock.
Nothing here knows HTTP; the router (src/tessellm/serve/router/) owns the connections.

    class FewestRouted(tessellm.RoutingPolicy):
        name = "fewest-routed"
        api_version = "1.18"

        def choose(self, request, replicas):
            return min(replicas, key=lambda r: (r.routed, r.index)).index
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

from tessellm.core.plugin import Plugin, PluginOptions


@dataclass(frozen=True)
class RouteRequest:
    """What a router sees of a request when it routes it (a routing policy reads it)."""

    text: str
    """The prompt as one string: a completion's ``prompt`` (a list of prompts joined by
    newlines; token ids written as ``"<id> <id> ... "``, so a token prefix is a text prefix),
    or the chat ``messages`` rendered as ``role: content`` lines (tool calls as JSON), so two
    requests that share leading messages share a leading text. Empty when the body has no
    prompt the router can read."""
    model: str | None = None
    """The model id the request names (None if it names none)."""
    stream: bool = False
    """Whether the answer is streamed."""
    path: str = "/v1/completions"
    """The route, e.g. ``/v1/chat/completions``."""


@dataclass(frozen=True)
class ReplicaState:
    """One replica as the router knows it when a request is routed (a snapshot)."""

    index: int
    """Its position in the router's list (0-based): what ``choose`` returns."""
    url: str
    """Its base URL, e.g. ``http://127.0.0.1:8001``."""
    healthy: bool = True
    """Whether its last health probe or request succeeded (``choose`` is offered healthy ones only)."""
    in_flight: int = 0
    """Requests routed to it whose answers have not ended."""
    routed: int = 0
    """Requests routed to it since the router started."""
    failed: int = 0
    """Requests that failed on it (connection lost, no answer)."""


@dataclass(frozen=True)
class RoutingContext:
    """What a routing policy is shown when asked whether it can serve a router
    (``unsupported_reasons``): ``num_replicas``, how many replicas the router has."""

    num_replicas: int


class RoutingPolicy(Plugin):
    """Chooses the replica for each request.

    Contract:
    - ``__init__(options, num_replicas)``: one policy object per router, for its life.
    - ``choose(request, replicas)`` returns the ``index`` of one of ``replicas`` (never
      empty; all healthy). It must not block: it runs on the router's event loop.
    - ``routed(request, index)``: the request was sent to replica ``index`` (a retry after a
      failure is routed again, to another replica).
    - ``finished(request, index, ok)``: its answer ended; ``ok`` False when the replica failed.
    - ``replica_down(index)``: the replica stopped answering; what the policy knows of its
      cache is stale.
    - ``stats()``: numbers the router exports on /metrics as
      ``tessellm_router_policy{stat="..."}`` (e.g. ``prefix-aware``'s match ratio).
    - ``unsupported_reasons(ctx)``: reasons it cannot serve a router of ``ctx.num_replicas``
      replicas ([] when it can).

    A policy's memory must be bounded whatever the traffic (an option, e.g. ``max_blocks``).
    """

    kind: ClassVar[str] = "routing"
    required: ClassVar[tuple[str, ...]] = ("choose",)

    def __init__(self, options: PluginOptions, num_replicas: int):
        self.options = options
        self.num_replicas = num_replicas

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
        """The ``index`` of the replica that serves ``request``, one of ``replicas``."""
        raise NotImplementedError

    def routed(self, request: RouteRequest, index: int) -> None:
        """The request was sent to replica ``index``."""

    def finished(self, request: RouteRequest, index: int, ok: bool) -> None:
        """The request's answer from replica ``index`` ended (``ok``: without a failure)."""

    def replica_down(self, index: int) -> None:
        """Replica ``index`` stopped answering."""

    def stats(self) -> dict[str, float]:
        """Numbers for /metrics, by name; none by default."""
        return {}

    @classmethod
    def unsupported_reasons(cls, ctx: RoutingContext) -> list[str]:  # type: ignore[override]
        """Reasons this policy cannot route among ``ctx.num_replicas`` replicas; [] when it can."""
        return [] if ctx.num_replicas >= 1 else ["a router needs at least one replica"]


def least_loaded(replicas: Sequence[ReplicaState]) -> ReplicaState:
    """The replica with the fewest requests in flight; ties go to the one routed fewest
    requests so far, then to the lowest index (so an idle router spreads its requests)."""
    return min(replicas, key=lambda r: (r.in_flight, r.routed, r.index))
