"""The LoRA kernels timed: `triton` (segmented shrink/expand, plugins/lora/triton) against
`torch` (the reference: rows grouped by adapter, two matmuls per group).

What it measures
----------------
One ``apply`` (out [T, hidden] += B[s] @ (A[s] @ x[t]) for every row) on one projection of
``--hidden`` in and out features (default 4096), at every combination of

- adapters resident and used (``--adapters``, default 4, 16, 64: sequence i uses slot
  i mod adapters),
- slot rank (``--ranks``, default 8, 16, 64),
- batch shape: decode-like (1, 16, 64, 256 sequences of one row), prefill-like (1 x 512,
  4 x 1024, 16 x 256 rows) and mixed (a 2048-row chunk beside 64 decodes).

Per point: ``triton_us`` and ``torch_us`` (median microseconds of an eager call, the
step's plan made once beforehand, as a step shares it among its layers), ``speedup`` =
torch / triton; for decode points also both as CUDA-graph replays (``*_graph_us``, how the
engine runs decode steps: static plans); ``triton_gbps``: the bytes one call must move (x,
out read and written, A and B of each adapter used) over triton's eager time; ``max_err``:
the largest |triton - float32 reference| relative to the largest |result| (bfloat16 by
default, ``--dtype``). A point whose error exceeds the dtype's tolerance is flagged and
the exit status is 1.

How to run
----------
    python bench/lora_kernels.py --out bench/results/lora_kernels_h100.json   # on a GPU (about 2 min)
    python bench/lora_kernels.py --adapters 4 --ranks 16 --only decode       # a slice
    TRITON_INTERPRET=1 python bench/lora_kernels.py --smoke                   # CPU: tiny shapes, code path only
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from datetime import datetime, timezone
from typing import Any, Callable

import torch

if not torch.cuda.is_available() or "--smoke" in sys.argv[1:]:
    # --smoke runs on the CPU, the kernels interpreted: set before the kernels are first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tessellm.core.interfaces.lora import LoraKernel, LoraMapping, LoraWeights  # noqa: E402
from tessellm.core.model.compiled import median_seconds  # noqa: E402
from tessellm.core.plugin import PluginOptions  # noqa: E402
from tessellm.plugins.lora.torch_ref import TorchLora  # noqa: E402
from tessellm.plugins.lora.triton import TritonLora, TritonLoraOptions  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}
"""Largest error relative to the result's magnitude a point may show before it is flagged."""

SHAPES: dict[str, list[list[int]]] = {
    "decode": [[1], [1] * 16, [1] * 64, [1] * 256],
    "prefill": [[512], [1024] * 4, [256] * 16],
    "mixed": [[2048] + [1] * 64],
}
"""Each batch shape's sequence lengths, by kind."""

SMOKE_SHAPES: dict[str, list[list[int]]] = {"decode": [[1], [1] * 3], "prefill": [[9, 5]], "mixed": [[7, 1, 1]]}


def command_line(argv: list[str] | None) -> str:
    """The command as typed (``main``'s arguments as if typed when called from Python)."""
    return shlex.join(["python", *sys.argv] if argv is None else ["python", "bench/lora_kernels.py", *argv])


def describe(device: torch.device) -> str:
    from tessellm.bench.offline import describe_device

    return describe_device(device)


def timed_us(fn: Callable[[], object], device: torch.device, reps: int, graph: bool = False) -> float:
    """Median microseconds of ``fn()``: triton's do_bench (or do_bench_cudagraph, replays of
    a captured graph) on CUDA, perf_counter samples on a CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        if graph:
            return do_bench_cudagraph(fn, rep=reps * 5, return_mode="median") * 1e3
        return do_bench(fn, warmup=25, rep=reps * 5, return_mode="median") * 1e3
    return median_seconds(fn, calls=reps) * 1e6


def mapping_of(lengths: list[int], num_adapters: int, device: torch.device, static: bool = False) -> LoraMapping:
    """Sequence i of ``lengths[i]`` rows under slot i mod ``num_adapters``; ``static``: as
    a captured decode graph's mapping (one row per sequence, host lists unused)."""
    slots = [i % num_adapters for i in range(len(lengths))]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    rows = torch.repeat_interleave(torch.tensor(slots), torch.tensor(lengths))
    return LoraMapping(torch.tensor(slots, dtype=torch.int32, device=device), rows.to(device),
                       torch.tensor(starts, dtype=torch.int32, device=device), slots, starts, num_adapters,
                       1 if static else max(lengths), static=static)


def reference(out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, mapping: LoraMapping) -> torch.Tensor:
    """``out`` plus every row's adapter product, in float32 (rows of one slot together)."""
    result = out.float()
    for s in mapping.active_slots:
        rows = torch.nonzero(mapping.token_slots == s).flatten()
        result[rows] += (x[rows].float() @ weights.a[s].float().t()) @ weights.b[s].float().t()
    return result


def moved_bytes(x: torch.Tensor, out: torch.Tensor, weights: LoraWeights, used: int) -> int:
    """What one call must read and write at least: x, out twice, A and B of each adapter used."""
    per_slot = weights.a[0].numel() + weights.b[0].numel()
    return (x.numel() + 2 * out.numel() + used * per_slot) * x.element_size()


def point(kind: str, lengths: list[int], num_adapters: int, rank: int, hidden: int, dtype: torch.dtype,
          device: torch.device, reps: int, kernels: dict[str, LoraKernel]) -> dict[str, Any]:
    """One batch shape at one adapter count and rank: both kernels' times and triton's error."""
    g = torch.Generator(device=device).manual_seed(0)
    tokens = sum(lengths)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    out = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    a = torch.randn(num_adapters, rank, hidden, generator=g, device=device) / hidden ** 0.5
    b = torch.randn(num_adapters, hidden, rank, generator=g, device=device) / rank ** 0.5
    weights = LoraWeights(a.to(dtype), b.to(dtype))
    mapping = mapping_of(lengths, num_adapters, device)
    plans = {name: k.plan(mapping) for name, k in kernels.items()}
    got = out.clone()
    kernels["triton"].apply(got, x, weights, plans["triton"])
    expected = reference(out, x, weights, mapping)
    error = float((got.float() - expected).abs().max() / expected.abs().max().clamp(min=1e-6))
    row: dict[str, Any] = {"kind": kind, "seqs": len(lengths), "tokens": tokens, "adapters": num_adapters,
                           "rank": rank, "hidden": hidden}
    for name, k in kernels.items():
        target = out.clone()
        row[f"{name}_us"] = timed_us(lambda k=k, p=plans[name], t=target: k.apply(t, x, weights, p), device, reps)
    if kind == "decode" and device.type == "cuda":
        static = mapping_of(lengths, num_adapters, device, static=True)
        for name, k in kernels.items():
            target, plan = out.clone(), k.plan(static)
            row[f"{name}_graph_us"] = timed_us(lambda k=k, p=plan, t=target: k.apply(t, x, weights, p), device, reps,
                                               graph=True)
    used = min(num_adapters, len(lengths))
    row["speedup"] = row["torch_us"] / row["triton_us"]
    row["triton_gbps"] = moved_bytes(x, out, weights, used) / row["triton_us"] / 1e3
    row["max_err"] = error
    row["ok"] = error <= TOLERANCE[dtype]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width text table."""
    head = (f"{'kind':8}{'seqs':>5}{'tokens':>7}{'adapt':>6}{'rank':>5}{'triton_us':>11}{'torch_us':>10}"
            f"{'speedup':>8}{'tri_graph':>10}{'tor_graph':>10}{'GB/s':>8}{'max_err':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        graph = (f"{r['triton_graph_us']:10.1f}{r['torch_graph_us']:10.1f}" if "triton_graph_us" in r
                 else f"{'':10}{'':10}")
        lines.append(f"{r['kind']:8}{r['seqs']:5d}{r['tokens']:7d}{r['adapters']:6d}{r['rank']:5d}"
                     f"{r['triton_us']:11.1f}{r['torch_us']:10.1f}{r['speedup']:8.2f}{graph}"
                     f"{r['triton_gbps']:8.0f}{r['max_err']:9.1e}" + ("" if r["ok"] else "  ERROR"))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the report as JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1): code path only")
    ap.add_argument("--adapters", default="4,16,64", help="adapter counts, comma-separated")
    ap.add_argument("--ranks", default="8,16,64", help="slot ranks, comma-separated")
    ap.add_argument("--hidden", type=int, default=4096, help="in and out features of the projection")
    ap.add_argument("--only", choices=sorted(SHAPES), help="one kind of batch shape")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--reps", type=int, default=20, help="timing effort (CUDA: rep = 5 x this, in ms)")
    ap.add_argument("--options", default="{}", help='the triton kernel\'s options as JSON, e.g. \'{"block_n": 128}\'')
    args = ap.parse_args(argv)
    if args.smoke:
        args.adapters, args.ranks, args.hidden, args.reps = "2,3", "8", 40, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not args.smoke:
        print("no GPU: run with --smoke to check the code path on the CPU", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype] if device.type == "cuda" else torch.float32
    kernels = {"triton": TritonLora(TritonLoraOptions(**json.loads(args.options)), device, dtype),
               "torch": TorchLora(PluginOptions(), device, dtype)}
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    rows = []
    for kind, batches in shapes.items():
        if args.only and kind != args.only:
            continue
        for lengths in batches:
            for num_adapters in map(int, args.adapters.split(",")):
                for rank in map(int, args.ranks.split(",")):
                    rows.append(point(kind, lengths, num_adapters, rank, args.hidden, dtype, device, args.reps,
                                      kernels))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    report = {"command": command_line(argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": describe(device), "torch": torch.__version__, "triton": _triton_version(),
              "dtype": str(dtype).replace("torch.", ""), "reps": args.reps, "smoke": args.smoke,
              "triton_options": kernels["triton"].options.model_dump(), "points": rows}
    print(f"# {report['command']}\n# {report['device']}, {report['date']}, torch {report['torch']}, "
          f"triton {report['triton']}, {report['dtype']}\n{table(rows)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
