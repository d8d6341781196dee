"""Instructions per engine step on the host, counted by valgrind (callgrind): a deterministic
figure for A/B-testing host-side changes, where wall-clock timings of a few percent drown in a
shared machine's noise.

It runs bench/host_overhead.py's whole-step measurement (decode steps of ``--seqs`` sequences
over the paged cache and the continuous scheduler, a stub forward) twice under callgrind, for
``--short`` and ``--long`` steps; the difference over the difference in steps is the count of
one steady-state step (set-up, prefill and warm steps cancel out). Python runs about 50 times
slower under valgrind: each point takes about a minute.

    python bench/host_instructions.py [--seqs 256] [--short 20] [--long 120] [--modes sync async] [--json out.json]

Comparing two commits: run it in each checkout (each with its own venv); the counts of one
commit repeat to well under 0.1%.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_steps(seqs: int, steps: int, mode: str) -> None:
    """The measured program: ``steps`` whole steps after the prompts are prefilled."""
    sys.path.insert(0, str(HERE))
    import host_overhead

    host_overhead.torch.manual_seed(0)
    host_overhead.torch.set_num_threads(1)  # worker threads spin-wait: their count varies run to run
    host_overhead.engine_steps(seqs, 200, steps, mode == "async", freeze=True)


def instructions(seqs: int, steps: int, mode: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        # a fixed hash seed and one thread: string hashing, set order and threads spin-waiting
        # otherwise change the count from run to run
        env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        done = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
                               __file__, "--run", str(seqs), str(steps), mode], capture_output=True, text=True, env=env)
        found = re.search(r"Collected : (\d+)", done.stderr)
        if done.returncode != 0 or found is None:
            raise SystemExit(f"callgrind run failed ({done.returncode}): {done.stderr[-2000:]}")
        return int(found.group(1))


def main() -> None:
    if sys.argv[1:2] == ["--run"]:
        run_steps(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--short", type=int, default=20)
    ap.add_argument("--long", type=int, default=120)
    ap.add_argument("--modes", nargs="+", choices=["sync", "async"], default=["sync", "async"])
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if not 1 <= args.short < args.long or args.seqs < 1:
        ap.error("need 1 <= --short < --long and --seqs >= 1")
    result = {"command": "bench/host_instructions.py " + " ".join(sys.argv[1:]), "python": platform.python_version(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seqs": args.seqs, "per_step": {}}
    for mode in args.modes:
        short, long = instructions(args.seqs, args.short, mode), instructions(args.seqs, args.long, mode)
        per_step = (long - short) / (args.long - args.short)
        result["per_step"][mode] = round(per_step)
        print(f"{mode}: {per_step / 1e6:.2f} M instructions per step at {args.seqs} sequences "
              f"({short} over {args.short} steps, {long} over {args.long})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
