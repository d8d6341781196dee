"""Host (Python) time of engine steps, without a model: what a GPU would wait for, or what
async scheduling must hide behind the forward.

Two measurements of decode steps of ``--seqs`` sequences of ``--context`` tokens over the
paged cache and the continuous scheduler:

- whole ``Engine.step`` calls, synchronous and with ``async_scheduling``, around a stub
  forward (a constant logits tensor over a small vocabulary); what a GPU would run (the
  forward, the argmax) is timed apart and left out. Each is run with the heap frozen during
  the steps, as ``LLM.generate``, the benchmarks and the server loop do
  (core/engine/gc_freeze.py), and without: the garbage collector's time and its full passes are
  counted. ``--heap`` first loads the default pipeline (SmolLM2), so the collector has a
  real process's objects to walk; one full collection over them is timed, as it is and
  frozen;
- the parts of a step one by one: scheduling, batch building, each attention backend's
  plan, commit and the KV accounting;
- ``--workload``: bench/e2e_gpu.py's whole workload (512 mixed requests, 256 new tokens
  each, batch 256) through the stub engine, synchronous and async: how many steps, how many
  of them overlapped, the host ms of each kind. The step sequence is the GPU run's (the GPU
  runs' ``steps`` and ``overlapped_steps`` match it), so a scheduling change can be judged
  here before it is timed there;
- ``--profile N``: the N functions with the most time of their own in async steps, under
  cProfile, per call (where to cut next).

    .venv/bin/python bench/host_overhead.py --seqs 256 512 --context 200 [--heap] [--workload] [--profile N] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import gc
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import torch

from tessellm.core.engine.batch_builder import build_batch
from tessellm.core.interfaces.cache import CacheSpec
from tessellm.core.interfaces.kv import KVLayout
from tessellm.core.engine.engine import Engine
from tessellm.core.engine.outputs import StopRule
from tessellm.core.engine.overlap import OverlappedEngine
from tessellm.core.engine.gc_freeze import CollectorClock, frozen_heap
from tessellm.core.interfaces.scheduler import SchedulerLimits
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.core.model.spec import LayerAttention
from tessellm.plugins.attention.cascade import CascadeAttention, CascadeOptions
from tessellm.plugins.attention.flash import FlashAttention, FlashOptions
from tessellm.plugins.attention.sdpa import SdpaAttention, SdpaOptions
from tessellm.plugins.cache.paged import PagedCache, PagedOptions
from tessellm.plugins.decoding.greedy import GreedyDecoder
from tessellm.plugins.scheduler.continuous import ContinuousOptions, ContinuousScheduler

VOCAB = 512
CPU = torch.device("cpu")
STUB_MODEL = SimpleNamespace(attention_scale=0.125, sliding_window=None, head_dim=64, num_kv_heads=8, vocab_size=VOCAB,
                             num_layers=1, attention_of=lambda layer: LayerAttention(), attention_features=frozenset)


class StubRunner:
    """The model runner's interface with no model: plans attention as the real one does,
    then returns fixed logits (token 7 wins). ``device_s`` adds up the time of what a GPU
    would run (the stub forward, the input ids filled from the previous step's tokens, the
    argmax): the host figures leave it out."""

    graphs = None
    spec = SimpleNamespace(num_layers=1)
    on_device = False  # inside a timed call (``on_device``)

    def __init__(self, backend, cache):
        self.device, self.backend, self.cache = CPU, backend, cache
        self.logits = torch.zeros(4096, VOCAB)
        self.logits[:, 7] = 1.0
        self.device_s = 0.0

    def forward(self, batch, layers=None, native_logits=False):
        self.backend.plan(batch, self.cache)
        start = time.perf_counter()
        logits = self.logits[:batch.logits_indices.shape[0]]
        self.device_s += time.perf_counter() - start
        return logits


def on_device(runner: StubRunner, fn):
    """``fn`` with its time counted as device time."""

    def timed(*args, **kwargs):
        if runner.on_device:  # called from device work already counted (decode calls device_tokens)
            return fn(*args, **kwargs)
        runner.on_device = True
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            runner.device_s += time.perf_counter() - start
            runner.on_device = False
    return timed


def paged_parts(seqs: int, context: int, steps: int):
    spec = CacheSpec(1, 1, 1, torch.float32, CPU, 8192)
    blocks = seqs * (context + steps + 32) // 16 + 16
    cache = PagedCache(PagedOptions(block_size=16, num_blocks=blocks), spec, KVLayout("kv", 16, torch.float32))
    sched = ContinuousScheduler(ContinuousOptions(max_num_seqs=seqs, max_num_batched_tokens=max(8192, seqs)),
                                cache, SchedulerLimits(8192, 0))
    return cache, sched


def make_engine(runner, cache, sched, decoder, max_model_len: int, async_scheduling: bool) -> Engine:
    """The engine a pipeline builds, around the stub runner (EOS: token 0)."""
    engine = OverlappedEngine if async_scheduling else Engine
    engine = engine(runner, cache, sched, decoder, stop=StopRule({0}, max_model_len), vocab_size=VOCAB)
    engine._kv_check.armed = False  # the stub forward stores no K/V: the first-forward check would refuse it
    return engine


def prompts(seqs: int, context: int) -> list[list[int]]:
    return [[(i * 7 + j) % (VOCAB - 1) + 1 for j in range(context)] for i in range(seqs)]


def engine_steps(seqs: int, context: int, steps: int, async_scheduling: bool, freeze: bool = True,
                 profiler: cProfile.Profile | None = None) -> dict:
    """Host ms per decode step of a whole ``Engine.step`` after every prompt is prefilled,
    the device's share (``StubRunner.device_s``) left out, with the collector's share of it
    and its full passes over the measured steps (``profiler``: enabled over those steps)."""
    cache, sched = paged_parts(seqs, context, steps)
    decoder = GreedyDecoder(GreedyDecoder.Options(), STUB_MODEL, CPU)
    runner = StubRunner(FlashAttention(FlashOptions(), STUB_MODEL, CPU, torch.float32), cache)
    # the argmax, and (async) the fill of next inputs from the last tokens, are device work
    decoder.device_tokens = on_device(runner, decoder.device_tokens)
    argmax = decoder.decode
    decoder.decode = on_device(runner, argmax)
    engine = make_engine(runner, cache, sched, decoder, 8192, async_scheduling)
    for i, prompt in enumerate(prompts(seqs, context)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=steps + 16, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.unfinished()):
        engine.step()
    for _ in range(3):
        engine.step()
    runner.device_s = 0.0
    with frozen_heap() if freeze else contextlib.nullcontext(), CollectorClock() as clock:
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        for _ in range(steps):
            engine.step()
        if profiler is not None:
            profiler.disable()
        elapsed = time.perf_counter() - start
    return {"host_ms": (elapsed - runner.device_s) / steps * 1000, "gc_ms": clock.seconds / steps * 1000,
            "full_collections": clock.full}


def workload_steps(async_scheduling: bool, num_requests: int = 512, output_len: int = 256,
                   max_seqs: int = 256) -> dict:
    """bench/e2e_gpu.py's workload through the stub engine: steps, overlapped steps, and the
    mean host ms of overlapped and other steps."""
    from e2e_gpu import MIXED_PROMPTS  # bench/, this script's folder

    from tessellm.bench.workloads import make_workload

    requests = make_workload("mixed", seed=0, num_requests=num_requests, tokenizer=range(VOCAB), max_model_len=4096,
                             **MIXED_PROMPTS, output_median=output_len, output_min=output_len, output_max=output_len)
    spec = CacheSpec(1, 1, 1, torch.float32, CPU, 4096)
    blocks = sum(-(-(len(r.prompt_token_ids) + output_len) // 16) for r in requests) + 16
    cache = PagedCache(PagedOptions(block_size=16, num_blocks=blocks), spec, KVLayout("kv", 16, torch.float32))
    sched = ContinuousScheduler(ContinuousOptions(max_num_seqs=max_seqs, max_num_batched_tokens=8192), cache,
                                SchedulerLimits(4096, 0))
    decoder = GreedyDecoder(GreedyDecoder.Options(), STUB_MODEL, CPU)
    runner = StubRunner(FlashAttention(FlashOptions(), STUB_MODEL, CPU, torch.float32), cache)
    runner.logits = torch.zeros(8192, VOCAB)  # a prefill step samples up to a row per token budget
    runner.logits[:, 7] = 1.0
    engine = make_engine(runner, cache, sched, decoder, 4096, async_scheduling)
    for r in requests:
        engine.add_request(r.request_id, r.prompt_token_ids, r.sampling_params())
    kinds = {"overlapped": [0, 0.0], "other": [0, 0.0]}
    with frozen_heap():
        while engine.has_unfinished():
            before, start = engine.stats.overlapped_steps, time.perf_counter()
            engine.step()
            kind = kinds["overlapped" if engine.stats.overlapped_steps > before else "other"]
            kind[0] += 1
            kind[1] += time.perf_counter() - start
    return {"steps": engine.stats.steps, "overlapped_steps": engine.stats.overlapped_steps,
            **{f"{k}_host_ms": round(t / n * 1000, 3) if n else None for k, (n, t) in kinds.items()}}


def profile_async(seqs: int, context: int, steps: int, top: int) -> list[dict]:
    """cProfile over async steady-state steps: the ``top`` functions by time of their own, with
    calls per step and microseconds per call (profiled, so slower than unprofiled)."""
    profiler = cProfile.Profile()
    engine_steps(seqs, context, steps, True, profiler=profiler)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, ncalls, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    out = [{"function": f"{Path(file).name}:{line}({name})", "calls_per_step": round(n / steps, 1),
            "us_per_call": round(tt / n * 1e6, 3)} for (file, line, name), (_, n, tt, _, _) in rows]
    print(f"async steps at {seqs} sequences under cProfile; functions by time of their own:")
    for row in out:
        print(f"  {row['function']:60s} {row['calls_per_step']:8.1f} calls/step {row['us_per_call']:8.3f} us/call")
    return out


def step_parts(seqs: int, context: int, steps: int) -> dict[str, float]:
    """Mean ms per decode step of each part of a step, timed one by one."""
    cache, sched = paged_parts(seqs, context, steps)
    sched.add([Sequence(f"r{i}", p, SamplingParams(max_tokens=steps + 16)) for i, p in enumerate(prompts(seqs, context))])
    backends = [SdpaAttention(SdpaOptions(), STUB_MODEL, CPU, torch.float32),
                CascadeAttention(CascadeOptions(), STUB_MODEL, CPU, torch.float32),
                FlashAttention(FlashOptions(), STUB_MODEL, CPU, torch.float32)]
    totals: dict[str, float] = {}

    def clock(name, fn):
        start = time.perf_counter()
        result = fn()
        totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
        return result

    for step in range(steps + 1):
        if step == 1:
            totals.clear()  # step 0 prefills everything
        out = clock("schedule", sched.schedule)
        batch = clock("build_batch", lambda: build_batch(out.scheduled, cache, CPU))
        for b in backends:
            clock(f"{b.name}.plan", lambda: b.plan(batch, cache))

        def commit():
            for item in out.scheduled:
                item.seq.num_computed_tokens += item.num_query_tokens
                item.seq.token_ids.append(5)
                cache.commit(item.seq)
        clock("commit", commit)
        clock("num_used_slots", cache.num_used_slots)
    return {name: total / steps * 1000 for name, total in totals.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3, help="whole-step runs per point (their mean is reported)")
    ap.add_argument("--heap", action="store_true", help="load the default pipeline first (a real process's heap)")
    ap.add_argument("--workload", action="store_true",
                    help="also replay bench/e2e_gpu.py's workload (steps, overlapped steps)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile async steps at the first --seqs (cProfile) and report the N functions "
                         "with the most time of their own, per call")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if min(args.seqs) < 1 or args.context < 1 or args.steps < 1 or args.repeats < 1:
        ap.error("--seqs, --context, --steps and --repeats must be at least 1")
    if args.profile < 0:
        ap.error(f"--profile takes a count of functions, 0 or more, not {args.profile}")
    torch.manual_seed(0)
    results = {"command": "bench/host_overhead.py", "args": vars(args), "cpu": platform.processor() or platform.machine(),
               "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "points": []}
    if args.heap:
        from tessellm import LLM

        results["heap_pipeline"] = LLM()  # kept alive for the whole run (not written to the JSON)
    results["tracked_objects"] = len(gc.get_objects())
    def full_collection_ms() -> float:  # what one full collection over this heap costs when it comes
        passes = []
        for _ in range(3):
            start = time.perf_counter()
            gc.collect()
            passes.append((time.perf_counter() - start) * 1000)
        return round(min(passes), 1)

    results["full_collection_ms"] = full_collection_ms()
    with frozen_heap():  # as the engine steps: the same heap, frozen
        results["frozen_full_collection_ms"] = full_collection_ms()
    print(f"{results['tracked_objects']} objects tracked; a full collection over them takes "
          f"{results['full_collection_ms']} ms, {results['frozen_full_collection_ms']} ms frozen (best of 3)")
    for seqs in args.seqs:
        point = {"seqs": seqs, "context": args.context}
        print(f"{seqs} sequences of ~{args.context} tokens, {args.repeats} runs of {args.steps} decode steps; "
              f"mean ms per step:")
        for name, mode, freeze in (("sync", False, True), ("async", True, True),
                                   ("sync_unfrozen", False, False), ("async_unfrozen", True, False)):
            runs = [engine_steps(seqs, args.context, args.steps, mode, freeze) for _ in range(args.repeats)]
            mean = {k: sum(r[k] for r in runs) / len(runs) for k in ("host_ms", "gc_ms")}
            mean["full_collections"] = sum(r["full_collections"] for r in runs)  # a rare event: the total
            point[name] = {k: round(v, 3) for k, v in mean.items()}
            print(f"  whole step, {name:15s} host {mean['host_ms']:.3f} ({mean['host_ms'] / seqs * 1000:.2f} us per "
                  f"sequence), of which gc {mean['gc_ms']:.3f}; full collections {mean['full_collections']}")
        parts = step_parts(seqs, args.context, args.steps)
        point["parts_ms"] = {k: round(v, 3) for k, v in parts.items()}
        results["points"].append(point)
        for name, ms in parts.items():
            print(f"  part: {name:22s} {ms:.3f}")
    if args.workload:
        for name, mode in (("sync", False), ("async", True)):
            results[f"workload_{name}"] = replay = workload_steps(mode)
            print(f"e2e workload, {name}: {replay}")
    if args.profile:
        results["profile"] = profile_async(args.seqs[0], args.context, args.steps, args.profile)
    results.pop("heap_pipeline", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
