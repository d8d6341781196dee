"""Compile the `flash` kernels for an H100 (sm_90a) on any machine, no GPU needed, and report
what the compiler made of each launch shape: registers per thread, spilled bytes (stack),
shared memory, and the instruction mix (wgmma tensor-core MMAs, TMA bulk copies, cp.async
copies). A shape that spills or exceeds the 227 KB of shared memory is not worth timing; the
GPU sweep (bench/kernels.py --sweep) times the rest.

    python bench/compile_hopper.py [--head-dims 64 128] [--json out.json] [--check]
    python bench/compile_hopper.py --only quant mla decode    # the quantized matmuls, MLA's decode, flash's decode

Groups (``--only``): ``prefill`` and ``decode`` (flash, bf16 and over an int8 cache),
``quest``, ``fused`` (RoPE, RMSNorm, the KV store), ``quant`` (the Triton kernels of
`int8-weight`, `int4-weight`, `w8a8` and `fp8` at 1 to 256 rows of Llama-3.2-1B's down
projection) and ``mla`` (MLA's split-K decode at DeepSeek-V2-Lite's shape). Each row also
counts the PTX's conversion instructions (``cvt``, and ``prmt`` byte shuffles, which is how
Triton turns int8 into bf16), a static measure of a dequantizing loop's work.

It runs the kernels' own Python wrappers on CPU tensors with launching replaced by
recording, compiles each recorded launch with the installed Triton for GPUTarget("cuda",
90, 32), and reads the resource usage from the cubin (Triton's bundled cuobjdump); the
three steps are tessellm.testing.triton_variants' ``recorded_launches``, ``compile_launch``
and ``resources``.
``--check`` compiles a small set and exits non-zero on any failure (the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone

os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels, before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402

from tessellm.core.model import fused_ops  # noqa: E402
from tessellm.plugins.attention.flash import common, decode, prefill, rope_store  # noqa: E402
from tessellm.testing.triton_variants import compile_launch, recorded_launches, resources  # noqa: E402

SMEM_LIMIT = 227 * 1024  # H100: shared memory a block can opt into


def int8_scales(slots: int, heads: int, int8: bool) -> dict:
    """The scale arguments of an int8 cache (empty for a bf16 one)."""
    if not int8:
        return {}
    return {"k_scale": torch.zeros(slots, heads, 1, dtype=torch.float16),
            "v_scale": torch.zeros(slots, heads, 1, dtype=torch.float16)}


def prefill_launches(head_dim: int, shapes: list[tuple[int, int, int, int]], packed: bool, int8: bool = False):
    """One prefill launch per shape: bf16, MHA 2048 wide, one 4k sequence, K/V as views of a
    stacked q/k/v projection (as the engine hands them over); ``int8``: over an int8 cache."""
    heads, n, dt = 2048 // head_dim, 4096, torch.bfloat16
    qkv = torch.zeros(n, 3 * heads * head_dim, dtype=dt)
    q, k, v = (qkv[:, i * heads * head_dim:(i + 1) * heads * head_dim].view(n, heads, head_dim) for i in range(3))
    cache_dt = torch.int8 if int8 else dt
    cache_k, cache_v = torch.zeros(n, heads, head_dim, dtype=cache_dt), torch.zeros(n, heads, head_dim, dtype=cache_dt)
    tables = torch.arange(n // 16, dtype=torch.int32).view(1, -1)
    starts, lens = torch.zeros(1, dtype=torch.int32), torch.full((1,), n, dtype=torch.int32)
    out = torch.empty(n, heads, head_dim, dtype=dt)
    with recorded_launches() as launches:
        for bm, bn, warps, stages in shapes:
            prefill.paged_flash_attention(q.contiguous(), cache_k, cache_v, out, tables, starts, lens, lens, n,
                                     head_dim ** -0.5, 16, config=common.KernelConfig(bm, bn, warps, stages),
                                     k_new=k if packed else None, v_new=v if packed else None,
                                     **int8_scales(n, heads, int8))
    return launches


def decode_launches(int8: bool = False):
    """The split-K decode, single split (direct) and split with its merge, Llama-3.2-1B's shape;
    ``int8``: over an int8 cache."""
    hq, hkv, d, dt = 32, 8, 64, torch.bfloat16
    q = torch.zeros(64, hq, d, dtype=dt)
    cache_dt = torch.int8 if int8 else dt
    cache_k, cache_v = (torch.zeros(64 * 1024, hkv, d, dtype=cache_dt) for _ in range(2))
    tables = torch.arange(64 * 1024 // 16, dtype=torch.int32).view(64, -1)
    rows, lens = torch.arange(64, dtype=torch.int32), torch.full((64,), 1024, dtype=torch.int32)
    out = torch.empty_like(q)
    with recorded_launches() as launches:
        for splits in (1, 4):
            decode.paged_decode_attention(q, cache_k, cache_v, out, rows, tables, lens, 1024, d ** -0.5, 16,
                                      num_splits=splits, config=decode.decode_config(d, torch.device("cuda"), quant=int8),
                                      **int8_scales(64 * 1024, hkv, int8))
        # QUEST's sparse decode: per-KV-head tables of chosen blocks and per-head lengths
        per_head_tables = tables[:, None, :8].expand(64, hkv, 8).contiguous()
        per_head_lens = torch.full((64, hkv), 8 * 16, dtype=torch.int32)
        decode.paged_decode_attention(q, cache_k, cache_v, out, rows, per_head_tables, per_head_lens, 128, d ** -0.5, 16,
                                      num_splits=4, config=decode.decode_config(d, torch.device("cuda"), quant=int8),
                                      **int8_scales(64 * 1024, hkv, int8))
    return launches


def quest_launches():
    """QUEST's page scoring and page tables for 16 decodes at 32k context in pages of 4 (8,192
    pages, blocks of 16), Llama-3.2-1B's heads, a budget of 2,048 tokens (512 pages); and the
    paged cache's key-bounds upkeep of a prompt chunk."""
    from tessellm.plugins.attention.quest import kernels as quest_kernels
    from tessellm.plugins.cache.paged import bounds_kernel

    b, hq, hkv, d, n, page = 16, 32, 8, 64, 8192, 4
    q = torch.zeros(b, hq, d, dtype=torch.bfloat16)
    bounds = torch.zeros(b * n, hkv, d, dtype=torch.bfloat16)
    tables = torch.arange(b * n // 4, dtype=torch.int32).view(b, -1)
    lens = torch.full((b,), page * n, dtype=torch.int32)
    rows = torch.arange(b, dtype=torch.int32)
    cache = torch.zeros(b * n * page, hkv, d, dtype=torch.bfloat16)
    with recorded_launches() as launches:
        quest_kernels.score_pages(q, rows, tables, lens, bounds, bounds, page, 4, n)
        quest_kernels.page_tables(torch.zeros(b, hkv, 511, dtype=torch.long), tables, lens, page, 4)
        bounds_kernel.update_page_bounds(cache, None, torch.arange(1024), bounds, bounds.clone(), page)
    return launches


def fused_launches():
    x, r, w = torch.zeros(256, 2048, dtype=torch.bfloat16), torch.zeros(256, 2048, dtype=torch.bfloat16), torch.ones(2048)
    qk = torch.zeros(256, 48, 64, dtype=torch.bfloat16)
    cos = sin = torch.zeros(256, 64, dtype=torch.bfloat16)
    with recorded_launches() as launches:
        fused_ops.add_rmsnorm(x, r, w.to(torch.bfloat16), 1e-5)
        fused_ops.rotary_(qk[:, :32], cos, sin)
        q, k, v = qk.split([32, 8, 8], dim=1)  # Llama-3.2-1B's heads, views of one QKV output
        cache = torch.zeros(4096, 8, 64, dtype=torch.bfloat16)
        rope_store.rope_store(q, k, v, cos, sin, cache, cache.clone(), torch.arange(256))
        int8 = torch.zeros(4096, 8, 64, dtype=torch.int8)
        rope_store.rope_store(q, k, v, cos, sin, int8, int8.clone(), torch.arange(256), **int8_scales(4096, 8, True))
        fused_ops.silu_mul_packed(torch.zeros(256, 2 * 8192, dtype=torch.bfloat16))
    return launches


def quant_launches(rows: tuple[int, ...] = (1, 16, 64, 256)):
    """The quantized matmuls' Triton kernels at ``rows`` (1, 16, 64, 256) rows of Llama-3.2-1B's down
    projection (2048 x 8192): int8 per channel and in groups of 64, e4m3 per channel, int4 in
    groups of 128 (bf16 activations), and w8a8's quantization and int8 x int8 product."""
    from tessellm.plugins.quant.int4.triton_matmul import triton_int4_weight_matmul
    from tessellm.plugins.quant.int8.triton_matmul import triton_int8_weight_matmul
    from tessellm.plugins.quant.int8.triton_w8a8 import triton_w8a8_matmul

    n, k = 2048, 8192
    q = torch.zeros(n, k, dtype=torch.int8)
    with recorded_launches() as launches:
        for m in rows:
            x = torch.zeros(m, k, dtype=torch.bfloat16)
            triton_int8_weight_matmul(x, q, torch.zeros(n))
            triton_int8_weight_matmul(x, q, torch.zeros(n, k // 64))
            triton_int8_weight_matmul(x, q.view(torch.float8_e4m3fn), torch.zeros(n))
            triton_int4_weight_matmul(x, torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 128),
                                      torch.zeros(n, k // 128), 128)
            triton_w8a8_matmul(x, q, torch.zeros(n))
    return launches


def mla_launches():
    """MLA's split-K decode and merge at DeepSeek-V2-Lite's attention shape (16 heads, latent
    576, rank 512), batch 32 at 4k, in its launch shape (and the merge's)."""
    from tessellm.plugins.attention.mla import decode_kernel

    b, heads, dim, rank = 32, 16, 576, 512
    q = torch.zeros(b, heads, dim, dtype=torch.bfloat16)
    cache = torch.zeros(b * 4096, dim, dtype=torch.bfloat16)
    tables = torch.arange(b * 4096 // 64, dtype=torch.int32).view(b, -1)
    lens = torch.full((b,), 4096, dtype=torch.int32)
    with recorded_launches() as launches:
        for splits in (1, 8):
            decode_kernel.mla_decode(q, cache, tables, lens, 64, rank, 0.1, num_splits=splits,
                                     config=decode_kernel.launch_config(torch.bfloat16, torch.device("cuda")))
    return launches


GROUPS = ("prefill", "decode", "quest", "fused", "quant", "mla")


def describe(kernel, kwargs) -> str:
    keys = ("HEAD_DIM", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP", "num_warps", "num_stages", "PACKED", "DIRECT",
            "QUANT", "FLOAT_WEIGHTS")
    return kernel.fn.__name__ + " " + " ".join(f"{k}={kwargs[k]}" for k in keys if k in kwargs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--json")
    ap.add_argument("--check", action="store_true", help="a small set; exit 1 if any launch fails to compile")
    ap.add_argument("--only", nargs="+", choices=GROUPS, help="compile these groups only (default: all)")
    args = ap.parse_args()
    groups = set(args.only or GROUPS)
    if args.check:
        shapes = [prefill.prefill_config(128, torch.device("cuda")).__dict__]
        shapes = [(s["block_m"], s["block_n"], s["num_warps"], s["num_stages"]) for s in shapes]
        head_dims = [128]
    else:
        shapes = [(bm, bn, w, st) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
        head_dims = args.head_dims
    launches = []
    if "prefill" in groups:
        launches += [launch for d in head_dims for packed in (False, True)
                     for launch in prefill_launches(d, shapes, packed)]
        launches += [launch for d in head_dims for launch in prefill_launches(d, shapes, False, int8=True)]
    launches += (decode_launches() + decode_launches(int8=True)) if "decode" in groups else []
    launches += (quest_launches() if "quest" in groups else []) + (fused_launches() if "fused" in groups else [])
    launches += (quant_launches((1, 64) if args.check else (1, 16, 64, 256)) if "quant" in groups else [])
    launches += mla_launches() if "mla" in groups else []
    rows, failed = [], 0
    for kernel, largs, kwargs in launches:
        row = {"launch": describe(kernel, kwargs)}
        try:
            row.update(resources(compile_launch(kernel, largs, kwargs)))
            row["fits"] = row["stack_bytes"] == 0 and row["shared_bytes"] <= SMEM_LIMIT
        except Exception as exc:  # noqa: BLE001 - reported per launch
            failed += 1
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "bench/compile_hopper.py " + " ".join(sys.argv[1:]), "triton": triton.__version__,
                       "target": "sm_90a", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "launches": rows}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
