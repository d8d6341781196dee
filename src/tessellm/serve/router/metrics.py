"""The router's /metrics: every replica's own metrics with a ``replica="i"`` label added
(read from its /metrics with prometheus-client's parser, families merged across replicas),
then the router's counters and gauges, all prefixed ``tessellm_router_``."""

from __future__ import annotations

from typing import Any, Iterator

from tessellm.extras import require

require("prometheus_client", "serve")
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest  # noqa: E402
from prometheus_client.core import Metric  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

FAILURE_REASONS = ("no_healthy_replica", "replica_lost_mid_answer")
"""``tessellm_router_failures``' labels: a request refused because no replica could take it
(every one down or tried), and an answer cut off by its replica after bytes reached the client."""


class Relabelled:
    """A prometheus-client collector of the replicas' metrics, each sample labelled with its
    replica's index; a family that several replicas report is one family."""

    def __init__(self, texts: dict[int, str]):
        self.texts = texts

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for index, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for s in family.samples:
                    merged.add_sample(s.name, {**s.labels, "replica": str(index)}, s.value, s.timestamp)
        yield from families.values()


def relabel(texts: dict[int, str]) -> bytes:
    """The Prometheus text of replica index -> its /metrics text, each sample labelled ``replica``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Relabelled(texts))
    return generate_latest(registry)


class RouterMetrics:
    """The router's own metrics (a registry per router)."""

    def __init__(self, num_replicas: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tessellm_router_requests", "Requests sent to each replica (a retry counts again)",
                                ["replica"], registry=r)
        self.retries = Counter("tessellm_router_retries",
                               "Requests tried on another replica after one failed before its first byte", registry=r)
        self.failures = Counter("tessellm_router_failures", "Requests the router ended with an error", ["reason"],
                                registry=r)
        self.healthy = Gauge("tessellm_router_replica_healthy", "1 while the replica answers, else 0", ["replica"],
                             registry=r)
        self.in_flight = Gauge("tessellm_router_requests_in_flight", "Requests routed to the replica, not yet ended",
                               ["replica"], registry=r)
        self.policy = Gauge("tessellm_router_policy", "The routing policy's own numbers (e.g. prefix_match_ratio)",
                            ["stat"], registry=r)
        self.replica_exits = Counter("tessellm_router_replica_exits",
                                     "Times a replica process started here exited", ["replica"], registry=r)
        self.replica_restarts = Counter("tessellm_router_replica_restarts",
                                        "Times a replica process started here was started again", ["replica"],
                                        registry=r)
        for i in range(num_replicas):  # every series present from the start
            self.requests.labels(str(i))
            self.in_flight.labels(str(i))
        for reason in FAILURE_REASONS:
            self.failures.labels(reason)

    def render(self, replica_texts: dict[int, str], policy_stats: dict[str, float], replicas: Any) -> tuple[bytes, str]:
        """The whole /metrics body: the replicas' relabelled, then the router's."""
        for r in replicas:
            self.healthy.labels(str(r.index)).set(1 if r.healthy else 0)
            self.in_flight.labels(str(r.index)).set(r.in_flight)
        for stat, value in policy_stats.items():
            self.policy.labels(stat).set(value)
        return relabel(replica_texts) + generate_latest(self.registry), CONTENT_TYPE_LATEST
