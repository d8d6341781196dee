"""Data parallelism on the CPU with the embedded model (the default config): replicas behind
one router, each replica one torch thread.

What it measures, with ``tessellm bench``'s serving client (src/tessellm/bench/serving.py:
streamed /v1/completions, token-id prompts, ``ignore_eos``):

- (a) throughput: the ``mixed`` workload, all requests at once, through one replica
  (``tessellm serve``, one thread) and through ``tessellm serve --data-parallel 2`` (two
  replicas of one thread each, ``least-load`` routing): output tokens/s and TTFT;
- (b) many tenants: the ``shared-prefix`` workload with ``--tenants`` groups, each a long
  system prompt (``--prefix-len`` tokens) before short questions, interleaved, at a fixed
  concurrency, through two replicas under ``prefix-aware`` and under ``round-robin``
  routing: the replicas' prefix-cache hit rate over the run (from the router's /metrics,
  summed over the ``replica`` label) and TTFT.

Every server is a subprocess started for its measurement and stopped after it; each is warmed
up with a few requests that are not timed. The client runs on the same machine: on two cores
it competes with the replicas, as any client here would.

How to run (from the repository root; on a shared machine take the CPU lock)
----------
    flock -x /tmp/tessellm-cpu.lock .venv/bin/python bench/data_parallel.py
    flock -x /tmp/tessellm-cpu.lock .venv/bin/python bench/data_parallel.py --parts b --tenant-requests 128 \
        --server-set cache.options.num_blocks=300   # more tenants' prompts than a replica's cache holds
    .venv/bin/python bench/data_parallel.py --quick     # a few requests: the code path only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import httpx

from tessellm.bench.offline import cpu_name, summarize
from tessellm.bench.serving import run_serving
from tessellm.bench.workloads import get_workload
from tessellm.core.config import load_config
from tessellm.core.model.loader import load_tokenizer
from tessellm.core.resolve import model_dir_for
from tessellm.testing.serving import ServeProcess

MODEL = "smollm2-135m"
RESULTS = Path(__file__).resolve().parent / "results"


def replicas_healthy(health: dict) -> bool:
    return health.get("status") == "ok" and all(r["healthy"] for r in health.get("replicas", []))


def prefix_counters(url: str) -> tuple[float, float]:
    """(hit tokens, looked-up tokens) of the prefix caches behind ``url``, summed over replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"tessellm_prefix_cache_hit_tokens": 0.0, "tessellm_prefix_cache_queried_tokens": 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals["tessellm_prefix_cache_hit_tokens"], totals["tessellm_prefix_cache_queried_tokens"]


def measure(server_args: list[str], requests: list, warmup: list, concurrency: int | None,
            overrides: list[str] = ()) -> dict:
    """One server's run of ``requests`` after ``warmup``: throughput, TTFT, prefix-cache hits
    (``overrides``: ``--set`` values for its pipeline)."""
    server_args = [*server_args, *(a for o in overrides for a in ("--set", o))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # one torch thread a process
    with ServeProcess(server_args, env=env, ready=replicas_healthy, start_timeout=600) as server:
        run_serving(server.url, warmup, model=MODEL, max_concurrency=concurrency)
        hit0, queried0 = prefix_counters(server.url)
        result = run_serving(server.url, requests, model=MODEL, max_concurrency=concurrency)
        hit1, queried1 = prefix_counters(server.url)
    tokens = sum(t.output_tokens for t in result.requests)
    return {"server": "tessellm serve " + " ".join(server_args), "requests": len(result.requests),
            "elapsed_s": round(result.elapsed_s, 3), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / result.elapsed_s, 3),
            "ttft_ms": summarize([t.ttft_s for t in result.requests]),
            "e2e_ms": summarize([t.e2e_s for t in result.requests]),
            "prefix_cache_hit_rate": round((hit1 - hit0) / (queried1 - queried0), 4) if queried1 > queried0 else None}


def throughput(args: argparse.Namespace, tokenizer: object, max_len: int) -> dict:
    workload = get_workload("mixed", [])
    requests = workload.requests(seed=0, num_requests=args.mixed_requests, tokenizer=tokenizer, max_model_len=max_len)
    warmup = workload.requests(seed=1, num_requests=2, tokenizer=tokenizer, max_model_len=max_len)
    one = measure([], requests, warmup, None, args.server_set)
    two = measure(["--data-parallel", "2", "--policy", "least-load"], requests, warmup, None, args.server_set)
    return {"workload": workload.describe(0, len(requests)), "one_replica": one, "two_replicas": two,
            "speedup": round(two["output_tokens_per_s"] / one["output_tokens_per_s"], 3)}


def tenants(args: argparse.Namespace, tokenizer: object, max_len: int) -> dict:
    overrides = [f"num_groups={args.tenants}", f"prefix_len={args.prefix_len}", "question_len=24",
                 f"output_len={args.tenant_output}"]
    workload = get_workload("shared-prefix", overrides)
    requests = workload.requests(seed=0, num_requests=args.tenant_requests, tokenizer=tokenizer,
                                 max_model_len=max_len)
    warmup = get_workload("mixed", []).requests(seed=1, num_requests=2, tokenizer=tokenizer, max_model_len=max_len)
    out = {"workload": workload.describe(0, len(requests)), "concurrency": args.concurrency}
    for policy in ("prefix-aware", "round-robin"):
        out[policy] = measure(["--data-parallel", "2", "--policy", policy], requests, warmup, args.concurrency,
                              args.server_set)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few requests of each part: the code path only")
    p.add_argument("--mixed-requests", type=int, default=48)
    p.add_argument("--tenants", type=int, default=7,
                   help="tenants (odd: the workload cycles through them, so with an even count round-robin "
                        "over 2 replicas would send each tenant to one replica every time)")
    p.add_argument("--prefix-len", type=int, default=800, help="tokens of each tenant's system prompt")
    p.add_argument("--tenant-requests", type=int, default=64)
    p.add_argument("--tenant-output", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="(b): requests in flight at once")
    p.add_argument("--parts", default="ab", help="which parts to run: a, b or ab (default)")
    p.add_argument("--server-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a pipeline config override for every server (e.g. cache.options.num_blocks=640)")
    p.add_argument("--out", default=None, help="JSON file (default bench/results/data_parallel_cpu_DATE.json)")
    args = p.parse_args()
    if args.quick:
        args.mixed_requests, args.tenant_requests, args.tenants, args.prefix_len = 6, 8, 2, 300
    today = datetime.now(timezone.utc).date().isoformat()
    out = Path(args.out or RESULTS / f"data_parallel_cpu{'_quick' if args.quick else ''}_{today}.json")
    config = load_config(None, [])
    tokenizer = load_tokenizer(model_dir_for(config))
    max_len = 2048
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": cpu_name() or platform.machine(),
              "cores": len(os.sched_getaffinity(0)), "threads_per_replica": 1, "model": MODEL,
              "command": "python bench/data_parallel.py " + " ".join(sys.argv[1:]), "python": platform.python_version()}
    if "a" in args.parts:
        report["throughput"] = throughput(args, tokenizer, max_len)
        t = report["throughput"]
        print(f"(a) mixed, {t['one_replica']['requests']} requests: one replica "
              f"{t['one_replica']['output_tokens_per_s']} tokens/s, two {t['two_replicas']['output_tokens_per_s']} "
              f"tokens/s (x{t['speedup']}); TTFT p50 {t['one_replica']['ttft_ms']['p50']} -> "
              f"{t['two_replicas']['ttft_ms']['p50']} ms", flush=True)
    if "b" in args.parts:
        report["tenants"] = tenants(args, tokenizer, max_len)
        for policy in ("prefix-aware", "round-robin"):
            r = report["tenants"][policy]
            print(f"(b) {policy}: prefix-cache hit rate {r['prefix_cache_hit_rate']}, TTFT p50 {r['ttft_ms']['p50']} "
                  f"ms p90 {r['ttft_ms']['p90']} ms, {r['output_tokens_per_s']} tokens/s", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
