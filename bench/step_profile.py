"""Where one engine step's time goes on a GPU: the host's phases (schedule, batch building,
decoding, bookkeeping) against the forward (graph replay or eager launches, waited for).

Builds the same random-weight Llama-3.2-1B-shaped model as bench/e2e_gpu.py, fills the
engine with ``--seqs`` decoding sequences, then times ``--steps`` decode steps phase by phase
(each phase ends with a device synchronisation, so GPU time lands in the phase that queued
it) and profiles as many more with cProfile.

    python bench/step_profile.py --out step_profile.txt            # on a GPU (~1 min)
    python bench/step_profile.py --set async_scheduling=true --trace async.json   # the overlap, traced
    TRITON_INTERPRET=1 python bench/step_profile.py --smoke        # CPU: tiny model, code path only
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from e2e_gpu import LLAMA_32_1B, TINY, build_model, pipeline_config  # noqa: E402

from tessellm import LLM  # noqa: E402
from tessellm.core.engine import engine as engine_module  # noqa: E402
from tessellm.core.errors import ConfigError  # noqa: E402
from tessellm.core.interfaces.sequence import SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=None)
    ap.add_argument("--trace", default=None, metavar="FILE.json",
                    help="also write a Chrome trace (torch.profiler, host and GPU) of --steps plain steps, "
                         "e.g. with --set async_scheduling=true to see what the overlap leaves")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    for flag, path in (("--out", args.out), ("--trace", args.trace)):  # fail now, not after the run
        if path and not Path(path).resolve().parent.is_dir():
            ap.error(f"{flag}: the folder of {path!r} does not exist")
    cuda = torch.cuda.is_available()
    shapes, dtype = (LLAMA_32_1B, torch.bfloat16) if cuda and not args.smoke else (TINY, torch.float32)
    seqs, steps = (args.seqs, args.steps) if not args.smoke else (4, 3)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), shapes, dtype)
        try:  # e2e_gpu's pipeline, greedy
            config = pipeline_config(Path(tmp), cuda, dtype, ["decoding.name=greedy", "async_scheduling=false", *args.overrides])
        except ConfigError as exc:
            ap.error(str(exc))
        llm = LLM(config)
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    for i in range(seqs):
        prompt = torch.randint(10, shapes["vocab_size"], (args.prompt_len if not args.smoke else 8,), generator=g)
        engine.add_request(f"r{i}", prompt.tolist(), SamplingParams(max_tokens=5 * steps + 8, ignore_eos=True))
    prefill_lines = []
    kernel_tables = []
    while any(s.num_computed_tokens < s.num_tokens - 1 for st in engine.requests.values() for s in st.seqs):
        before = sum(s.num_computed_tokens for st in engine.requests.values() for s in st.seqs)
        sync()
        start = time.perf_counter()
        profiled = cuda and not kernel_tables and len(prefill_lines) == 1
        if profiled:  # the second prefill step, kernel by kernel
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                engine.step()
                sync()
            kernel_tables.append("prefill step:\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=18))
        else:
            engine.step()
        sync()
        tokens = sum(s.num_computed_tokens for st in engine.requests.values() for s in st.seqs) - before
        prefill_lines.append(f"  prefill step: {tokens} tokens in {(time.perf_counter() - start) * 1e3:.1f} ms"
                             + (" (under the profiler, which slows it)" if profiled else ""))
    for _ in range(3):  # first decode steps of each size: allocator and caches settle
        engine.step()

    phases: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **k):
            sync()
            start = time.perf_counter()
            result = fn(*a, **k)
            sync()
            phases[name] += time.perf_counter() - start
            return result
        return wrapper

    sched, runner, decoder = engine.scheduler, engine.runner, engine.decoder
    originals = (sched.schedule, runner.forward, decoder.decode, engine_module.build_batch)
    sched.schedule = timed("schedule", sched.schedule)
    runner.forward = timed("forward (device, waited for)", runner.forward)
    decoder.decode = timed("decode (sampling)", decoder.decode)
    engine_module.build_batch = timed("build_batch", engine_module.build_batch)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    total = time.perf_counter() - start
    sched.schedule, runner.forward, decoder.decode, engine_module.build_batch = originals
    lines = prefill_lines + [
        f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}; {seqs} sequences decoding, "
        f"context ~{args.prompt_len}; graphs: {runner.graphs is not None}; per step (ms):"]
    for name, seconds in phases.items():
        lines.append(f"  {name:32s} {seconds / steps * 1e3:8.3f}")
    lines.append(f"  {'rest of step (bookkeeping)':32s} {(total - sum(phases.values())) / steps * 1e3:8.3f}")
    lines.append(f"  {'whole step':32s} {total / steps * 1e3:8.3f}")
    sync()
    start, waited = time.perf_counter(), engine.stats.device_wait_seconds
    for _ in range(steps):
        engine.step()
    sync()
    lines.append(f"  {'whole step, not instrumented':32s} {(time.perf_counter() - start) / steps * 1e3:8.3f}")
    if engine.async_scheduling:  # the phases above serialise the overlap; this is the steady state's
        lines.append(f"  {'  of which waiting for the GPU':32s} "
                     f"{(engine.stats.device_wait_seconds - waited) / steps * 1e3:8.3f}")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        engine.step()
    sync()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(35)
    if cuda:  # one decode step, kernel by kernel (replayed graphs show as one launch; eager shows all)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.step()
            sync()
        kernel_tables.append("decode step:\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=18))
    if args.trace:  # plain steps, as the engine runs them (graphs, and the overlap if async)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                    + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])) as prof:
            for _ in range(steps):
                engine.step()
            sync()
        prof.export_chrome_trace(args.trace)
    report = "\n".join(lines) + "\n\n" + "\n".join(kernel_tables) + "\n\n" + text.getvalue()
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
