"""Bytes per second the tiered cache moves between the device and host memory, against the
copy bandwidth of one large pinned copy (on a GPU: the PCIe or C2C link).

What it measures: a `paged` cache of Llama-3.1-8B's K/V shape (32 layers, 8 KV heads of dim
128, bfloat16 on CUDA, float32 on a CPU, blocks of 16 tokens: 2 MiB a block on the GPU) with
a host tier. ``write-back``: blocks evicted from the device pool and copied down
(``TierStack.on_device_evict``); ``load``: blocks brought back from the host tier by prefix
lookups (``TierStack.fetch``); each timed over ``--blocks`` blocks with the device
synchronized, the best of three rounds, against one ``--blocks`` x block-size copy each way
between the device and pinned host memory. On a CPU it runs the same code (memory copies): a rehearsal.

How to run
----------
    python bench/kv_tiers_gpu.py --out kv_tiers_gpu.json
    python bench/kv_tiers_gpu.py --blocks 16     # quick (and what a CPU rehearsal uses)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone

import torch

from tessellm.bench.offline import describe_device
from tessellm.core.interfaces.cache import CacheSpec
from tessellm.core.interfaces.kv import KVLayout
from tessellm.plugins.cache.paged import PagedCache, PagedOptions


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def raw_copy(device: torch.device, nbytes: int) -> tuple[float, float]:
    """GB/s of one device-to-host and one host-to-device copy of ``nbytes`` (pinned on CUDA)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    best_down = best_up = float("inf")
    for _ in range(3):
        best_down = min(best_down, timed(device, lambda: host.copy_(src, non_blocking=True)))
        best_up = min(best_up, timed(device, lambda: src.copy_(host, non_blocking=True)))
    return nbytes / best_down / 1e9, nbytes / best_up / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = args.blocks
    spec = CacheSpec(32, 8, 128, dtype, device, 8192)
    options = PagedOptions(block_size=16, num_blocks=n, host_tier_bytes=1)  # sized below
    block_bytes = 32 * 2 * 16 * 8 * 128 * dtype.itemsize
    options = options.model_copy(update={"host_tier_bytes": (n + 1) * block_bytes})
    cache = PagedCache(options, spec, KVLayout("kv", 16, dtype))
    tiers, pool = cache.tiers, cache.pool
    keys = [i.to_bytes(16, "little") for i in range(n)]
    for storage in (cache.layer(i) for i in range(spec.num_layers)):
        storage.k.normal_()
        storage.v.normal_()
    blocks = [pool.allocate() for _ in range(n)]
    for block, key in zip(blocks, keys):
        pool.register(block, key)
        pool.decref(block)  # cached, evictable
    down = up = float("inf")
    for _ in range(3):  # the first round also commits the host arena's pages: the best round counts
        tiers.host.clear()
        down = min(down, timed(device, lambda: [pool.allocate() for _ in range(n)]))  # each evicts: write-back
        for block in range(n):
            pool.decref(block)
        up = min(up, timed(device, lambda: [tiers.fetch(key) for key in keys]))  # each a host hit
        for key in keys:
            pool.decref(pool.lookup(key))
    raw_down, raw_up = raw_copy(device, n * tiers.codec.block_bytes)
    moved = n * tiers.codec.block_bytes
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": describe_device(device),
              "command": "python " + " ".join(sys.argv), "blocks": n, "block_bytes": tiers.codec.block_bytes,
              "write_back_GBps": round(moved / down / 1e9, 3), "load_GBps": round(moved / up / 1e9, 3),
              "raw_copy_down_GBps": round(raw_down, 3), "raw_copy_up_GBps": round(raw_up, 3)}
    result["write_back_vs_raw"] = round(result["write_back_GBps"] / result["raw_copy_down_GBps"], 3)
    result["load_vs_raw"] = round(result["load_GBps"] / result["raw_copy_up_GBps"], 3)
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    cache.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
