"""The `flash` plugin's Triton kernels against torch's best, every point in one run.

What it measures (on CUDA, bf16)
--------------------------------
- **Prefill**, causal, TFLOP/s (4 * N^2 * H * D / 2 per sequence, i.e. causal halves the
  work), at sequence 1k, 4k, 16k and head dim 64 and 128 (heads = 2048 / head dim, batch =
  16k / N, as flash-attention's own benchmark), for:
  tessellm `flash` (K/V read from a paged cache, block 16, contiguous tables), the same
  kernel with the prompt's own K/V read as packed rows through TMA descriptors
  (`tessellm_flash_packed`, `FlashOptions.packed_prefill`), torch SDPA restricted to its
  flash backend, to its cuDNN backend, and FlexAttention (torch.compile'd, causal block
  mask).
- **Decode**, GB/s = K and V bytes read / time, at context 1k, 4k, 16k, 32k and batch 1, 16,
  64, with Llama-3.2-1B's attention shape (32 query heads, 8 KV heads, head dim 64), for
  tessellm's split-K paged decode kernel and torch SDPA over contiguous K/V; against the
  copy bandwidth measured in the same run (bytes read + written by a 1 GiB device copy).
  Timed as CUDA-graph replays (``*_gbps``, how the engine runs decode steps) and as eager
  launches (``*_eager_gbps``, where small points measure the host's launch overhead).
- **int8 K/V decode**: the same decode kernel over the `paged` cache's ``kv_dtype: int8``
  storage (int8 values and a float16 scale per token and head, dequantized in the kernel):
  GB/s of the int8 bytes read, microseconds per call and ``int8_speedup`` (bf16 time / int8
  time) at every decode point.
- **Correctness** at every point: max |flash - SDPA-math in float32| next to SDPA-flash's own.

How to run
----------
    python bench/kernels.py --out bench/results/kernels_h100.json     # on a GPU (about 5 min)
    python bench/kernels.py --sweep --out sweep.json                  # on a GPU: launch-shape search
    python bench/kernels.py --sweep-int8 --out kv_int8.json           # on a GPU: int8 K/V decode's shapes
    TRITON_INTERPRET=1 python bench/kernels.py --smoke                # CPU: tiny shapes, code path only

``--sweep`` times the flash kernels alone over tile sizes, warps, pipeline stages, the prefill's
K/V source (block table or packed rows) and (decode)
the number of programs split-K aims for, at a few representative points; its best shapes are
what ``prefill_config`` (flash/prefill.py), ``decode_config`` and ``DECODE_PROGRAMS`` (flash/decode.py) hold.

``--sweep-int8`` times the split-K decode over an int8 cache at batch 16, 32 and 64 and
contexts 4k and 16k (Llama-3.2-1B's attention shape) for a few launch shapes, the default
(``decode_config(quant=True)``) first, beside bf16's default at the same point: the int8
row's ``vs_bf16`` is bf16's time over its own (issue 59's target: at least 1.0), its
``int8_gbps`` the int8 bytes (values and scales) read per second.

Targets (issue 4, H100): prefill at or above SDPA-flash and FlexAttention everywhere and at
least 0.8x cuDNN at 4k-16k, head dim 128; decode at least 80% of copy bandwidth for batch >=
16 and context >= 4k. The report prints each ratio; it does not judge them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

from tessellm.core.model.compiled import median_seconds
from tessellm.plugins.attention.flash.common import KernelConfig
from tessellm.plugins.attention.flash.decode import default_num_splits, paged_decode_attention
from tessellm.plugins.attention.flash.prefill import paged_flash_attention
from tessellm.plugins.cache.paged.int8_kv import quantize_heads


def timed(fn, device: torch.device, reps: int, warmup_ms: int = 25) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup_ms, rep=reps * 10, return_mode="median") / 1e3
    return median_seconds(fn, calls=reps)


def timed_graph(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn()`` replayed from a CUDA graph: small decode launches are
    otherwise timed as the host's launch overhead, and the engine replays decode steps from
    graphs too. Falls back to ``timed`` off CUDA."""
    if device.type != "cuda":
        return timed(fn, device, reps)
    from triton.testing import do_bench_cudagraph

    # do_bench_cudagraph runs fn on a side stream that does not wait for the default one: the
    # inputs just built there (block tables, caches) may still be in flight. Unsynchronised,
    # larger points read unwritten block tables (illegal address, H100 2026-11-23).
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=reps * 10, return_mode="median") / 1e3


EAGER_ONLY = False  # --eager-only: no CUDA-graph timing at all


def paged(k: torch.Tensor, v: torch.Tensor, block: int):
    """[B, N, H, D] K/V as a paged cache [B*N, H, D] with contiguous block tables [B, N/block]."""
    b, n, h, d = k.shape
    tables = torch.arange(b * n // block, dtype=torch.int32, device=k.device).view(b, n // block)
    return k.reshape(b * n, h, d), v.reshape(b * n, h, d), tables


def prefill_point(n: int, head_dim: int, device, dtype, reps: int, smoke: bool) -> dict:
    heads = 2048 // head_dim if not smoke else 2
    batch = max(1, 16384 // n) if not smoke else 1
    q, k, v = (torch.randn(batch, n, heads, head_dim, device=device, dtype=dtype) for _ in range(3))
    kc, vc, tables = paged(k, v, 16)
    qp = q.reshape(batch * n, heads, head_dim)
    starts = torch.arange(0, batch * n, n, dtype=torch.int32, device=device)
    lens = torch.full((batch,), n, dtype=torch.int32, device=device)
    out = torch.empty_like(qp)
    scale = head_dim ** -0.5
    flops = 4 * batch * heads * n * n * head_dim / 2
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def flash(packed: bool = False, dest: torch.Tensor = out):
        # packed: the prompt's own K/V rows read through TMA descriptors (FlashOptions.packed_prefill)
        paged_flash_attention(qp, kc, vc, dest, tables, starts, lens, lens, n, scale, 16,
                              block_m=16 if smoke else None, block_n=16 if smoke else None,
                              k_new=kc if packed else None, v_new=vc if packed else None)

    out_packed = torch.empty_like(qp)
    runs = {"tessellm_flash": flash, "tessellm_flash_packed": lambda: flash(True, out_packed)}
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def backend(which):
            def run():
                with sdpa_kernel(which):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            return run

        runs["sdpa_flash"] = backend(SDPBackend.FLASH_ATTENTION)
        runs["sdpa_cudnn"] = backend(SDPBackend.CUDNN_ATTENTION)
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n, device=device)
        flex = torch.compile(flex_attention)
        runs["flex_attention"] = lambda: flex(qt, kt, vt, block_mask=mask)
    point = {"seq_len": n, "head_dim": head_dim, "heads": heads, "batch": batch}
    for name, fn in runs.items():
        try:
            point[f"{name}_tflops"] = round(flops / timed(fn, device, reps) / 1e12, 2)
        except Exception as exc:  # a backend this GPU or build lacks: record why, keep going
            point[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:200]
    flash()
    flash(True, out_packed)
    ref = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), is_causal=True).transpose(1, 2)
    point["flash_max_err"] = float((out.view_as(q).float() - ref).abs().max())
    point["flash_packed_max_err"] = float((out_packed.view_as(q).float() - ref).abs().max())
    if "sdpa_flash" in runs:
        point["sdpa_flash_max_err"] = float((runs["sdpa_flash"]().transpose(1, 2).float() - ref).abs().max())
    return point


def decode_point(ctx: int, batch: int, device, dtype, reps: int, smoke: bool,
                 config: KernelConfig | None = None, graph_sdpa: bool = True) -> dict:
    hq, hkv, d = (32, 8, 64) if not smoke else (4, 2, 16)
    q = torch.randn(batch, hq, d, device=device, dtype=dtype)
    k, v = (torch.randn(batch, ctx, hkv, d, device=device, dtype=dtype) for _ in range(2))
    kc, vc, tables = paged(k, v, 16)
    (kq, ks), (vq, vs) = quantize_heads(kc), quantize_heads(vc)  # the int8 cache (kv_dtype: int8)
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    out, out_int8 = torch.empty_like(q), torch.empty_like(q)
    scale = d ** -0.5
    nbytes = 2 * batch * ctx * hkv * d * k.element_size()
    qt, kt, vt = q[:, :, None], k.transpose(1, 2), v.transpose(1, 2)
    runs = {"tessellm_decode": lambda: paged_decode_attention(q, kc, vc, out, rows, tables, lens, ctx, scale, 16,
                                                              block_n=16 if smoke else None, config=config),
            "tessellm_decode_int8": lambda: paged_decode_attention(
                q, kq, vq, out_int8, rows, tables, lens, ctx, scale, 16, block_n=16 if smoke else None, config=config,
                k_scale=ks, v_scale=vs),
            "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)}
    run_bytes = {"tessellm_decode_int8": 2 * batch * ctx * hkv * (d * kq.element_size() + ks.element_size())}
    point = {"context": ctx, "batch": batch, "kv_bytes": nbytes, "kv_bytes_int8": run_bytes["tessellm_decode_int8"]}
    for name, fn in runs.items():
        if (name.startswith("tessellm_decode") or graph_sdpa) and not EAGER_ONLY:
            seconds = timed_graph(fn, device, reps)
            point[f"{name}_gbps"] = round(run_bytes.get(name, nbytes) / seconds / 1e9, 1)
            point[f"{name}_us"] = round(seconds * 1e6, 2)
        seconds = timed(fn, device, reps)
        point[f"{name}_eager_gbps"] = round(run_bytes.get(name, nbytes) / seconds / 1e9, 1)
        point[f"{name}_eager_us"] = round(seconds * 1e6, 2)
    key = "_us" if not EAGER_ONLY else "_eager_us"
    point["int8_speedup"] = round(point[f"tessellm_decode{key}"] / point[f"tessellm_decode_int8{key}"], 3)
    runs["tessellm_decode"]()
    runs["tessellm_decode_int8"]()
    ref = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), enable_gqa=True)[:, :, 0]
    point["decode_max_err"] = float((out.float() - ref).abs().max())
    point["decode_int8_max_err"] = float((out_int8.float() - ref).abs().max())  # includes the quantization error
    return point


def sweep(device, dtype, smoke: bool) -> dict:
    """Time the flash kernels alone over launch shapes; the best per point, and every row."""
    import itertools

    reps = 3 if device.type == "cuda" else 1
    found: dict = {"prefill": [], "decode": [], "splits": []}
    # prefill: 4k tokens (4 sequences of 4k at 2048 / D heads, as the benchmark) per head dim
    for d in ([64, 128] if not smoke else [16]):
        n, heads, batch = (4096, 2048 // d, 4) if not smoke else (48, 2, 1)
        q, k, v = (torch.randn(batch * n, heads, d, device=device, dtype=dtype) for _ in range(3))
        tables = torch.arange(batch * n // 16, dtype=torch.int32, device=device).view(batch, -1)
        starts = torch.arange(0, batch * n, n, dtype=torch.int32, device=device)
        lens = torch.full((batch,), n, dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        flops = 4 * batch * heads * n * n * d / 2
        shapes = itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3, 4], [False, True]) if not smoke \
            else [(16, 16, 4, 1, False), (16, 16, 4, 1, True)]
        for bm, bn, warps, stages, packed in shapes:  # packed: the prompt's K/V through TMA descriptors
            cfg = KernelConfig(bm, bn, warps, stages)
            row = {"head_dim": d, "seq_len": n, **cfg.__dict__, "packed": packed}
            try:
                row["tflops"] = round(flops / timed(lambda: paged_flash_attention(
                    q, k, v, out, tables, starts, lens, lens, n, d ** -0.5, 16, config=cfg,
                    k_new=k if packed else None, v_new=v if packed else None), device, reps, 5) / 1e12, 1)
            except Exception as exc:  # e.g. out of shared memory: that shape is not an option
                row["error"] = f"{type(exc).__name__}: {exc}"[:120]
            found["prefill"].append(row)
            print("prefill", row, flush=True)
    # decode: Llama-3.2-1B's attention shape (32 query heads, 8 KV heads, head dim 64)
    hq, hkv, d = (32, 8, 64) if not smoke else (4, 2, 16)

    def decode_inputs(batch, ctx):
        q = torch.randn(batch, hq, d, device=device, dtype=dtype)
        k, v = (torch.randn(batch * ctx, hkv, d, device=device, dtype=dtype) for _ in range(2))
        tables = torch.arange(batch * ctx // 16, dtype=torch.int32, device=device).view(batch, -1)
        rows = torch.arange(batch, dtype=torch.int32, device=device)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        return q, k, v, tables, rows, lens, 2 * batch * ctx * hkv * d * k.element_size()

    points = [(16, 4096), (64, 16384)] if not smoke else [(3, 112)]
    shapes = list(itertools.product([32, 64, 128], [2, 4, 8], [1, 2, 3, 4])) if not smoke else [(16, 4, 1)]
    for batch, ctx in points:
        q, k, v, tables, rows, lens, nbytes = decode_inputs(batch, ctx)
        out = torch.empty_like(q)
        for bn, warps, stages in shapes:
            cfg = KernelConfig(16, bn, warps, stages)
            row = {"batch": batch, "context": ctx, **cfg.__dict__}
            try:
                row["gbps"] = round(nbytes / timed_graph(lambda: paged_decode_attention(
                    q, k, v, out, rows, tables, lens, ctx, d ** -0.5, 16, config=cfg), device, reps) / 1e9, 1)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:120]
            found["decode"].append(row)
            print("decode", row, flush=True)
    ok = [r for r in found["decode"] if "gbps" in r]
    best = {}
    for r in ok:  # the shape with the best worst-case over the points
        key = (r["block_n"], r["num_warps"], r["num_stages"])
        best[key] = min(best.get(key, float("inf")), r["gbps"])
    bn, warps, stages = max(best, key=best.get) if best else (16, 4, 1)
    cfg = KernelConfig(16, bn, warps, stages)
    for batch, ctx in ([(1, 4096), (1, 16384), (16, 4096), (16, 16384), (64, 4096), (64, 16384)]
                       if not smoke else [(1, 112), (3, 112)]):
        q, k, v, tables, rows, lens, nbytes = decode_inputs(batch, ctx)
        out = torch.empty_like(q)
        for target in ([128, 256, 512, 1024, 2048] if not smoke else [8, 64]):
            splits = default_num_splits(batch, hkv, ctx, bn, target)
            row = {"batch": batch, "context": ctx, "target_programs": target, "splits": splits,
                   "gbps": round(nbytes / timed_graph(lambda: paged_decode_attention(
                       q, k, v, out, rows, tables, lens, ctx, d ** -0.5, 16, num_splits=splits, config=cfg),
                       device, reps) / 1e9, 1)}
            found["splits"].append(row)
            print("splits", row, flush=True)
    ranked = {}
    for d in {r["head_dim"] for r in found["prefill"]}:
        for packed in (False, True):
            rows_d = [r for r in found["prefill"] if r["head_dim"] == d and r["packed"] == packed and "tflops" in r]
            ranked[f"prefill_d{d}" + ("_packed" if packed else "")] = sorted(rows_d, key=lambda r: -r["tflops"])[:3]
    ranked["decode"] = sorted(ok, key=lambda r: -best[(r["block_n"], r["num_warps"], r["num_stages"])])[:3]
    found["best"] = ranked
    return found


INT8_SHAPES = [None, (64, 2, 4), (64, 4, 3), (128, 4, 2), (128, 8, 3), (256, 8, 2)]
"""Launch shapes (keys a tile, warps, stages) ``--sweep-int8`` times; None: the default."""


def sweep_int8(device, dtype, smoke: bool, reps: int) -> dict:
    """int8 K/V decode against bf16's at batch 16-64, contexts 4k and 16k, over launch shapes."""
    from tessellm.plugins.attention.flash.decode import decode_config

    hq, hkv, d = (32, 8, 64) if not smoke else (4, 2, 16)
    points = [(b, c) for c in (4096, 16384) for b in (16, 32, 64)] if not smoke else [(2, 64)]
    rows = []
    for batch, ctx in points:
        q = torch.randn(batch, hq, d, device=device, dtype=dtype)
        k, v = (torch.randn(batch * ctx, hkv, d, device=device, dtype=dtype) for _ in range(2))
        tables = torch.arange(batch * ctx // 16, dtype=torch.int32, device=device).view(batch, -1)
        rows_idx = torch.arange(batch, dtype=torch.int32, device=device)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        (kq, ks), (vq, vs) = quantize_heads(k), quantize_heads(v)
        out = torch.empty_like(q)
        bf16 = timed_graph(lambda: paged_decode_attention(q, k, v, out, rows_idx, tables, lens, ctx, d ** -0.5, 16,
                                                          block_n=16 if smoke else None), device, reps)
        int8_bytes = 2 * batch * ctx * hkv * (d + ks.element_size())
        for shape in INT8_SHAPES if not smoke else [None]:
            cfg = decode_config(d, device, quant=True) if shape is None else KernelConfig(16, *shape)
            row = {"batch": batch, "context": ctx, "default": shape is None, **cfg.__dict__,
                   "bf16_us": round(bf16 * 1e6, 2)}
            try:
                t = timed_graph(lambda: paged_decode_attention(q, kq, vq, out, rows_idx, tables, lens, ctx, d ** -0.5,
                                                               16, config=cfg if not smoke else None,
                                                               block_n=16 if smoke else None, k_scale=ks, v_scale=vs),
                                device, reps)
                row.update(int8_us=round(t * 1e6, 2), vs_bf16=round(bf16 / t, 3),
                           int8_gbps=round(int8_bytes / t / 1e9, 1))
            except Exception as exc:  # noqa: BLE001 - a shape that does not fit
                row["error"] = f"{type(exc).__name__}: {exc}"[:120]
            rows.append(row)
            print("int8", json.dumps(row), flush=True)
    worst = {}
    for r in rows:
        if "vs_bf16" in r:
            key = (r["block_n"], r["num_warps"], r["num_stages"])
            worst[key] = min(worst.get(key, float("inf")), r["vs_bf16"])
    best = max(worst, key=worst.get) if worst else None
    return {"int8_decode": rows, "best_worst_case": None if best is None else
            {"block_n": best[0], "num_warps": best[1], "num_stages": best[2], "min_vs_bf16": worst[best]}}


def copy_bandwidth(device, reps: int, smoke: bool) -> float:
    src = torch.empty(2**28 if not smoke else 2**20, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return round(2 * src.numel() * 4 / timed(lambda: dst.copy_(src), device, reps) / 1e9, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "kernels.json") if "OUT" in os.environ else None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU under TRITON_INTERPRET=1)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="search the kernels' launch shapes instead")
    ap.add_argument("--sweep-int8", action="store_true", help="the int8 K/V decode's launch shapes against bf16")
    ap.add_argument("--only", choices=["prefill", "decode"], help="measure one half")
    ap.add_argument("--min-context", type=int, default=0, help="decode points from this context on")
    ap.add_argument("--no-graph-sdpa", action="store_true",
                    help="time SDPA decode eagerly only (on an H100 with torch 2.11 its CUDA-graph capture "
                         "hit an illegal memory access at batch 64, context 16k)")
    ap.add_argument("--eager-only", action="store_true", help="time decode points with eager launches only")
    args = ap.parse_args(argv)
    global EAGER_ONLY
    EAGER_ONLY = args.eager_only
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        ap.error("no GPU: run with --smoke (and TRITON_INTERPRET=1) to check the code path on CPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    reps = args.reps if not args.smoke else 2
    if args.sweep_int8:
        report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
                  "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
                  "copy_gbps": copy_bandwidth(device, reps, args.smoke), **sweep_int8(device, dtype, args.smoke, reps)}
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["best_worst_case"]))
        return 0
    if args.sweep:
        report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
                  "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
                  **sweep(device, dtype, args.smoke)}
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["best"], indent=1))
        return 0
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
              "torch": torch.__version__, "dtype": str(dtype), "copy_gbps": copy_bandwidth(device, reps, args.smoke)}

    def save() -> None:  # after every point: a run cut short keeps what it measured
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps(report, indent=2) + "\n")

    ctxs, batches = ([1024, 4096, 16384, 32768], [1, 16, 64]) if not args.smoke else ([48, 112], [1, 3])
    report["decode"] = []
    for c in ctxs if args.only != "prefill" else []:
        if c < args.min_context:
            continue
        for b in batches:
            point = decode_point(c, b, device, dtype, reps, args.smoke, graph_sdpa=not args.no_graph_sdpa)
            best = point.get("tessellm_decode_gbps", point["tessellm_decode_eager_gbps"])
            point["tessellm_of_copy"] = round(best / report["copy_gbps"], 3)
            report["decode"].append(point)
            save()
    # the engine's own decode shape (hundreds of short sequences): pipeline depth vs occupancy
    report["decode_engine_batch"] = []
    for c in ([256, 1024] if not args.smoke else [48]) if args.only != "prefill" else []:
        for stages in (2, 4):
            cfg = KernelConfig(16, 64 if not args.smoke else 16, 2, stages)
            point = decode_point(c, 256 if not args.smoke else 3, device, dtype, reps, args.smoke, cfg,
                                 graph_sdpa=not args.no_graph_sdpa)
            report["decode_engine_batch"].append({**point, "num_stages": stages})
            save()
    seqs, dims = ([1024, 4096, 16384], [64, 128]) if not args.smoke else ([32, 48], [16])
    report["prefill"] = []
    for d in dims if args.only != "decode" else []:
        for n in seqs:
            report["prefill"].append(prefill_point(n, d, device, dtype, reps, args.smoke))
            save()
    save()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
