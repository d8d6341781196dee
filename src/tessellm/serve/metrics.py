"""Prometheus metrics of a serving engine (prometheus-client, a registry per server).

Everything is recorded on the API side's event loop (serve/engine_client.py), per engine
request (one prompt of an HTTP request: a completions request with a list of prompts makes
one engine request per prompt, and an engine request holds its ``n`` samples), from what the
engine core reports: admitted, refused, finished, aborted. Every admitted engine request
ends exactly once, finished or aborted, so ``requests_admitted = requests_finished +
requests_aborted`` once nothing is in flight. Latencies are measured on the API side, as a
client sees them. Gauges are the core's, sent at start, while it steps (every few ms) and
whenever it goes idle; the core process's exits and restarts are counted too.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Iterable

from tessellm.extras import require

require("prometheus_client", "serve")
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,  # noqa: E402
                               generate_latest)

HIT_RATE_WINDOW_S = 60.0
"""The span of ``tessellm_prefix_cache_hit_rate_window``."""

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

FINISH_REASONS = ("stop", "length")
"""``requests_finished``'s labels. A request of ``n`` samples finished by ``length`` when
any of its samples ran out of tokens (``max_tokens`` or the context window), else by ``stop``."""
ABORT_REASONS = ("cancelled", "failed")
"""``requests_aborted``'s labels: ``cancelled``, its stream was closed before the end (the
client left or closed its stream, or the server dropped it because another prompt of the
same batch was refused); ``failed``, the engine failed while running it (the client got a
500 or an error event)."""
REJECT_REASONS = ("busy", "invalid")
"""``requests_rejected``'s labels: the waiting queue was full (429), or the engine refused
the request on admission (400: a prompt too long, an id outside the vocabulary, ...)."""


class ServerMetrics:
    """The server's metrics, all prefixed ``tessellm_``; the API side's event loop records them."""

    def __init__(self, info: Any):
        self.registry = CollectorRegistry()
        self._gauges(info.total_blocks)
        self._request_counters()
        self._latencies()
        self._step_counters()
        self._core_counters()
        self._lora_gauges(info.lora)
        self.baseline(info.gauges)

    def baseline(self, gauges: dict[str, Any]) -> None:
        """Count the core's counters from ``gauges`` on (a core's start), and show its gauges."""
        if not gauges:
            return
        self._steps_seen, self._phases_seen = gauges["steps"], dict(gauges["phases"])
        self._cpu_seen.pop("engine", None)  # a new core's CPU time counts from its start
        queried, hit, _ = gauges["prefix"]
        self._prefix_seen = (queried, hit)
        self._tiers_seen = {name: dict(c) for name, c in gauges["tiers"].items()}
        self._prefix_samples = deque([(time.monotonic(), queried, hit)])
        self._lora_loads_seen = gauges["lora"][3] if gauges["lora"] is not None else 0
        self.on_gauges(gauges)

    def _gauges(self, total_blocks: int) -> None:
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
        self.tier_hit = Counter("tessellm_kv_tier_hit_tokens",
                                "Prompt tokens whose K/V a tier below the device (host, disk) served", ["tier"],
                                registry=r)
        self.tier_read = Counter("tessellm_kv_tier_read_bytes", "Bytes of K/V loaded from a tier to the device",
                                 ["tier"], registry=r)
        self.tier_written = Counter("tessellm_kv_tier_written_bytes", "Bytes of K/V written down into a tier",
                                    ["tier"], registry=r)
        self.tier_blocks = Gauge("tessellm_kv_tier_blocks", "Blocks a tier holds now", ["tier"], registry=r)
        self.blocks_free.set(total_blocks)
        self._prefix_seen = (0, 0)  # already counted
        self._tiers_seen: dict[str, dict[str, int]] = {}
        # (time, queried, hit) after each step: the first at or before the window's start, then the rest
        self._prefix_samples: deque[tuple[float, int, int]] = deque([(time.monotonic(), 0, 0)])

    def _request_counters(self) -> None:
        r = self.registry
        self.requests_admitted = Counter("tessellm_requests_admitted", "Engine requests the engine admitted",
                                         registry=r)
        self.requests_rejected = Counter("tessellm_requests_rejected", "Engine requests refused before admission",
                                         ["reason"], registry=r)
        self.requests_finished = Counter("tessellm_requests_finished", "Engine requests whose every sample finished",
                                         ["finish_reason"], registry=r)
        self.requests_aborted = Counter("tessellm_requests_aborted",
                                        "Admitted engine requests stopped before their end", ["reason"], registry=r)
        for counter, labels in ((self.requests_rejected, REJECT_REASONS), (self.requests_finished, FINISH_REASONS),
                                (self.requests_aborted, ABORT_REASONS)):
            for label in labels:  # every series present (at 0) from start-up
                counter.labels(label)
        self.prompt_tokens = Counter("tessellm_prompt_tokens", "Prompt tokens of admitted engine requests",
                                     registry=r)
        self.generated = Counter("tessellm_generated_tokens",
                                 "Output tokens handed to requests, all samples, aborted requests included",
                                 registry=r)

    def _latencies(self) -> None:
        r = self.registry
        self.ttft = Histogram("tessellm_time_to_first_token_seconds",
                              "Per engine request: from its submission to its first token on the host",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tessellm_time_per_output_token_seconds",
                              "Per sample of a finished request: (finish - first token) / (its tokens - 1)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tessellm_e2e_request_latency_seconds",
                             "Per finished engine request: from its submission to its last sample's finish",
                             buckets=E2E_BUCKETS, registry=r)

    def _step_counters(self) -> None:
        """Where the engine's time goes: steps, their phases, and CPU time by part."""
        r = self.registry
        self.steps = Counter("tessellm_engine_steps", "Engine steps run", registry=r)
        self.phases = Counter("tessellm_engine_step_phase_seconds",
                              "Wall time of engine steps by phase (schedule, prepare, forward, sample, process) and "
                              "of handing their outputs to the requests (output)", ["phase"], registry=r)
        self.cpu = Counter("tessellm_cpu_seconds", "CPU time by part: the engine loop, the API (HTTP, tokenizer, "
                                                   "streams)", ["part"], registry=r)
        self._steps_seen, self._phases_seen, self._cpu_seen = 0, {}, {}

    def _core_counters(self) -> None:
        r = self.registry
        self.core_exits = Counter("tessellm_engine_core_exits", "Times the engine core process exited while serving",
                                  registry=r)
        self.core_restarts = Counter("tessellm_engine_core_restarts",
                                     "Engine core processes started again after one exited", registry=r)
        self.core_up = Gauge("tessellm_engine_core_up", "1 while the engine core serves, else 0", registry=r)
        self.core_up.set(1)

    def _refresh_steps(self, gauges: dict[str, Any], cpu: dict[str, float]) -> None:
        steps = gauges["steps"]
        self.steps.inc(max(steps - self._steps_seen, 0))
        self._steps_seen = steps
        for phase, seconds in gauges["phases"].items():
            self.phases.labels(phase).inc(max(seconds - self._phases_seen.get(phase, 0.0), 0.0))
            self._phases_seen[phase] = seconds
        for part, seconds in cpu.items():
            self.cpu.labels(part).inc(max(seconds - self._cpu_seen.get(part, 0.0), 0.0))
            self._cpu_seen[part] = seconds

    def _lora_gauges(self, lora: Any) -> None:
        """Only on a pipeline that serves LoRA adapters: counts, never a series per adapter
        (adapters loaded at run time would grow the label set without bound)."""
        self.lora_adapters = self.lora_resident = self.lora_pinned = self.lora_loads = None
        if lora is None:
            return
        r = self.registry
        self.lora_adapters = Gauge("tessellm_lora_adapters", "LoRA adapters registered (requests may name them)",
                                   registry=r)
        self.lora_resident = Gauge("tessellm_lora_adapters_resident", "LoRA adapters in the device's slots",
                                   registry=r)
        self.lora_pinned = Gauge("tessellm_lora_slots_pinned", "LoRA slots held by unfinished requests", registry=r)
        self.lora_loads = Counter("tessellm_lora_slot_loads", "LoRA adapters copied into a device slot", registry=r)
        self._lora_loads_seen = 0

    # ------------------------------------------------------------------ engine requests

    def request_rejected(self, reason: str) -> None:
        self.requests_rejected.labels(reason).inc()

    def request_admitted(self, prompt_tokens: int) -> None:
        self.requests_admitted.inc()
        self.prompt_tokens.inc(prompt_tokens)

    def tokens_generated(self, count: int) -> None:
        self.generated.inc(count)

    def request_first_token(self, seconds: float) -> None:
        """Once per engine request, when its first output token reached the host."""
        self.ttft.observe(seconds)

    def request_finished(self, reason: str, e2e_seconds: float, samples: Iterable[tuple[int, float]]) -> None:
        """``samples``: (output tokens, seconds from its first token to its finish) of each sample."""
        self.requests_finished.labels(reason).inc()
        self.e2e.observe(e2e_seconds)
        for tokens, decode_seconds in samples:
            if tokens > 1:
                self.tpot.observe(decode_seconds / (tokens - 1))

    def request_aborted(self, reason: str) -> None:
        self.requests_aborted.labels(reason).inc()

    # ------------------------------------------------------------------ gauges

    def on_gauges(self, gauges: dict[str, Any], cpu: dict[str, float] | None = None) -> None:
        """Refresh the gauges from the engine core's (serve/engine_core.py ``gauges``)."""
        self._refresh_steps(gauges, cpu or {})
        self.running.set(gauges["running"])
        self.waiting.set(gauges["waiting"])
        free = gauges["free_blocks"]
        self.blocks_free.set(free)
        self.blocks_used.set(gauges["total_blocks"] - free)
        self._refresh_prefix_cache(time.monotonic(), *gauges["prefix"], gauges["tiers"])
        if self.lora_adapters is not None and gauges["lora"] is not None:
            self._refresh_lora(*gauges["lora"])

    def core_exited(self) -> None:
        self.core_exits.inc()
        self.core_up.set(0)
        self.running.set(0)
        self.waiting.set(0)

    def core_restarted(self, gauges: dict[str, Any]) -> None:
        """A new core serves: its counters start again (``gauges``, from its ``ready``)."""
        self.core_restarts.inc()
        self.core_up.set(1)
        self.baseline(gauges)

    def _refresh_lora(self, adapters: int, resident: int, pinned: int, loads: int) -> None:
        self.lora_adapters.set(adapters)
        self.lora_resident.set(resident)
        self.lora_pinned.set(pinned)
        self.lora_loads.inc(max(loads - self._lora_loads_seen, 0))
        self._lora_loads_seen = loads

    def _refresh_tiers(self, tiers: dict[str, dict[str, int]]) -> None:
        for name, counters in tiers.items():
            seen = self._tiers_seen.setdefault(name, {})
            for metric, field in ((self.tier_hit, "hit_tokens"), (self.tier_read, "read_bytes"),
                                  (self.tier_written, "written_bytes")):
                value = counters.get(field, 0)
                metric.labels(tier=name).inc(max(value - seen.get(field, 0), 0))
                seen[field] = value
            self.tier_blocks.labels(tier=name).set(counters.get("stored_blocks", 0))

    def _refresh_prefix_cache(self, now: float, queried: int, hit: int, hit_rate: float,
                              tiers: dict[str, dict[str, int]]) -> None:
        seen_queried, seen_hit = self._prefix_seen
        self.prefix_queried.inc(max(queried - seen_queried, 0))
        self.prefix_hit.inc(max(hit - seen_hit, 0))
        self._prefix_seen = (queried, hit)
        self.prefix_hit_rate.set(hit_rate)
        self._refresh_tiers(tiers)
        samples = self._prefix_samples
        samples.append((now, queried, hit))
        while len(samples) > 1 and samples[1][0] <= now - HIT_RATE_WINDOW_S:
            samples.popleft()
        _, queried0, hit0 = samples[0]  # younger than the window: the server's start
        window_queried = queried - queried0
        self.prefix_hit_rate_window.set((hit - hit0) / window_queried if window_queried else 0.0)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
