"""QUEST's sparse decode attention against dense decode attention over the same paged cache,
one layer, one step, every point in one run.

What it measures: the time of one decode step's attention (storing the new token's K/V and
its key bounds, then attending) for a batch of sequences of one context length,
Llama-3.2-1B's attention shape (32 query heads, 8 KV heads, head dim 64), cache blocks of
16, key-bounds pages of ``--pages`` tokens:

- ``dense``: `sdpa` over the whole context (the reference QUEST falls back to); on CUDA
  also ``flash``, `flash`'s split-K decode over the whole context (``speedup_vs_flash_*``);
- ``quest``: `quest` at each token budget (``--kernel``: on CUDA the page scores and page
  tables in Triton, torch's top-K, `flash`'s split-K decode over each KV head's pages; on a
  CPU all in torch), and ``select``, its page scores, top-K and page tables alone.

On CUDA each variant is captured in a CUDA graph and replayed (``--reps`` times, timed with
CUDA events: the kernels alone, as the engine's graphs run them, no host launch cost);
``--eager`` times eager calls instead, as before (mostly host time at these sizes). On a CPU
the median of ``--reps`` wall-clock calls. The ratio dense / quest is the speedup.

How to run
----------
    python bench/quest.py --contexts 32768 131072 --budgets 2048 --json out.json       # on a GPU
    python bench/quest.py --contexts 131072 --pages 2 4 8 16 --budgets 2048           # page sizes
    OMP_NUM_THREADS=2 python bench/quest.py --contexts 16384 32768 --budgets 2048      # a CPU
    OMP_NUM_THREADS=1 python bench/quest.py --prefill 1024 --contexts 8192 16384 --pages 4 16 --reps 20

``--prefill CHUNK`` times instead one layer's prompt chunk (the engine's 1,024 tokens a step by
default) at the end of each context: `sdpa` against `quest`, which runs prompts through `sdpa`
plus the cache's bounds upkeep, alternated call by call (the CPU path: on CUDA the upkeep is
one Triton kernel).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
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
    bounded paged storage on ``device`` (bounds per ``page`` tokens, computed as the cache
    keeps them)."""
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


def timed(fn, device: torch.device, reps: int, graph: bool) -> float:
    """Milliseconds a call of ``fn`` takes: on CUDA with ``graph``, replays of its captured
    graph between CUDA events (the mean of ``reps``); else the median of ``reps`` calls
    (synchronised on CUDA)."""
    if device.type == "cuda" and graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compiles and allocates outside the capture
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def select_only(backend: QuestAttention, plan, q: torch.Tensor, storage) -> None:
    """The sparse layer's page scores, top-K and page tables, without the attention."""
    from tessellm.plugins.attention.quest import kernels, select

    group = plan.groups[0]
    kmin, kmax = storage.key_bounds()
    if group.kernel:
        scores = kernels.score_pages(q, group.rows, group.tables, group.seq_lens, kmin, kmax, group.page,
                                     group.per_block, group.num_cols)
        kernels.page_tables(select.pick_pages(scores, group.num_picks), group.tables, group.seq_lens, group.page,
                            group.per_block)
        return
    pages = group.pages or select.DecodePages.of(group.tables, group.seq_lens, group.page, group.per_block,
                                                 group.num_cols)
    select.decode_page_tables(select.pick_pages(select.decode_page_scores(q, group.rows, pages, kmin, kmax),
                                                group.num_picks), pages)


def point(context: int, batch: int, budgets: list[int], dtype: torch.dtype, device: torch.device, reps: int,
          kernel: str, page: int = 4, graph: bool = True, dense: bool = True) -> dict:
    case, storage = bounded_case(context, batch, dtype, device, seed=0, page=page)
    cache = SimpleNamespace(layout=storage.layout)  # what quest's plan reads of the cache: its pages
    q, k, v = (t.to(device) for t in (case.q, case.k_new, case.v_new))
    batch_meta = ref.batch_to(case.batch, device)
    batch_meta.block_tables = batch_meta.block_tables.to(torch.int32)  # as the engine builds them
    model = SimpleNamespace(**vars(ref.model_stub(HEAD_DIM)), num_kv_heads=KV_HEADS)
    out = {"context": context, "batch": batch, "kernel": kernel, "page": page,
           "timing": "cuda graph replay" if device.type == "cuda" and graph else "wall clock"}
    if dense:
        sdpa = SdpaAttention(SdpaOptions(), model, device, dtype)
        sdpa_plan = sdpa.plan(batch_meta, None)
        out["dense_ms"] = round(timed(lambda: sdpa.forward(5, q, k, v, storage, sdpa_plan), device, reps, False), 4)
    if device.type == "cuda":  # the fast dense decode: flash's split-K kernel over the whole context
        from tessellm.plugins.attention.flash import FlashAttention, FlashOptions

        flash = FlashAttention(FlashOptions(), model, device, dtype)
        flash_plan = flash.graph_plan(batch_meta, None, context) if graph else flash.plan(batch_meta, None)
        out["flash_ms"] = round(timed(lambda: flash.forward(5, q, k, v, storage, flash_plan), device, reps, graph), 4)
    for budget in budgets:
        quest = QuestAttention(QuestOptions(token_budget=budget, dense_layers=0, kernel=kernel), model, device, dtype)
        plan = quest.graph_plan(batch_meta, cache, context) if graph and quest.supports_cuda_graphs \
            else quest.plan(batch_meta, cache)
        ms = timed(lambda: quest.forward(5, q, k, v, storage, plan), device, reps, graph)
        out[f"quest_{budget}_ms"] = round(ms, 4)
        out[f"quest_{budget}_select_ms"] = round(timed(lambda: select_only(quest, plan, q, storage), device, reps,
                                                       graph), 4)
        out[f"quest_{budget}_select_share"] = round(out[f"quest_{budget}_select_ms"] / ms, 3)
        if "dense_ms" in out:
            out[f"speedup_{budget}"] = round(out["dense_ms"] / ms, 2)
        if "flash_ms" in out:
            out[f"speedup_vs_flash_{budget}"] = round(out["flash_ms"] / ms, 2)
        plan_ms = timed(lambda: quest.plan(batch_meta, cache), torch.device("cpu"), reps, False)
        out[f"quest_{budget}_plan_ms"] = round(plan_ms, 4)  # host planning of an eager step, shared by all layers
    return out


def prefill_point(context: int, chunk: int, dtype: torch.dtype, device: torch.device, reps: int, page: int) -> dict:
    """One layer's forward of a prompt chunk of ``chunk`` tokens after ``context - chunk``
    cached ones: `sdpa` against `quest` (whose prompts run `sdpa` plus the cache's bounds
    upkeep), the two alternated call by call; medians and the median of the per-call ratios."""
    case = ref.make_case([context], [chunk], HEADS, KV_HEADS, HEAD_DIM, BLOCK, dtype, seed=0,
                         extras=frozenset({"key_bounds"}), page_size=page)
    layout = KVLayout("kv", BLOCK, dtype, frozenset({"key_bounds"}), page)
    storage = BoundedDenseKVStorage(layout, case.storage.k.shape[0], KV_HEADS, HEAD_DIM, device)
    storage.k.copy_(case.storage.k)
    storage.v.copy_(case.storage.v)
    batch = ref.batch_to(case.batch, device)
    batch.seqs = [SimpleNamespace(num_prompt_tokens=context)]  # a prompt chunk
    q, k, v = (t.to(device) for t in (case.q, case.k_new, case.v_new))
    model = SimpleNamespace(**vars(ref.model_stub(HEAD_DIM)), num_kv_heads=KV_HEADS)
    sdpa = SdpaAttention(SdpaOptions(), model, device, dtype)
    quest = QuestAttention(QuestOptions(dense_layers=0, dense_backend="sdpa", kernel="torch"), model, device, dtype)
    plans = {"sdpa": sdpa.plan(batch, None), "quest": quest.plan(batch, SimpleNamespace(layout=layout))}
    assert not plans["quest"].groups  # a prompt: dense
    times: dict[str, list[float]] = {"sdpa": [], "quest": []}
    for _ in range(reps + 1):
        for name, backend in (("sdpa", sdpa), ("quest", quest)):
            start = time.perf_counter()
            backend.forward(5, q, k, v, storage, plans[name])
            times[name].append(1e3 * (time.perf_counter() - start))
    ratios = [b / a for a, b in zip(times["sdpa"][1:], times["quest"][1:])]
    return {"context": context, "chunk": chunk, "page": page, "timing": "wall clock, alternated",
            "prefill_sdpa_ms": round(statistics.median(times["sdpa"][1:]), 3),
            "prefill_quest_ms": round(statistics.median(times["quest"][1:]), 3),
            "prefill_ratio": round(statistics.median(ratios), 4),
            "prefill_ratio_range": [round(min(ratios), 4), round(max(ratios), 4)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernel", choices=["auto", "torch", "triton"], default="auto",
                    help="QUEST's sparse decode path (auto: triton on CUDA, torch on a CPU)")
    ap.add_argument("--page", "--pages", dest="pages", type=int, nargs="+", default=[4],
                    help="tokens per key-bounds page (the cache's bounds_page_size); several: a point each")
    ap.add_argument("--eager", action="store_true", help="on CUDA, time eager calls, not graph replays")
    ap.add_argument("--no-dense", action="store_true", help="skip `sdpa` (slow at long contexts)")
    ap.add_argument("--prefill", type=int, metavar="CHUNK",
                    help="instead: one layer's prompt chunk of CHUNK tokens at the end of each context, `sdpa` "
                         "against `quest` (the CPU path), alternated")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reps = args.reps if device.type == "cpu" or args.eager else max(args.reps, 50)
    report = {"command": "python bench/quest.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "threads": torch.get_num_threads(), "dtype": str(dtype), "points": []}
    for context in args.contexts:
        for page in args.pages:
            if args.prefill:
                report["points"].append(prefill_point(context, args.prefill, dtype, device, args.reps, page))
                print(json.dumps(report["points"][-1]), flush=True)
                continue
            report["points"].append(point(context, args.batch, args.budgets, dtype, device, reps, args.kernel, page,
                                          not args.eager, not args.no_dense))
            print(json.dumps(report["points"][-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
