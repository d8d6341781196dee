"""Tiered KV cache on a multi-turn chat workload: time to first token and throughput with host
and disk tiers against the device tier alone, and again after a restart with the disk warm.

What it measures: `tessellm bench --workload multi-turn` (conversations replayed turn by turn,
each prompt the whole conversation so far) on the embedded SmolLM2 with the `paged` cache
held to ``--num-blocks`` blocks of 16 tokens, fewer than the conversations' history, so
without tiers most earlier turns are evicted and recomputed. Arms, each a fresh process:

- ``device``: no tiers;
- ``host``: a host tier large enough for every conversation;
- ``host+disk (cold)``: the host tier and an empty disk directory (written as blocks fill);
- ``host+disk (restart)``: the same command again in a new process: the host tier starts
  empty, the disk directory holds the first run's blocks (the warm restart);
- ``disk (restart)``: no host tier, the warm disk alone.

How to run
----------
    python bench/kv_tiers.py --json bench/results/kv_tiers_cpu_DATE.json
    python bench/kv_tiers.py --smoke      # two conversations of two short turns: the code path only
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from tessellm.bench.offline import describe_device


def bench(args: argparse.Namespace, tiers: dict[str, object]) -> dict:
    """One `tessellm bench --json` process; its report."""
    workload = {"turns": args.turns, "system_len": args.system_len, "user_len": args.user_len,
                "reply_len": args.reply_len, "output_len": args.output_len}
    options = {"num_blocks": args.num_blocks, "block_size": 16, **tiers}
    cmd = [sys.executable, "-m", "tessellm", "bench", "--workload", "multi-turn", "--json", "--no-progress",
           "--num-requests", str(args.conversations * args.turns), "--set", "cache.name=paged",
           "--set", "scheduler.name=continuous"]
    for key, value in workload.items():
        cmd += ["--workload-set", f"{key}={value}"]
    for key, value in options.items():
        cmd += ["--set", f"cache.options.{key}={value}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def summary(name: str, report: dict, base: dict | None) -> dict:
    row = {"arm": name, "output_tokens_per_s": report["output_tokens_per_s"], "ttft_ms_mean": report["ttft_ms"]["mean"],
           "ttft_ms_p50": report["ttft_ms"]["p50"], "ttft_ms_p90": report["ttft_ms"]["p90"],
           "prefix_hit_rate": report["prefix_hit_rate"], "elapsed_s": report["elapsed_s"],
           "tiers": report.get("kv_tiers", {})}
    if base is not None:
        row["throughput_vs_device"] = round(report["output_tokens_per_s"] / base["output_tokens_per_s"], 3)
        row["ttft_mean_vs_device"] = round(report["ttft_ms"]["mean"] / base["ttft_ms"]["mean"], 3)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--reply-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=160, help="device blocks of 16 tokens")
    p.add_argument("--host-bytes", type=int, default=2 * 2**30)
    p.add_argument("--disk", type=Path, default=None, help="the disk tier's folder (default: a temporary one)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.smoke:
        args.conversations, args.turns, args.system_len, args.user_len, args.reply_len, args.output_len = 2, 2, 64, 16, 16, 4
        args.num_blocks = 8
    folder = args.disk or Path(tempfile.mkdtemp(prefix="tessellm-kv-tiers-"))
    shutil.rmtree(folder, ignore_errors=True)
    host = {"host_tier_bytes": args.host_bytes}
    disk = {"disk_tier_path": str(folder)}
    arms = [("device", {}), ("host", host), ("host+disk (cold)", {**host, **disk}),
            ("host+disk (restart)", {**host, **disk}), ("disk (restart)", disk)]
    rows, base = [], None
    for name, tiers in arms:
        report = bench(args, tiers)
        base = base or report
        rows.append(summary(name, report, None if report is base else base))
        print(json.dumps(rows[-1]), flush=True)
    if args.disk is None:
        shutil.rmtree(folder, ignore_errors=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": describe_device("cpu"),
              "command": "python " + " ".join(sys.argv), "args": {k: str(v) for k, v in vars(args).items()}, "arms": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
