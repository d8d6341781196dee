"""End to end on a GPU: tessellm (flash + paged + continuous) against
transformers' padded `generate` and its continuous batching (`generate_batch`) on the same
requests, in one run, with the step roofline.

What it measures
----------------
A random-weight model with Llama-3.2-1B's shapes (built here from its config with
``torch.manual_seed(0)``, bf16; a word-level tokenizer over its 128,256 ids, since no hub is
reachable) and 512 requests: lognormal prompt lengths with mean about 200 tokens (median 145,
sigma 0.8, clipped to 16..1024), 256 new tokens each (``ignore_eos``), all submitted at t=0.

- tessellm: ``--config``-free pipeline ``attention flash, cache paged, scheduler continuous``;
  ``--set KEY=VALUE`` (repeatable, as ``tessellm --set``) overrides any field of it, e.g.
  ``--set scheduler.options.max_num_seqs=512 --set attention.name=sdpa``.
- transformers: padded static batches of 64 and of 128 (``tessellm.bench.hf_baseline.run_hf_baseline``),
  then continuous batching, ``model.generate_batch`` (``run_hf_generate_batch``, transformers >= 5;
  off with ``--no-hf-generate-batch``), greedy, EOS ignored. ``--skip-hf``: none of them (no
  speedup fields). A baseline that fails is reported as ``{"error": ...}`` and the run goes on.
- Roofline: per decode step at the run's mean batch and mean context, the larger of (weight
  bytes + K/V bytes read) / copy bandwidth and FLOPs / bf16 matmul rate, both measured here;
  ``fraction_of_roofline`` = tessellm's output tokens/s over the roofline's.

Targets: at least 10x transformers' best (``speedup_vs_best_hf``, over every baseline that
ran, ``hf_generate_batch`` included), at least 45% of the roofline.

What counts: ``elapsed_s`` spans the engine's work only. The step timer reads nothing costly
inside it (the collector's frozen-object count, which walks every frozen object, ~45 ms at
480k of them, is read once after the run: ``frozen_objects``), and ``step_time.outside_steps_s``
/ ``outside_steps_share`` give what the run's own loop (submitting, collecting finished
requests) took beside the steps: under 2% is the aim.

Where the time goes: ``step_time`` gives the host's time per step (an overlapped step less
its wait for the GPU) as median and p90 for graph-replayed and other steps; with
``--profile-steps N`` a second, untimed run of the same workload is traced with
``torch.profiler`` over N steady decode steps: ``profile`` holds the GPU time per kernel
(per step, largest first; kernels replayed inside CUDA graphs included), the GPU's busy time
per step against the step's wall time, and the host's time per step in the same window.

How to run
----------
    python bench/e2e_gpu.py --out bench/results/e2e_h100.json            # on a GPU (~5 min)
    python bench/e2e_gpu.py --skip-hf --profile-steps 30 --out e2e.json  # GPU: tessellm only, with its profile
    TRITON_INTERPRET=1 python bench/e2e_gpu.py --smoke                    # CPU: tiny shapes, code path only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch

from tessellm import LLM
from tessellm.bench.offline import describe_device, run_offline
from tessellm.bench.workloads import make_workload
from tessellm.core.config import apply_overrides
from tessellm.core.errors import ConfigError
from tessellm.core.engine.gc_freeze import CollectorClock
from tessellm.core.model.kernel_builds import build_log
from tessellm.bench.hf_baseline import load_transformers, run_hf_baseline, run_hf_generate_batch

LLAMA_32_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                   rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192})
LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                   rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192})
MIXED_PROMPTS = dict(prompt_median=145, prompt_sigma=0.8, prompt_min=16, prompt_max=1024)
"""The workload's prompt lengths (long-tailed, mean about 200 tokens, up to 1024); every
request then generates exactly ``--output-len`` tokens. bench/host_overhead.py --workload
replays the same requests."""
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
            bos_token_id=0, eos_token_id=1)


def build_model(folder: Path, shapes: dict, dtype: torch.dtype, device: str = "cpu") -> None:
    """Random weights of ``shapes`` and a word-level tokenizer over every id, saved as an HF
    folder; ``device`` cuda: initialised on the GPU in ``dtype`` (an 8B model in seconds, no
    float32 copy on the host)."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    if device == "cpu":
        LlamaForCausalLM(LlamaConfig(**shapes)).to(dtype).save_pretrained(folder, safe_serialization=True)
    else:
        with torch.device(device):
            model = LlamaForCausalLM._from_config(LlamaConfig(**shapes), dtype=dtype)
        model.save_pretrained(folder, safe_serialization=True)
        del model
        torch.cuda.empty_cache()
    vocab = {f"t{i}": i for i in range(shapes["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token=f"t{shapes['bos_token_id']}",
                            eos_token=f"t{shapes['eos_token_id']}", pad_token="t0").save_pretrained(folder)


def pipeline_config(folder: Path, cuda: bool, dtype: torch.dtype, overrides: list[str]) -> dict:
    """tessellm's pipeline for these runs (flash + paged + continuous, 256 sequences and 8192
    tokens a step) with ``--set`` overrides applied; raises ConfigError on a bad one."""
    base = {"model": str(folder), "device": "cuda" if cuda else "cpu", "dtype": str(dtype).split(".")[1],
            "max_model_len": 2048, "attention": {"name": "flash"}, "cache": {"name": "paged"},
            "scheduler": {"name": "continuous", "options": {"max_num_seqs": 256, "max_num_batched_tokens": 8192}}}
    return apply_overrides(base, overrides)


def measured_rates(device: torch.device, smoke: bool) -> tuple[float, float]:
    """(copy bandwidth bytes/s, bf16 matmul FLOP/s) on ``device``."""
    n = 2**28 if not smoke else 2**18
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    m = 8192 if not smoke else 256
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16 if not smoke else torch.float32)

    def seconds(fn, reps=10):
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps

    return 2 * n * 4 / seconds(lambda: dst.copy_(src)), 2 * m ** 3 / seconds(lambda: a @ a)


def roofline(shapes: dict, dtype: torch.dtype, batch: float, context: float, bandwidth: float, flops: float) -> float:
    """Output tokens/s at the roofline for decode steps of ``batch`` sequences at ``context``."""
    h, layers, kv, d = shapes["hidden_size"], shapes["num_hidden_layers"], shapes["num_key_value_heads"], shapes["head_dim"]
    heads, inter, vocab = shapes["num_attention_heads"], shapes["intermediate_size"], shapes["vocab_size"]
    params = layers * (h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * inter) + vocab * h
    size = torch.finfo(dtype).bits // 8
    step_bytes = params * size + batch * context * layers * 2 * kv * d * size
    step_flops = 2 * params * batch + batch * layers * 4 * heads * d * context
    return batch / max(step_bytes / bandwidth, step_flops / flops)


def median_ms(seconds: list[float]) -> float | None:
    return round(sorted(seconds)[len(seconds) // 2] * 1e3, 2) if seconds else None


def p90_ms(seconds: list[float]) -> float | None:
    return round(sorted(seconds)[int(len(seconds) * 0.9)] * 1e3, 2) if seconds else None


class StepTimeline:
    """Wall time of every engine step, split into decode steps replayed from a CUDA graph and
    the rest (prefill, mixed and eager steps), so a run's time can be placed: the first steps
    (compilation), the eager ones, or the steady decode. Its wrapper reads only counters
    (no call that walks the heap: it runs inside the timed span)."""

    def __init__(self, llm, clock: CollectorClock):
        # per step: seconds, replayed from a graph, the collector's seconds within, requests finished
        self.records: list[tuple[float, bool, float, int]] = []
        # per step: launched ahead (async scheduling), seconds the host waited for the GPU
        self.overlap: list[tuple[bool, float]] = []
        engine, runner = llm.engine, llm.pipeline.runner
        step = engine.step

        def timed_step():
            stats = engine.stats  # read each step: the benchmark replaces it after the warm-up
            before = runner.graphs.replays if runner.graphs is not None else 0
            gc_before, overlapped, waited = clock.seconds, stats.overlapped_steps, stats.device_wait_seconds
            start = time.perf_counter()
            out = step()
            took = time.perf_counter() - start
            replayed = runner.graphs is not None and runner.graphs.replays > before
            self.records.append((took, replayed, clock.seconds - gc_before, len(out)))
            self.overlap.append((stats.overlapped_steps > overlapped, stats.device_wait_seconds - waited))
            return out

        engine.step = timed_step

    def summary(self, steps: int) -> dict:
        """Over the last ``steps`` steps (the timed run's; the warm-up's came before)."""
        records = self.records[-steps:] if steps else []
        graph = [r[0] for r in records if r[1]]
        other = [r[0] for r in records if not r[1]]
        first = [round(r[0] * 1e3, 1) for r in records[:8]]
        # the slowest steps by position, to place a stall: the collector's share, requests finished
        slowest = sorted(range(len(records)), key=lambda i: records[i][0], reverse=True)[:4]
        # overlapped graph steps: the step's time against the host's wait for the GPU in it. A
        # wait near zero: the host set the pace; the step less its wait: the host's own work
        overlap = self.overlap[-steps:] if steps else []
        both = [(r[0], o[1]) for r, o in zip(records, overlap) if r[1] and o[0]]
        other_host = [r[0] - o[1] for r, o in zip(records, overlap) if not r[1]]
        return {"graph_steps": len(graph), "graph_s": round(sum(graph), 3),
                "graph_step_ms_median": median_ms(graph),
                "slowest_graph_ms": sorted((round(t * 1e3, 1) for t in graph), reverse=True)[:8],
                "other_steps": len(other), "other_s": round(sum(other), 3),
                "slowest_other_ms": sorted((round(t * 1e3, 1) for t in other), reverse=True)[:8],
                "first_steps_ms": first,
                "overlapped_graph_steps": len(both),
                "overlapped_graph_step_ms_median": median_ms([t for t, _ in both]),
                "overlapped_graph_wait_ms_median": median_ms([w for _, w in both]),
                "overlapped_graph_host_ms_median": median_ms([t - w for t, w in both]),
                "overlapped_graph_host_ms_p90": p90_ms([t - w for t, w in both]),
                "other_host_ms_median": median_ms(other_host), "other_host_ms_p90": p90_ms(other_host),
                "slowest_steps": [{"step": i, "ms": round(records[i][0] * 1e3, 1), "graph": records[i][1],
                                   "gc_ms": round(records[i][2] * 1e3, 1), "finished": records[i][3]}
                                  for i in slowest]}


def frozen_object_count() -> int:
    """Objects the engine's ``frozen_heap`` freezes now: what the timed run froze (its heap at
    the start, give or take the run's own), counted outside any timed span."""
    from tessellm.core.engine.gc_freeze import frozen_heap

    with frozen_heap():
        return gc.get_freeze_count()


class ProfileWindow:
    """Traces engine steps ``start`` to ``start + count`` of a run with ``torch.profiler``
    (host and, on CUDA, GPU activity), recording each traced step's wall time, its wait for
    the GPU and whether it replayed a CUDA graph."""

    def __init__(self, llm, start: int, count: int, cuda: bool):
        from torch.profiler import ProfilerActivity, profile

        self.start, self.count, self.steps = start, count, []
        self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
        engine, runner = llm.engine, llm.pipeline.runner
        step, seen = engine.step, [0]

        def traced_step():
            index = seen[0]
            seen[0] += 1
            if index == self.start:
                self.prof.__enter__()
            before = runner.graphs.replays if runner.graphs is not None else 0
            waited = engine.stats.device_wait_seconds
            t = time.perf_counter()
            out = step()
            took = time.perf_counter() - t
            if self.start <= index < self.start + self.count:
                replayed = runner.graphs is not None and runner.graphs.replays > before
                self.steps.append((took, engine.stats.device_wait_seconds - waited, replayed))
            if index == self.start + self.count - 1:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.prof.__exit__(None, None, None)
            return out

        engine.step = traced_step
        self.restore = lambda: setattr(engine, "step", step)

    def summary(self, top: int = 20) -> dict:
        """GPU time per kernel per step (largest first), the GPU's busy time per step against
        the steps' wall time, and the host's time per step (wall less the wait for the GPU)."""
        n = len(self.steps)
        if n == 0:
            return {"error": "the run ended before the profiled window"}
        kernels = {}
        for event in self.prof.key_averages():
            gpu_us = getattr(event, "self_device_time_total", 0) or 0
            if gpu_us > 0 and getattr(event, "device_type", None) is not None and "CUDA" in str(event.device_type):
                kernels[event.key] = kernels.get(event.key, 0.0) + gpu_us
        busy = sum(kernels.values()) / n
        wall = [t for t, _, _ in self.steps]
        host = [t - w for t, w, _ in self.steps]
        return {"steps": n, "graph_steps": sum(r for _, _, r in self.steps),
                "step_ms_median": median_ms(wall), "host_ms_median": median_ms(host), "host_ms_p90": p90_ms(host),
                "gpu_busy_ms_per_step": round(busy / 1e3, 3),
                "gpu_busy_share": round(busy / 1e6 / (sum(wall) / n), 3) if kernels else None,
                "kernels_us_per_step": {name: round(us / n, 1) for name, us in
                                        sorted(kernels.items(), key=lambda kv: -kv[1])[:top]}}


def attempt_profile(llm, requests, steps: int, cuda: bool) -> dict:
    """A second, untimed run of ``requests`` with ``steps`` steps traced from the middle of
    its decode (every request generates as many tokens; halfway, every prompt has long been
    prefilled): ``ProfileWindow.summary``, or the error."""
    start = max(requests[0].output_len // 2 - steps // 2, 1)
    window = ProfileWindow(llm, start, steps, cuda)
    try:
        run_offline(llm, requests, warmup=False)
        return window.summary()
    except Exception as exc:  # noqa: BLE001 - recorded in the report
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        window.restore()


def attempt(name: str, fn) -> dict:
    """``fn()``'s metrics, or ``{"error": ...}`` (traceback on stderr) so that one failure does
    not lose the rest of an expensive run."""
    try:
        metrics = fn().metrics()
        print(f"{name}:", json.dumps(metrics), file=sys.stderr, flush=True)  # kept if a later run hangs
        return metrics
    except Exception as exc:  # noqa: BLE001 - recorded in the report
        print(f"{name} failed:", file=sys.stderr)
        traceback.print_exc()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"error": f"{type(exc).__name__}: {exc}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "e2e.json") if "OUT" in os.environ else None)
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--hf-batches", default="64,128", help="padded generate baselines' batch sizes ('' for none)")
    ap.add_argument("--hf-generate-batch", action=argparse.BooleanOptionalAction, default=True,
                    help="run transformers' continuous batching (model.generate_batch) too (default: on)")
    ap.add_argument("--hf-max-batch-tokens", type=int, default=None,
                    help="generate_batch's max_batch_tokens (default: transformers sizes it from free memory)")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers baselines: tessellm and the roofline only")
    ap.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                    help="override a field of tessellm's pipeline config, e.g. "
                         "--set scheduler.options.max_num_seqs=512 --set attention.name=sdpa (repeatable; YAML values)")
    ap.add_argument("--profile-steps", type=int, default=0, metavar="N",
                    help="after the timed run, trace N steady decode steps of a second run (torch.profiler): GPU "
                         "time per kernel, host time per step (default 0: none)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        ap.error("no GPU: run with --smoke (and TRITON_INTERPRET=1) to check the code path on CPU")
    shapes, dtype = (LLAMA_32_1B, torch.bfloat16) if not args.smoke else (TINY, torch.float32)
    num, out_len = (args.num_requests, args.output_len) if not args.smoke else (4, 8)
    hf_batches = [int(b) for b in args.hf_batches.split(",") if b.strip()] if not args.smoke else [2]
    if args.skip_hf:
        hf_batches = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_model(folder, shapes, dtype)
        try:
            config = pipeline_config(folder, cuda, dtype, args.overrides)
        except ConfigError as exc:
            ap.error(str(exc))
        llm = LLM(config)
        device = llm.pipeline.resolved.device
        requests = make_workload("mixed", seed=0, num_requests=num, tokenizer=llm.tokenizer,
                                 max_model_len=llm.pipeline.resolved.max_model_len,
                                 **MIXED_PROMPTS, output_median=out_len, output_min=out_len, output_max=out_len)
        collector = CollectorClock()
        timeline = StepTimeline(llm, collector)
        with collector:  # the warm-up's two requests included
            metrics = attempt("tessellm", partial(run_offline, llm, requests))
        steps = llm.engine.stats.steps
        graphs = llm.pipeline.runner.graphs
        metrics.update(steps=steps, graph_replays=graphs.replays if graphs is not None else 0,
                       graphs_unsupported=llm.pipeline.runner.graphs_unsupported(), step_time=timeline.summary(steps),
                       async_scheduling=llm.pipeline.async_scheduling,
                       overlapped_steps=llm.engine.stats.overlapped_steps,
                       device_wait_s=round(llm.engine.stats.device_wait_seconds, 4),
                       gc={"passes": collector.passes, "full_passes": collector.full,
                           "seconds": round(collector.seconds, 4), "longest_s": round(collector.longest, 4)},
                       # the caching allocator freeing everything and retrying a failed cudaMalloc (a stall)
                       alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries") if cuda else None,
                       # every Triton variant this process built, start-up included (kernel_builds: in the run)
                       kernels_built=dict(build_log.by_kernel))
        if "elapsed_s" in metrics:  # the run's wall time outside engine steps (the loop's own): near zero
            timed = metrics["step_time"]["graph_s"] + metrics["step_time"]["other_s"]
            metrics["step_time"]["outside_steps_s"] = round(metrics["elapsed_s"] - timed, 3)
            metrics["step_time"]["outside_steps_share"] = round(1 - timed / metrics["elapsed_s"], 4)
        metrics["frozen_objects"] = frozen_object_count()  # after the span: it walks every frozen object
        if args.profile_steps and "error" not in metrics:
            metrics["profile"] = attempt_profile(llm, requests, args.profile_steps, cuda)
        print("tessellm (steps, graphs):", json.dumps(metrics), file=sys.stderr, flush=True)
        del llm, graphs
        gc.collect()  # the pipeline's parts refer to each other: free its KV cache before transformers loads
        if cuda:
            torch.cuda.empty_cache()
        baselines: dict[str, dict] = {}
        runs = {f"hf_batch{b}": partial(run_hf_baseline, requests=requests, pad_id=0, batch_size=b)
                for b in hf_batches}
        if args.hf_generate_batch and not args.skip_hf:
            runs["hf_generate_batch"] = partial(run_hf_generate_batch, requests=requests, pad_id=0,
                                                max_batch_tokens=args.hf_max_batch_tokens)
        if runs:  # one transformers model for all, padded baselines first
            model, load_error = None, None
            try:
                model = load_transformers(folder, dtype, device)
            except Exception as exc:  # noqa: BLE001 - every transformers baseline records it
                traceback.print_exc()
                load_error = {"error": f"loading the transformers model: {type(exc).__name__}: {exc}"}
            for name, run in runs.items():
                baselines[name] = load_error if model is None else attempt(name, partial(run, model))
            del model
    bandwidth, flops = measured_rates(device, args.smoke)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "device": describe_device(device), "torch": torch.__version__, "model": "Llama-3.2-1B shapes, random bf16",
              "overrides": args.overrides, "tessellm": metrics, **baselines,
              "copy_gbps": round(bandwidth / 1e9, 1), "matmul_tflops": round(flops / 1e12, 1)}
    ran = {name: b["output_tokens_per_s"] for name, b in baselines.items() if "error" not in b}
    if "error" not in metrics:
        ours = metrics["output_tokens_per_s"]
        if ran:
            best = max(ran, key=ran.get)
            report.update(best_hf=best, speedup_vs_best_hf=round(ours / ran[best], 2),
                          speedup_vs_hf={name: round(ours / tps, 2) for name, tps in ran.items()})
        mean_batch = metrics["total_output_tokens"] / max(steps, 1)
        mean_context = metrics["total_prompt_tokens"] / len(requests) + out_len / 2
        roof = roofline(shapes, dtype, mean_batch, mean_context, bandwidth, flops)
        report.update(mean_decode_batch=round(mean_batch, 1), mean_context=round(mean_context, 1),
                      roofline_tok_s=round(roof, 1), fraction_of_roofline=round(ours / roof, 3))
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 1 if any("error" in r for r in (metrics, *baselines.values())) else 0


if __name__ == "__main__":
    sys.exit(main())
