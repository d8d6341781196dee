"""One stream on the CPU against llama.cpp on the same GGUF, in one run: batch-1 decode of the
embedded SmolLM2 (its Q4_1 GGUF), a 9-token prompt then ``--new-tokens`` greedy tokens
(``ignore_eos``), ``--threads`` threads.

Every tessellm variant is built and warmed first, and llama.cpp runs in a process of its own
(``--llamacpp PYTHON``: a Python with llama-cpp-python, built as bench/llamacpp_cpu.py says)
that waits for its turn; then ``--rounds`` rounds each run every variant once, in turn, so a
slow spell of a shared machine slows all of them alike. Printed per variant: the median
tok/s and its range over the rounds, and the median (and range) of the rounds' ratios to
llama.cpp's rate (without ``--llamacpp``: to the first variant's).

    .venv/bin/python bench/cpu_vs_llamacpp.py --llamacpp /tmp/llamacpp/venv/bin/python \\
        [--rounds 7] [--new-tokens 128] [--threads 2] [--only REGEX]

Variants: float32 and int4-weight group 32 with lm_head (torch's int4 kernel, as before the
int8-dot kernel; the int8-dot kernel with two activation digits, the default, and with one,
llama.cpp's arithmetic; what ``auto`` chooses with each), each eager and with
``cpu_compile`` (the decode step compiled as one graph, where measured faster at its first
step: the log says which ran).
"""

from __future__ import annotations

import argparse
import logging
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

PROMPT = [1, 504, 3458, 314, 260, 1345, 282, 4193, 30]  # bench/int4_cpu.py's and llamacpp_cpu.py's


def variants() -> list[tuple[str, dict]]:
    int4 = lambda kernel, digits=2: {"quant": {"name": "int4-weight", "options": {  # noqa: E731
        "group_size": 32, "quantize_lm_head": True, "cpu_kernel": kernel, "int8_dot_digits": digits}}}
    base = [("float32", {}), ("int4 g32 lm_head int4pack", int4("int4pack")),
            ("int4 g32 lm_head int8-dot", int4("int8-dot")), ("int4 g32 lm_head int8-dot 1 digit", int4("int8-dot", 1)),
            ("int4 g32 lm_head auto", int4("auto")), ("int4 g32 lm_head auto 1 digit", int4("auto", 1))]
    return base + [(f"{name} compiled", {**parts, "cpu_compile": True}) for name, parts in base]


def tessellm_round(parts: dict, new_tokens: int) -> Callable[[], float]:
    """A pipeline of ``parts`` (warmed: its first decode steps compile where asked); returns
    a callable that decodes once and gives its seconds."""
    from tessellm import LLM

    llm = LLM({"model": "smollm2-135m", "device": "cpu", "dtype": "float32", **parts})
    params = {"max_tokens": new_tokens, "ignore_eos": True, "temperature": 0.0}
    llm.generate([PROMPT], {**params, "max_tokens": 8})

    def run() -> float:
        start = time.perf_counter()
        llm.generate([PROMPT], params)
        return time.perf_counter() - start

    return run


def llamacpp_round(python: str, gguf: str, threads: int, new_tokens: int) -> Callable[[], float]:
    """llama.cpp in its own process (bench/llamacpp_cpu.py --serve), run once per call."""
    script = Path(__file__).with_name("llamacpp_cpu.py")
    proc = subprocess.Popen([python, str(script), "--gguf", gguf, "--threads", str(threads), "--serve"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    header = proc.stdout.readline().strip()
    print(header, flush=True)

    def run() -> float:
        proc.stdin.write(f"{new_tokens}\n")
        proc.stdin.flush()
        return float(proc.stdout.readline())

    return run


def interleaved(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each variant's run, round by round, the variants in turn within a round."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(run())
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llamacpp", help="a Python with llama-cpp-python (its own venv)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--only", help="run only the variants whose name matches this regular expression")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="# %(name)s: %(message)s")
    for chooser in ("tessellm.core.model.compiled", "tessellm.plugins.quant.cpu.choice"):
        logging.getLogger(chooser).setLevel(logging.INFO)  # what was chosen at load, and why
    from tessellm.bench.offline import cpu_name
    from tessellm.core.model.loader import resolve_model
    from tessellm.plugins.quant.cpu.build import kernels

    found = kernels()
    print(f"# {datetime.now(timezone.utc).isoformat(timespec='seconds')} {cpu_name()}, {args.threads} threads, "
          f"torch {torch.__version__} (kernels {torch.backends.cpu.get_cpu_capability()}), int8-dot "
          f"{found.isa if found else 'unavailable'}, {args.new_tokens} new tokens, {args.rounds} rounds", flush=True)
    chosen = [(n, p) for n, p in variants() if not args.only or re.search(args.only, n)]
    runs = {name: tessellm_round(parts, args.new_tokens) for name, parts in chosen}
    if args.llamacpp:
        runs["llama.cpp Q4_1"] = llamacpp_round(args.llamacpp, str(resolve_model("smollm2-135m")), args.threads,
                                                args.new_tokens)
    times = interleaved(runs, args.rounds)
    yardstick = times["llama.cpp Q4_1"] if args.llamacpp else next(iter(times.values()))
    against = "llama.cpp" if args.llamacpp else next(iter(times))
    for name, ts in times.items():
        rates = [args.new_tokens / t for t in ts]
        ratios = [y / t for y, t in zip(yardstick, ts)]
        print(f"{name:36s} {statistics.median(rates):6.1f} tok/s ({min(rates):.1f}-{max(rates):.1f})  "
              f"{statistics.median(ratios):.2f}x {against} (rounds {min(ratios):.2f}-{max(ratios):.2f})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
