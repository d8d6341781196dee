"""Every kernel of every quantizer, per layer, against the bfloat16 linear; the fastest per
layer shape and row count written as the table ``kernel: auto`` reads on CUDA.

What it measures
----------------
For the decoder linears of Llama-3.2-1B and Llama-3.1-8B (q/k/v and gate/up stacked, as
tessellm runs them; random weights, bf16 activations) and row counts from batch-1 decode to
prefill (``--rows``, default 1,4,16,64,256,1024), the time of one layer through:

- ``bf16``: ``F.linear`` on the bfloat16 weight (the baseline);
- `int8-weight`: triton, int8pack (``torch._weight_int8pack_mm``), compiled, tiled;
- `int4-weight` (group 128): triton, tinygemm (``torch._weight_int4pack_mm``), compiled, tiled;
- `w8a8`: int_mm, int_mm_compiled, triton (int8 x int8), triton_weight_only;
- `fp8` (per channel): scaled_mm, triton, compiled, dequantize.

Each timing replays a CUDA graph (how the engine runs decode steps) that runs the layer on
``copies`` distinct weight copies in turn, enough bytes (at least ``--stream-mb``) that the
weights stream from memory rather than sit in the L2 cache; the time is per layer, the
median of ``--reps`` replays. ``torch.compile``d kernels are timed at 1 row only (they are
the fused GEMV of decode; each row count would be a compile). A kernel that fails at a
point (unsupported there) is recorded with its error and left out of the table.

``--table FILE`` writes, per quantizer and shape, the fastest kernel at each row count
(consecutive row counts with one winner merged): pass it as ``quant.options.kernel_table``
(bench/quant_e2e.py does) or copy it over plugins/quant/kernel_tables/sm_90.json once
measured. ``--smoke`` runs tiny shapes on the CPU (Triton interpreted, no graphs, the
compiled kernels left out) to check the code path.

    python bench/quant_kernels.py --out quant_kernels.json --table quant_table.json   # GPU, ~1-2 min
    python bench/quant_kernels.py --smoke --out /tmp/q.json --table /tmp/t.json       # CPU, code path
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SHAPES = {  # (out_features, in_features) of each decoder linear, q/k/v and gate/up stacked
    "llama-3.2-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
}
SMOKE_SHAPES = {"tiny": {"up": (48, 128), "down": (64, 96)}}
KERNELS = {
    "int8-weight": ["triton", "int8pack", "compiled", "tiled"],
    "int4-weight": ["triton", "tinygemm", "compiled", "tiled"],
    "w8a8": ["int_mm", "int_mm_compiled", "triton", "triton_weight_only"],
    "fp8": ["scaled_mm", "triton", "compiled", "dequantize"],
}
COMPILED = {"compiled", "int_mm_compiled"}
INT4_GROUP = 128


def make_layer(quantizer: str, kernel: str, weight: torch.Tensor) -> nn.Module:
    """A layer of ``quantizer`` over ``weight`` [N, K] running ``kernel`` for every step."""
    from tessellm.plugins.quant.fp8.linear import Fp8Linear, quantize_fp8
    from tessellm.plugins.quant.int4.linear import Int4WeightLinear
    from tessellm.plugins.quant.int4.quantize import quantize_int4
    from tessellm.plugins.quant.int8.linear import Int8WeightLinear
    from tessellm.plugins.quant.int8.w8a8 import W8A8Linear
    from tessellm.plugins.quant.kernel_table import KernelChoice

    choice = KernelChoice(quantizer, kernel)
    n, k = weight.shape
    linear = nn.Linear(k, n, bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    if quantizer == "int8-weight":
        return Int8WeightLinear(linear, None, 0, True, choice)
    if quantizer == "w8a8":
        return W8A8Linear(linear, kernel_choice=choice)
    if quantizer == "int4-weight":
        return Int4WeightLinear(quantize_int4(weight, INT4_GROUP), n, None, use_int4pack=False, small_batch_rows=0,
                                kernel_choice=choice)
    return Fp8Linear(*quantize_fp8(weight, "channel"), None, None, kernel_choice=choice)


def layer_bytes(layer: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()] if t is not None)


def time_layers(calls: list, device: torch.device, reps: int) -> float:
    """Median seconds per call of ``calls`` (each a layer's forward, run in turn): CUDA-graph
    replays on a GPU, plain calls on the CPU."""
    for fn in calls:  # builds compiled kernels and layouts, outside the graph
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            for fn in calls:
                fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) / len(calls)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # a warm call on the capture stream (the allocator's pool)
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times) / len(calls)


def shape_points(quantizers: list[str], shape: str, n: int, k: int, rows: list[int], args, device, dtype) -> list[dict]:
    """Every kernel's time per layer at every row count for one [n, k] shape."""
    g = torch.Generator(device="cpu").manual_seed(n * 7 + k)
    base = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype)
    copies = max(1, min(args.max_copies, -(-args.stream_mb * 2**20 // (n * k))))  # int8-sized copies
    weights = [base] + [base.roll(i, dims=1) for i in range(1, copies)]
    points = []
    xs = {m: torch.randn(m, k, generator=g).to(device, dtype) for m in rows}
    bf16 = {}
    for m in rows:
        bf16[m] = time_layers([lambda w=w, x=xs[m]: F.linear(x, w) for w in weights], device, args.reps)
    for quantizer in quantizers:
        for kernel in KERNELS[quantizer]:
            if kernel in COMPILED and (args.smoke or args.no_compiled):
                continue
            try:
                layers = [make_layer(quantizer, kernel, w) for w in weights]
            except Exception as exc:  # noqa: BLE001 - a kernel this device or torch lacks
                points.append({"shape": shape, "n": n, "k": k, "quantizer": quantizer, "kernel": kernel,
                               "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"})
                continue
            for m in rows if kernel not in COMPILED else [r for r in rows if r == 1]:
                point = {"shape": shape, "n": n, "k": k, "quantizer": quantizer, "kernel": kernel, "rows": m,
                         "copies": copies, "bf16_us": round(bf16[m] * 1e6, 2)}
                try:
                    with torch.inference_mode():
                        seconds = time_layers([lambda layer=layer, x=xs[m]: layer(x) for layer in layers], device,
                                              args.reps)
                    point.update(us=round(seconds * 1e6, 2), speedup=round(bf16[m] / seconds, 3),
                                 layer_mb=round(layer_bytes(layers[0]) / 2**20, 2))
                except Exception as exc:  # noqa: BLE001 - recorded, left out of the table
                    point["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                points.append(point)
                print(json.dumps(point), file=sys.stderr, flush=True)
            del layers
    return points


def build_table(points: list[dict], device_name: str, command: str) -> dict:
    """Per quantizer and shape, the fastest kernel at each row count, equal neighbours merged."""
    best: dict[tuple[str, str], dict[int, tuple[float, str]]] = {}
    for p in points:
        if "us" not in p:
            continue
        per_rows = best.setdefault((p["quantizer"], f"{p['n']}x{p['k']}"), {})
        if p["rows"] not in per_rows or p["us"] < per_rows[p["rows"]][0]:
            per_rows[p["rows"]] = (p["us"], p["kernel"])
    kernels: dict[str, dict[str, list]] = {}
    for (quantizer, shape), per_rows in best.items():
        steps: list[list] = []
        for rows in sorted(per_rows):
            kernel = per_rows[rows][1]
            if steps and steps[-1][1] == kernel:
                steps[-1][0] = rows
            else:
                steps.append([rows, kernel])
        kernels.setdefault(quantizer, {})[shape] = steps
    return {"device": device_name, "measured": True, "command": command,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "kernels": kernels}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="every point, as JSON")
    ap.add_argument("--table", help="write the kernel table here (kernel: auto's input)")
    ap.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--quantizers", default=",".join(KERNELS))
    ap.add_argument("--rows", default="1,4,16,64,256,1024")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--stream-mb", type=int, default=192, help="weight bytes each timing streams (past the L2)")
    ap.add_argument("--max-copies", type=int, default=16)
    ap.add_argument("--no-compiled", action="store_true", help="leave the torch.compile'd kernels out")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        ap.error("no GPU: run with --smoke (and TRITON_INTERPRET=1) to check the code path on the CPU")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = SMOKE_SHAPES if args.smoke else {m: SHAPES[m] for m in args.models.split(",")}
    rows = [int(r) for r in args.rows.split(",")] if not args.smoke else [1, 3]
    quantizers = args.quantizers.split(",")
    if args.smoke:
        args.reps, args.stream_mb, args.max_copies = 2, 0, 1
        KERNELS["int4-weight"] = ["triton", "tiled"]  # no tinygemm off CUDA
    command = " ".join(["python", "bench/quant_kernels.py", *(sys.argv[1:] if argv is None else argv)])
    report = {"command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(device) if cuda else "cpu (interpreter)",
              "torch": torch.__version__, "dtype": str(dtype), "int4_group": INT4_GROUP, "points": []}
    for model, layers in shapes.items():
        for shape, (n, k) in layers.items():
            report["points"] += shape_points(quantizers, f"{model}:{shape}", n, k, rows, args, device, dtype)
            if args.out:  # after every shape: a run cut short keeps what it measured
                Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
            if args.table:
                Path(args.table).write_text(json.dumps(build_table(report["points"], report["device"], command),
                                                       indent=1) + "\n")
    errors = [p for p in report["points"] if "error" in p]
    print(json.dumps({"points": len(report["points"]), "errors": len(errors),
                      "table": build_table(report["points"], report["device"], command)["kernels"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
