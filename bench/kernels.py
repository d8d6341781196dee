"""The `flash` plugin's Triton kernels against torch's best, every point in one run.

What it measures (on CUDA, bf16)
--------------------------------
- **Prefill**, causal, TFLOP/s (4 * N^2 * H * D / 2 per sequence, i.e. causal halves the
  work), at sequence 1k, 4k, 16k and head dim 64 and 128 (heads = 2048 / head dim, batch =
  16k / N, as flash-attention's own benchmark), for:
  tessellm `flash` (K/V read from a paged cache, block 16, contiguous tables), torch SDPA
  restricted to its flash backend, to its cuDNN backend, and FlexAttention (torch.compile'd,
  causal block mask).
- **Decode**, GB/s = K and V bytes read / time, at context 1k, 4k, 16k, 32k and batch 1, 16,
  64, with Llama-3.2-1B's attention shape (32 query heads, 8 KV heads, head dim 64), for
  tessellm's split-K paged decode kernel and torch SDPA over contiguous K/V; against the
  copy bandwidth measured in the same run (bytes read + written by a 1 GiB device copy).
- **Correctness** at every point: max |flash - SDPA-math in float32| next to SDPA-flash's own.

How to run
----------
    python bench/kernels.py --out bench/results/kernels_h100.json     # on a GPU (about 5 min)
    TRITON_INTERPRET=1 python bench/kernels.py --smoke                # CPU: tiny shapes, code path only

Targets (issue 4, H100): prefill at or above SDPA-flash and FlexAttention everywhere and at
least 0.8x cuDNN at 4k-16k, head dim 128; decode at least 80% of copy bandwidth for batch >=
16 and context >= 4k. The report prints each ratio; it does not judge them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

from tessellm.plugins.attention.flash_kernels import paged_decode_attention, paged_flash_attention


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=reps * 10, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


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

    def flash():
        paged_flash_attention(qp, kc, vc, out, tables, starts, lens, lens, n, scale, 16, block_m=64 if not smoke else 16,
                              block_n=64 if not smoke else 16)

    runs = {"tessellm_flash": flash}
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
    ref = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), is_causal=True).transpose(1, 2)
    point["flash_max_err"] = float((out.view_as(q).float() - ref).abs().max())
    if "sdpa_flash" in runs:
        point["sdpa_flash_max_err"] = float((runs["sdpa_flash"]().transpose(1, 2).float() - ref).abs().max())
    return point


def decode_point(ctx: int, batch: int, device, dtype, reps: int, smoke: bool) -> dict:
    hq, hkv, d = (32, 8, 64) if not smoke else (4, 2, 16)
    q = torch.randn(batch, hq, d, device=device, dtype=dtype)
    k, v = (torch.randn(batch, ctx, hkv, d, device=device, dtype=dtype) for _ in range(2))
    kc, vc, tables = paged(k, v, 16)
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    scale = d ** -0.5
    nbytes = 2 * batch * ctx * hkv * d * k.element_size()
    qt, kt, vt = q[:, :, None], k.transpose(1, 2), v.transpose(1, 2)
    runs = {"tessellm_decode": lambda: paged_decode_attention(q, kc, vc, out, rows, tables, lens, ctx, scale, 16,
                                                              block_n=64 if not smoke else 16),
            "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)}
    point = {"context": ctx, "batch": batch, "kv_bytes": nbytes}
    for name, fn in runs.items():
        point[f"{name}_gbps"] = round(nbytes / timed(fn, device, reps) / 1e9, 1)
    runs["tessellm_decode"]()
    ref = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), enable_gqa=True)[:, :, 0]
    point["decode_max_err"] = float((out.float() - ref).abs().max())
    return point


def copy_bandwidth(device, reps: int, smoke: bool) -> float:
    src = torch.empty(2**28 if not smoke else 2**20, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return round(2 * src.numel() * 4 / timed(lambda: dst.copy_(src), device, reps) / 1e9, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "kernels.json") if "OUT" in os.environ else None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU under TRITON_INTERPRET=1)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        ap.error("no GPU: run with --smoke (and TRITON_INTERPRET=1) to check the code path on CPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    reps = args.reps if not args.smoke else 2
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
              "torch": torch.__version__, "dtype": str(dtype), "copy_gbps": copy_bandwidth(device, reps, args.smoke)}
    seqs, dims = ([1024, 4096, 16384], [64, 128]) if not args.smoke else ([32, 48], [16])
    report["prefill"] = [prefill_point(n, d, device, dtype, reps, args.smoke) for d in dims for n in seqs]
    ctxs, batches = ([1024, 4096, 16384, 32768], [1, 16, 64]) if not args.smoke else ([48, 112], [1, 3])
    report["decode"] = [decode_point(c, b, device, dtype, reps, args.smoke) for c in ctxs for b in batches]
    for p in report["decode"]:
        p["tessellm_of_copy"] = round(p["tessellm_decode_gbps"] / report["copy_gbps"], 3)
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
