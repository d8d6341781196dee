"""Host (Python) time of one engine step's bookkeeping, without a model: scheduling, batch
building, each attention backend's plan, commit and KV accounting, for a decode step of
``--seqs`` sequences of ``--context`` tokens over the paged cache. On a GPU this work sits on
the critical path of every step unless it is overlapped or captured (issue 4).

    .venv/bin/python bench/host_overhead.py --seqs 64 --context 900
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from tessellm.core.batch import build_batch
from tessellm.core.cache import CacheSpec, KVLayout
from tessellm.core.scheduler import SchedulerLimits
from tessellm.core.sequence import SamplingParams, Sequence
from tessellm.plugins.attention.cascade import CascadeAttention, CascadeOptions
from tessellm.plugins.attention.flash import FlashAttention, FlashOptions
from tessellm.plugins.attention.sdpa import SdpaAttention, SdpaOptions
from tessellm.plugins.cache.paged import PagedCache, PagedOptions
from tessellm.plugins.scheduler.continuous import ContinuousOptions, ContinuousScheduler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=900)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    spec = CacheSpec(1, 1, 1, torch.float32, torch.device("cpu"), 8192)
    blocks = args.seqs * (args.context + args.steps + 16) // 16 + 16
    cache = PagedCache(PagedOptions(block_size=16, num_blocks=blocks), spec, KVLayout("kv", 16, torch.float32))
    sched = ContinuousScheduler(ContinuousOptions(max_num_seqs=args.seqs, max_num_batched_tokens=args.seqs * args.context),
                                cache, SchedulerLimits(8192, 0))
    sched.add([Sequence(f"r{i}", list(range(1000 + i, 1000 + i + args.context)), SamplingParams(max_tokens=1000))
               for i in range(args.seqs)])
    stub = SimpleNamespace(attention_scale=0.125, sliding_window=None, head_dim=64)
    backends = [SdpaAttention(SdpaOptions(), stub, torch.device("cpu"), torch.float32),
                CascadeAttention(CascadeOptions(), stub, torch.device("cpu"), torch.float32),
                FlashAttention(FlashOptions(), stub, torch.device("cpu"), torch.float32)]
    totals: dict[str, float] = {}

    def clock(name, fn):
        start = time.perf_counter()
        result = fn()
        totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
        return result

    for step in range(args.steps + 1):
        if step == 1:
            totals.clear()  # step 0 prefills everything
        out = clock("schedule", sched.schedule)
        batch = clock("build_batch", lambda: build_batch(out.scheduled, cache, torch.device("cpu")))
        for b in backends:
            clock(f"{b.name}.plan", lambda: b.plan(batch, cache))

        def commit():
            for item in out.scheduled:
                item.seq.num_computed_tokens += item.num_query_tokens
                item.seq.token_ids.append(5)
                cache.commit(item.seq)
        clock("commit", commit)
        clock("num_used_slots", cache.num_used_slots)
    print(f"host ms per decode step, {args.seqs} sequences of ~{args.context} tokens, mean of {args.steps} steps:")
    for name, total in totals.items():
        print(f"  {name:16s} {total / args.steps * 1000:.3f}")


if __name__ == "__main__":
    main()
