"""Prometheus metrics of a serving engine (prometheus-client, a registry per server).

Gauges are refreshed by the engine thread after every step (running and waiting requests,
KV blocks used and free, prefix-cache hit rate); counters and histograms are fed by the
request handlers (generated tokens, time to first token, time per output token).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from tessellm.extras import require

require("prometheus_client", "serve")
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,  # noqa: E402
                               generate_latest)

HIT_RATE_WINDOW_S = 60.0
"""The span of ``tessellm_prefix_cache_hit_rate_window``."""

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
                                     "Prompt tokens found in the prefix cache, over tokens looked up, since start",
                                     registry=r)
        self.prefix_hit_rate_window = Gauge(
            "tessellm_prefix_cache_hit_rate_window",
            f"Prompt tokens found in the prefix cache, over tokens looked up, in the last {HIT_RATE_WINDOW_S:.0f} s "
            "(0 when nothing was looked up)", registry=r)
        self.prefix_queried = Counter("tessellm_prefix_cache_queried_tokens",
                                      "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hit = Counter("tessellm_prefix_cache_hit_tokens",
                                  "Prompt tokens found in the prefix cache (their K/V reused)", registry=r)
        start = self.cache.prefix_cache_stats()
        self._prefix_seen = (start.queried_tokens, start.hit_tokens)  # already counted
        # (time, queried, hit) after each step: the first at or before the window's start, then the rest
        self._prefix_samples: deque[tuple[float, int, int]] = deque([(time.monotonic(), *self._prefix_seen)])
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
        self._refresh_prefix_cache(time.monotonic())

    def _refresh_prefix_cache(self, now: float) -> None:
        stats = self.cache.prefix_cache_stats()
        queried, hit = stats.queried_tokens, stats.hit_tokens
        seen_queried, seen_hit = self._prefix_seen
        self.prefix_queried.inc(max(queried - seen_queried, 0))
        self.prefix_hit.inc(max(hit - seen_hit, 0))
        self._prefix_seen = (queried, hit)
        self.prefix_hit_rate.set(stats.hit_rate)
        samples = self._prefix_samples
        samples.append((now, queried, hit))
        while len(samples) > 1 and samples[1][0] <= now - HIT_RATE_WINDOW_S:
            samples.popleft()
        _, queried0, hit0 = samples[0]  # younger than the window: the server's start
        window_queried = queried - queried0
        self.prefix_hit_rate_window.set((hit - hit0) / window_queried if window_queried else 0.0)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def finished(self, completion_tokens: int, seconds: float, ttft: float | None = None) -> None:
        self.generated.inc(completion_tokens)
        self.requests.inc()
        if completion_tokens > 1 and ttft is not None:
            self.tpot.observe((seconds - ttft) / (completion_tokens - 1))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
