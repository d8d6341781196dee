"""QUEST's sparse decode attention against dense decode attention over the same paged cache,
one layer, one step, every point in one run.

What it measures: the time of one decode step's attention (storing the new token's K/V,
then attending) for a batch of sequences of one context length, Llama-3.2-1B's attention
shape (32 query heads, 8 KV heads, head dim 64), block size 16:

- ``dense``: `sdpa` over the whole context (the reference QUEST falls back to); on CUDA
  also ``flash``, `flash`'s split-K decode over the whole context (``speedup_vs_flash_*``);
- ``quest``: `quest` at each token budget: score every block from its key bounds, take the
  top-K, attend over the chosen blocks only (``--kernel``: on CUDA by default the sparse
  decode runs in `flash`'s split-K Triton kernel over per-head tables of the chosen blocks;
  on a CPU in torch).

The ratio dense / quest is the speedup. Both run on the same storage (float keys, per-block
bounds kept by the `paged` cache's bounded storage), in float32 on a CPU, bf16 on CUDA.

How to run
----------
    OMP_NUM_THREADS=1 python bench/quest.py --contexts 16384 32768 --budgets 2048 --json out.json
    python bench/quest.py --contexts 32768 --budgets 2048 --batch 1      # on a GPU
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from types import SimpleNamespace

import torch

from tessellm.core.interfaces.kv import KVLayout
from tessellm.plugins.attention.quest import QuestAttention, QuestOptions
from tessellm.plugins.attention.sdpa import SdpaAttention, SdpaOptions
from tessellm.plugins.cache.paged.key_bounds import BoundedDenseKVStorage
from tessellm.testing import attention as ref

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 64, 16


def bounded_case(context: int, batch: int, dtype: torch.dtype, device: torch.device, seed: int, page: int = 4):
    """A decode step of ``batch`` sequences of ``context`` tokens, their earlier K/V in a
    bounded paged storage (bounds per ``page`` tokens, computed as the cache keeps them)."""
    case = ref.make_case([context] * batch, [1] * batch, HEADS, KV_HEADS, HEAD_DIM, BLOCK, dtype, seed)
    slots = case.storage.k.shape[0]
    storage = BoundedDenseKVStorage(KVLayout("kv", BLOCK, dtype, frozenset({"key_bounds"}), page), slots, KV_HEADS,
                                    HEAD_DIM, device)
    storage.k.copy_(case.storage.k)
    storage.v.copy_(case.storage.v)
    written = torch.cat([torch.tensor(t, dtype=torch.long)[:, None] * BLOCK + torch.arange(BLOCK)
                         for t in case.batch.block_tables_cpu]).flatten()
    storage.update_bounds(written.to(device))
    return case, storage


def timed(fn, device: torch.device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def point(context: int, batch: int, budgets: list[int], dtype: torch.dtype, device: torch.device, reps: int,
          kernel: str, page: int = 4) -> dict:
    case, storage = bounded_case(context, batch, dtype, device, seed=0, page=page)
    cache = SimpleNamespace(layout=storage.layout)  # what quest's plan reads of the cache: its pages
    q, k, v = (t.to(device) for t in (case.q, case.k_new, case.v_new))
    batch_meta = ref.batch_to(case.batch, device)
    dense = SdpaAttention(SdpaOptions(), ref.model_stub(HEAD_DIM), device, dtype)
    dense_plan = dense.plan(batch_meta, None)
    out = {"context": context, "batch": batch, "kernel": kernel, "page": page,
           "dense_ms": round(1e3 * timed(lambda: dense.forward(5, q, k, v, storage, dense_plan), device, reps), 3)}
    if device.type == "cuda":  # the fast dense decode: flash's split-K kernel over the whole context
        from tessellm.plugins.attention.flash import FlashAttention, FlashOptions

        flash = FlashAttention(FlashOptions(), ref.model_stub(HEAD_DIM), device, dtype)
        flash_plan = flash.plan(batch_meta, None)
        out["flash_ms"] = round(1e3 * timed(lambda: flash.forward(5, q, k, v, storage, flash_plan), device, reps), 3)
    for budget in budgets:
        quest = QuestAttention(QuestOptions(token_budget=budget, dense_layers=0, kernel=kernel),
                               ref.model_stub(HEAD_DIM), device, dtype)
        plan = quest.plan(batch_meta, cache)
        ms = 1e3 * timed(lambda: quest.forward(5, q, k, v, storage, plan), device, reps)
        out[f"quest_{budget}_ms"] = round(ms, 3)
        out[f"speedup_{budget}"] = round(out["dense_ms"] / ms, 2)
        if "flash_ms" in out:
            out[f"speedup_vs_flash_{budget}"] = round(out["flash_ms"] / ms, 2)
        plan_ms = 1e3 * timed(lambda: quest.plan(batch_meta, cache), device, reps)
        out[f"quest_{budget}_plan_ms"] = round(plan_ms, 3)  # host planning per step, shared by all layers
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernel", choices=["auto", "torch", "triton"], default="auto",
                    help="QUEST's sparse decode path (auto: triton on CUDA, torch on a CPU)")
    ap.add_argument("--page", type=int, default=4, help="tokens per key-bounds page (the cache's bounds_page_size)")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = {"command": "python bench/quest.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "threads": torch.get_num_threads(), "dtype": str(dtype), "points": []}
    for context in args.contexts:
        report["points"].append(point(context, args.batch, args.budgets, dtype, device, args.reps, args.kernel,
                                      args.page))
        print(json.dumps(report["points"][-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
