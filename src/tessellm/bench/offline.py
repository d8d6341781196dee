"""Offline benchmark: every request of a workload submitted at t=0, run to completion.

``run_offline(llm, requests)`` measures tessellm; ``hf_baseline.run_hf_baseline`` measures the
same requests through transformers. Both return a ``BenchResult``; ``build_report`` turns
them into the JSON object ``tessellm bench --json`` prints, ``plot_report`` into a PNG.
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from tessellm.bench.workloads import BenchRequest, plain_token_ids
from tessellm.core.engine.stats import EngineStats
from tessellm.core.engine.gc_freeze import frozen_heap


@dataclass
class RequestTiming:
    """One finished request: its sizes and its times in seconds from the run's start
    (``tpot_s`` None for a single output token; ``ttft_s`` None if none was produced)."""

    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float


@dataclass
class BenchResult:
    """What one run measured. The KV and prefix-cache fields are None for a runner that has
    no such figures (the transformers baseline); ``metrics()`` is the report's view."""

    requests: list[RequestTiming]
    elapsed_s: float
    kv_waste: float | None = None
    kv_capacity_tokens: int | None = None
    """Tokens the KV cache holds (slots handed out to sequences)."""
    kv_bytes_per_token: int | None = None
    """Bytes of K/V (scales included) one token takes over all layers."""
    mha_kv_bytes_per_token: int | None = None
    """The same for plain multi-head attention with the model's query heads in the model's
    dtype (``ModelSpec.mha_values_per_token``): what GQA, a latent or int8 saves against."""
    kv_bytes_per_token_at_max_len: float | None = None
    """K/V bytes a token costs in one sequence of max_model_len tokens, as the cache holds it
    (below ``kv_bytes_per_token`` where sliding-window layers release what no window sees)."""
    kv_sequences_at_max_len: int | None = None
    """Sequences of max_model_len tokens the cache holds at once."""
    kv_longest_context: int | None = None
    """The longest sequence the cache admits (its max_seq_tokens)."""
    prefix_hit_rate: float | None = None
    kv_tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per tier below the device (host, disk): hits, bytes read and written during the run."""
    peak_kv_blocks: int | None = None
    weight_bytes: int | None = None
    """Bytes of the model's weights as held (quantized ones at their packed size, scales included)."""
    peak_running: int | None = None
    preemptions: int | None = None
    draft_tokens: int | None = None
    acceptance_rate: float | None = None
    tokens_per_forward: float | None = None
    """Speculative decoding: draft tokens verified, the share accepted, and tokens a sequence
    gained per target forward (1.0 without speculation)."""
    kernel_builds: int | None = None
    """Triton kernel variants built during the run's steps (each a compile stall; 0 expected)."""
    outputs: list[list[int]] | None = None
    """Each request's output token ids, in workload order (for comparing two runs)."""

    def metrics(self) -> dict[str, Any]:
        prompt = sum(r.prompt_tokens for r in self.requests)
        output = sum(r.output_tokens for r in self.requests)
        secs = self.elapsed_s
        return {
            "num_requests": len(self.requests), "total_prompt_tokens": prompt, "total_output_tokens": output,
            "elapsed_s": round(secs, 4),
            "output_tokens_per_s": round(output / secs, 3), "total_tokens_per_s": round((prompt + output) / secs, 3),
            "requests_per_s": round(len(self.requests) / secs, 4),
            "ttft_ms": summarize([r.ttft_s for r in self.requests]),
            "tpot_ms": summarize([r.tpot_s for r in self.requests]),
            "e2e_ms": summarize([r.e2e_s for r in self.requests]),
            "kv_waste": None if self.kv_waste is None else round(self.kv_waste, 4),
            "kv_capacity_tokens": self.kv_capacity_tokens, "kv_bytes_per_token": self.kv_bytes_per_token,
            "mha_kv_bytes_per_token": self.mha_kv_bytes_per_token,
            "kv_bytes_per_token_at_max_len": self.kv_bytes_per_token_at_max_len,
            "kv_sequences_at_max_len": self.kv_sequences_at_max_len, "kv_longest_context": self.kv_longest_context,
            "prefix_hit_rate": None if self.prefix_hit_rate is None else round(self.prefix_hit_rate, 4),
            "kv_tiers": self.kv_tiers,
            "peak_kv_blocks": self.peak_kv_blocks, "peak_running": self.peak_running,
            "weight_bytes": self.weight_bytes,
            "preemptions": self.preemptions, "draft_tokens": self.draft_tokens,
            "acceptance_rate": None if self.acceptance_rate is None else round(self.acceptance_rate, 4),
            "tokens_per_forward": None if self.tokens_per_forward is None else round(self.tokens_per_forward, 4),
            "kernel_builds": self.kernel_builds,
        }


def summarize(seconds: list[float | None]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds of the defined values (all None if there are none)."""
    values = np.array([s for s in seconds if s is not None], dtype=np.float64) * 1000
    if values.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": round(float(values.mean()), 3), "p50": round(float(p50), 3), "p90": round(float(p90), 3),
            "p99": round(float(p99), 3)}


def request_limit(llm: Any) -> int:
    """Most prompt + output tokens one request may have in this pipeline."""
    p = llm.pipeline
    return min(p.resolved.max_model_len, p.cache.max_seq_tokens - p.decoder.num_lookahead_tokens)


def warm_up(llm: Any, requests: list[BenchRequest]) -> None:
    """Two tiny requests through the whole path: first-call set-up (the sampler, allocator
    growth) is not throughput. Kernel compilation for every step shape already happened when
    the pipeline started (``ModelRunner.warm_up``; the run's ``kernel_builds`` says whether
    any was missed). No warm-up prompt begins with a token a workload prompt begins with, so a
    prefix cache cannot hand the run their KV."""
    taken = {r.prompt_token_ids[0] for r in requests}
    free = [int(t) for t in plain_token_ids(llm.tokenizer, llm.pipeline.spec.vocab_size) if t not in taken]
    n = max(1, min(16, request_limit(llm) // 2 - 4))
    prompts = [[free[0]] * n, [free[0]] * max(1, n // 2)]
    llm.generate(prompts, {"max_tokens": 4, "ignore_eos": True}, progress=False)


def run_offline(llm: Any, requests: list[BenchRequest], *, progress: bool = False, warmup: bool = True) -> BenchResult:
    """Submit every request at t=0 (a workload with turns: every request of a turn at the
    turn's start, once the previous turn has finished), step the engine until all finish, and
    time each one.

    The engine's stats are replaced by fresh ones after the warm-up, and the prefix-cache
    counters are read before and after, so every figure covers this run only."""
    engine = llm.engine
    if warmup:
        warm_up(llm, requests)
    engine.stats = EngineStats()
    cache = llm.pipeline.cache
    before = cache.prefix_cache_stats()
    queried0, hit0 = before.queried_tokens, before.hit_tokens
    bar = tqdm(total=sum(r.output_len for r in requests), desc="tessellm", unit="tok", disable=not progress,
               leave=False)
    done: dict[str, Any] = {}
    elapsed = 0.0
    try:
        for turn in sorted({r.turn for r in requests}):
            elapsed += _run_together(engine, [r for r in requests if r.turn == turn], done, bar)
    finally:
        bar.close()
    timings = []
    for r in requests:
        seq = done[r.request_id].seqs[0]
        out = seq.num_output_tokens
        first, end = seq.first_token_time, seq.finish_time
        timings.append(RequestTiming(
            seq.num_prompt_tokens, out, None if first is None else first - seq.arrival_time,
            (end - first) / (out - 1) if first is not None and out > 1 else None, end - seq.arrival_time))
    after = cache.prefix_cache_stats()
    queried = after.queried_tokens - queried0
    stats = engine.stats
    spec = llm.pipeline.spec
    layers = [cache.layer(i).bytes_per_slot for i in cache.spec.held_layers]  # a pipeline stage's own
    itemsize = llm.pipeline.resolved.dtype.itemsize
    return BenchResult(timings, elapsed, kv_waste=stats.kv_waste,
                       kv_capacity_tokens=cache.num_blocks * cache.layout.block_size,
                       kv_bytes_per_token=None if None in layers else sum(layers),
                       mha_kv_bytes_per_token=spec.num_layers * spec.mha_values_per_token * itemsize,
                       **_kv_capacity(cache, llm.pipeline.resolved.max_model_len),
                       prefix_hit_rate=(after.hit_tokens - hit0) / queried if queried else 0.0,
                       kv_tiers=_tier_delta(before.tiers, after.tiers),
                       peak_kv_blocks=stats.peak_kv_blocks, peak_running=stats.peak_running,
                       weight_bytes=weight_bytes(llm.pipeline.model),
                       preemptions=stats.preemptions, draft_tokens=stats.draft_tokens,
                       acceptance_rate=stats.acceptance_rate, tokens_per_forward=stats.tokens_per_forward,
                       kernel_builds=stats.kernel_builds, outputs=[done[r.request_id].seqs[0].output_token_ids for r in requests])


def _run_together(engine: Any, requests: list[BenchRequest], done: dict[str, Any], bar: Any) -> float:
    """Submit ``requests`` at once and step until they finish (into ``done``); the seconds taken."""
    submitted: list[str] = []
    try:
        start = time.perf_counter()
        for r in requests:
            state = engine.add_request(r.request_id, r.prompt_token_ids, r.sampling_params(), lora=r.lora)
            state.seqs[0].arrival_time = start  # all arrive at t=0: submission time counts as queueing
            submitted.append(r.request_id)
        pending = set(submitted)
        with frozen_heap():  # as in LLM.generate: no full collection walks the pipeline's objects
            while pending:
                finished = engine.step()
                if not finished and not engine.has_unfinished():
                    raise RuntimeError(f"the engine went idle with {len(pending)} benchmark requests unfinished")
                for state in finished:
                    if state.request_id in pending:
                        pending.discard(state.request_id)
                        done[state.request_id] = engine.pop_finished(state.request_id)
                bar.update(engine.stats.generated_tokens - bar.n)
        return time.perf_counter() - start
    except BaseException:
        for request_id in submitted:  # leave no request (or its cache) behind
            if request_id not in done:
                engine.abort(request_id)
        raise


def _tier_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Per tier below the device: what this run added to each counter (stored blocks: at its end)."""
    return {name: {k: v if k == "stored_blocks" else v - before.get(name, {}).get(k, 0) for k, v in counters.items()}
            for name, counters in after.items()}


def weight_bytes(model: Any) -> int:
    """Bytes of every distinct parameter and buffer of ``model`` (tied weights once)."""
    seen = {t.data_ptr(): t.numel() * t.element_size()
            for t in [*model.parameters(), *model.buffers()] if t is not None and t.device.type != "meta"}
    return sum(seen.values())


def _kv_capacity(cache: Any, max_len: int) -> dict[str, Any]:
    """Bytes a token costs in a sequence of ``max_len``, how many such sequences fit, and the
    longest sequence admitted; None where the cache cannot say (no ``bytes_for_sequence``)."""
    held = getattr(cache, "bytes_for_sequence", None)
    if held is None:
        return {}
    per_token = sum(cache.layer(i).bytes_per_slot or 0 for i in cache.spec.held_layers)
    total = cache.num_blocks * cache.layout.block_size * per_token  # the cache in blocks of every layer
    one = held(max_len)
    return {"kv_bytes_per_token_at_max_len": round(one / max_len, 1), "kv_sequences_at_max_len": total // one,
            "kv_longest_context": cache.max_seq_tokens}


# ----------------------------------------------------------------------------- reporting


def cpu_name() -> str | None:
    """The CPU model (``AMD EPYC ...``), or None if the OS does not say."""
    name = platform.processor() or None
    try:  # platform.processor() is often empty on Linux; /proc/cpuinfo names the CPU
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:  # no /proc (macOS, Windows): platform's answer is all there is
        return name


def describe_device(device: torch.device | str) -> str:
    """The device and what it is: ``cuda:0 (NVIDIA H100 80GB HBM3)``, ``cpu (AMD EPYC ...)``."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    name = cpu_name()
    return f"{device} ({name}, {torch.get_num_threads()} threads)" if name else str(device)


def build_report(result: BenchResult, *, workload: dict[str, Any], pipeline: dict[str, Any], device: str,
                 command: str, baseline: BenchResult | None = None,
                 baseline_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON object of one bench run: tessellm's metrics at the top level, then what was run
    where; with a baseline, its metrics under ``baseline``, the throughput ratio ``speedup``
    and, when both runs kept their outputs, ``identical_outputs``: the share of requests whose
    tokens are the same in both (1.0 expected for greedy speculative vs plain decoding)."""
    report = {**result.metrics(), "workload": workload, "pipeline": pipeline, "device": device,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": command,
              "python": platform.python_version(), "torch": torch.__version__}
    if baseline is not None:
        report["baseline"] = {**(baseline_info or {}), **baseline.metrics()}
        theirs = report["baseline"]["output_tokens_per_s"]
        report["speedup"] = round(report["output_tokens_per_s"] / theirs, 3) if theirs else None
        if result.outputs is not None and baseline.outputs is not None:
            same = sum(a == b for a, b in zip(result.outputs, baseline.outputs))
            report["identical_outputs"] = round(same / max(len(result.outputs), 1), 4)
    return report


def format_report(report: dict[str, Any]) -> str:
    """A plain-text table of a report, tessellm beside the baseline when there is one."""
    w, base = report["workload"], report.get("baseline")
    label = None if not base else base.get("name", "baseline") + (
        f" (batch {base['batch_size']})" if base.get("batch_size") else "")
    cols = ["tessellm"] + ([label] if base else [])
    rows: list[tuple[str, list[Any]]] = [
        (key, [m.get(key) for m in [report] + ([base] if base else [])])
        for key in ("num_requests", "total_prompt_tokens", "total_output_tokens", "elapsed_s", "output_tokens_per_s",
                    "requests_per_s", "weight_bytes", "kv_waste", "kv_capacity_tokens", "kv_bytes_per_token",
                    "mha_kv_bytes_per_token", "kv_bytes_per_token_at_max_len", "kv_sequences_at_max_len",
                    "kv_longest_context", "prefix_hit_rate", "peak_kv_blocks", "peak_running", "preemptions",
                    "draft_tokens", "acceptance_rate", "tokens_per_forward", "kernel_builds")]
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{key} {stat}", [m[key][stat] for m in [report] + ([base] if base else [])]))
    cell = lambda v: "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    width = max(len(k) for k, _ in rows)
    lines = [f"tessellm bench: workload {w['name']} ({w['num_requests']} requests, seed {w['seed']}) on "
             f"{report['device']}",
             f"{'':<{width}}  " + "  ".join(f"{c:>22}" for c in cols)]
    lines += [f"{k:<{width}}  " + "  ".join(f"{cell(v):>22}" for v in vals) for k, vals in rows]
    for tier, counters in (report.get("kv_tiers") or {}).items():
        lines.append(f"kv tier {tier}: " + ", ".join(f"{k} {v}" for k, v in counters.items()))
    if "speedup" in report:
        lines.append(f"speedup (output tokens/s, tessellm / baseline): {cell(report['speedup'])}")
    if "identical_outputs" in report:
        lines.append(f"identical outputs (share of requests): {cell(report['identical_outputs'])}")
    lines.append(f"{report['date']}  $ {report['command']}")
    return "\n".join(lines)


def progress_enabled(no_progress: bool, json_output: bool) -> bool:
    return not no_progress and not json_output and sys.stderr.isatty()
