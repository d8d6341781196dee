"""Prometheus metrics of a serving engine (prometheus-client, a registry per server).

Gauges are refreshed by the engine thread after every step (running and waiting requests,
KV blocks used and free, prefix-cache hit rate); counters and histograms are fed by the
request handlers (generated tokens, time to first token, time per output token).
"""

from __future__ import annotations

from typing import Any

from tessellm.extras import require

require("prometheus_client", "serve")
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,  # noqa: E402
                               generate_latest)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The server's metrics, all prefixed ``tessellm_``."""

    def __init__(self, pipeline: Any):
        self.cache = pipeline.cache
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("tessellm_requests_running", "Sequences running in the last step", registry=r)
        self.waiting = Gauge("tessellm_requests_waiting", "Sequences admitted and waiting to run", registry=r)
        self.blocks_used = Gauge("tessellm_kv_blocks_used", "KV-cache blocks held by live sequences", registry=r)
        self.blocks_free = Gauge("tessellm_kv_blocks_free", "KV-cache blocks free or evictable", registry=r)
        self.prefix_hit_rate = Gauge("tessellm_prefix_cache_hit_rate",
                                     "Prompt tokens found in the prefix cache, over tokens looked up", registry=r)
        self.generated = Counter("tessellm_generated_tokens", "Tokens generated for finished requests", registry=r)
        self.requests = Counter("tessellm_requests_finished", "Requests answered in full", registry=r)
        self.ttft = Histogram("tessellm_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tessellm_time_per_output_token_seconds",
                              "Mean time between output tokens of a finished request", buckets=LATENCY_BUCKETS,
                              registry=r)
        self._ttft: dict[int, float] = {}

    def on_step(self, engine: Any) -> None:
        """Called on the engine thread after each step."""
        self.running.set(engine.scheduler.num_running)
        self.waiting.set(engine.scheduler.num_waiting)
        free = self.cache.num_free_blocks
        self.blocks_free.set(free)
        self.blocks_used.set(self.cache.num_blocks - free)
        self.prefix_hit_rate.set(self.cache.prefix_cache_stats().hit_rate)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def finished(self, completion_tokens: int, seconds: float, ttft: float | None = None) -> None:
        self.generated.inc(completion_tokens)
        self.requests.inc()
        if completion_tokens > 1 and ttft is not None:
            self.tpot.observe((seconds - ttft) / (completion_tokens - 1))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
