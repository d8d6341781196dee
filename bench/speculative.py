"""Speculative decoding on real prompts: acceptance rate, tokens per target forward and
wall-time speedup over plain decoding, for each proposer on input-grounded prompts
(summaries, code edits, answers from a passage: bench/workloads/grounded.jsonl) and
open-ended ones (bench/workloads/open-ended.jsonl), one stream at a time (latency) and all
requests batched. Every case is one ``tessellm bench --baseline plain`` run, so the plain
side runs on the same requests in the same process; greedy outputs must be identical.

    .venv/bin/python bench/speculative.py                 # every case (about 20 min on 2 CPU cores)
    .venv/bin/python bench/speculative.py --only grounded-ngram-1

Writes bench/results/spec_<case>_<device>_<date>.json per case and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOADS = {"grounded": HERE / "workloads" / "grounded.jsonl", "open-ended": HERE / "workloads" / "open-ended.jsonl"}

# (workload, proposer, max_num_seqs, adaptive_k)
CASES = [
    ("grounded", "ngram", 1, True), ("open-ended", "ngram", 1, True),
    ("grounded", "layer-skip", 1, True), ("open-ended", "layer-skip", 1, True),
    ("grounded", "ngram", 64, True), ("open-ended", "ngram", 64, True),
    ("grounded", "ngram", 1, False), ("open-ended", "ngram", 1, False), ("grounded", "layer-skip", 1, False),
]


def case_name(workload: str, proposer: str, seqs: int, adaptive: bool) -> str:
    return f"{workload}-{proposer}-{seqs}" + ("" if adaptive else "-fixed-k")


def run_case(workload: str, proposer: str, seqs: int, adaptive: bool, k: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "tessellm", "bench", "--workload", str(WORKLOADS[workload]), "--json",
           "--baseline", "plain", "--no-progress",
           "--set", "decoding.name=speculative", "--set", f"decoding.options.proposer={proposer}",
           "--set", f"decoding.options.k={k}", "--set", f"decoding.options.adaptive_k={str(adaptive).lower()}",
           "--set", f"scheduler.options.max_num_seqs={seqs}", *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], help="run only these cases (repeatable)")
    ap.add_argument("--k", type=int, default=4, help="most drafts per step (default 4)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="more --set overrides for both sides")
    args = ap.parse_args()
    extra = [a for kv in args.extra for a in ("--set", kv)]
    rows = []
    day = datetime.date.today().isoformat()
    for case in CASES:
        name = case_name(*case)
        if args.only and name not in args.only:
            continue
        report = run_case(*case, args.k, extra)
        device = "cpu" if report["device"].startswith("cpu") else "gpu"
        (HERE / "results" / f"spec_{name}_{device}_{day}.json").write_text(json.dumps(report, indent=2) + "\n")
        rows.append((name, report))
        print(f"{name}: speedup {report['speedup']}", file=sys.stderr, flush=True)
    print("| case | acceptance | tokens / target forward | tessellm tok/s | plain tok/s | speedup | identical |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        print(f"| {name} | {acc} | {r['tokens_per_forward']:.2f} | {r['output_tokens_per_s']:.1f} | "
              f"{r['baseline']['output_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['identical_outputs']} |")
    if rows:
        print(f"\n{rows[0][1]['device']}, {rows[0][1]['date']}, torch {rows[0][1]['torch']}, k={args.k}")


if __name__ == "__main__":
    main()
