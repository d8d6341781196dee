"""int4-weight on the CPU against float32 and int8-weight: batch-1 decode speed and
perplexity of the embedded SmolLM2 (float32 activations).

Decode: one 9-token prompt, 64 new tokens (``ignore_eos``), best of ``--repeats`` after a
warm-up, in one process, each variant's pipeline built in turn. Perplexity: the first 1,024
tokens of each bundled text, windows of 512 with stride 256 (tests/plugins/test_int4_quality.py's
cases).

    .venv/bin/python bench/int4_cpu.py [--threads 2] [--repeats 3] [--skip-perplexity]

An AVX2-only machine's kernels on an AVX-512 one (torch's own kernels, oneDNN, MKL and the
compiled kernels all limited to AVX2; the memory system stays this machine's):

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        .venv/bin/python bench/int4_cpu.py --skip-perplexity
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from datetime import datetime, timezone

import torch

from tessellm import LLM

PROMPT = [[1, 504, 3458, 314, 260, 1345, 282, 4193, 30]]


def variants() -> list[tuple[str, dict]]:
    int4 = [(f"int4-weight g{g}", {"group_size": g}) for g in (32, 64, 128)]
    int4 += [("int4-weight g32 lm_head", {"group_size": 32, "quantize_lm_head": True})]
    int8 = [("int8-weight", {"quant": {"name": "int8-weight"}}),
            ("int8-weight lm_head", {"quant": {"name": "int8-weight", "options": {"quantize_lm_head": True}}}),
            ("w8a8", {"quant": {"name": "w8a8"}})]
    return [("float32", {})] + int8 + \
        [(name, {"quant": {"name": "int4-weight", "options": options}}) for name, options in int4]


def decode_tok_s(llm, repeats: int) -> float:
    llm.generate(PROMPT, {"max_tokens": 8, "ignore_eos": True})
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(PROMPT, {"max_tokens": 64, "ignore_eos": True})
        best = min(best, time.perf_counter() - start)
    return 64 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-perplexity", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tessellm.eval.perplexity import perplexity
    from tessellm.eval.texts import BUNDLED, load_text

    from tessellm.bench.offline import cpu_name

    isa = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
           if k in os.environ}
    print(f"# {datetime.now(timezone.utc).isoformat(timespec='seconds')} {cpu_name() or platform.machine()}, "
          f"{args.threads} threads, torch {torch.__version__}, torch kernels {torch.backends.cpu.get_cpu_capability()}"
          + (f", instruction sets limited by {isa}" if isa else ""))
    base = None
    for name, parts in variants():
        llm = LLM({"model": "smollm2-135m", "device": "cpu", "dtype": "float32", **parts})
        rate = decode_tok_s(llm, args.repeats)
        base = base or rate
        line = f"{name:26s} {rate:6.1f} tok/s ({rate / base:.2f}x float32)"
        if not args.skip_perplexity:
            ppl = {t: perplexity(llm, load_text(t)[1], window=512, stride=256, max_tokens=1024).perplexity
                   for t in sorted(BUNDLED)}
            line += "  perplexity " + ", ".join(f"{t} {p:.3f}" for t, p in ppl.items())
        print(line, flush=True)
        del llm


if __name__ == "__main__":
    main()
