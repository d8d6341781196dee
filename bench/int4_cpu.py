"""int4-weight on the CPU against float32 and int8-weight: batch-1 decode speed and
perplexity of the embedded SmolLM2 (float32 activations).

Decode: one 9-token prompt, 64 new tokens (``ignore_eos``). Every variant's pipeline is
built and warmed first, then ``--rounds`` rounds each run every variant once, in turn, so a
machine that slows down for a while slows all of them: each variant's median tok/s, and its
ratio to float32 as the median (and range) of the rounds' ratios. Perplexity: the first 1,024
tokens of each bundled text, windows of 512 with stride 256 (tests/plugins/test_int4_quality.py's
cases).

    .venv/bin/python bench/int4_cpu.py [--threads 2] [--rounds 7] [--skip-perplexity] [--prequantized]

``--prequantized`` adds the embedded model saved as a compressed-tensors W4A16 checkpoint
(asymmetric, groups of 32, lm_head float; built in a temporary folder with
compressed-tensors) and read as it is, its stored q/k/v and gate/up stacked at load or,
for comparison, kept apart.

An AVX2-only machine's kernels on an AVX-512 one (torch's own kernels, oneDNN, MKL and the
compiled kernels all limited to AVX2; the memory system stays this machine's):

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        .venv/bin/python bench/int4_cpu.py --skip-perplexity
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

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


def prequantized_variants(folder: str) -> list[tuple[str, dict]]:
    """The W4A16 checkpoint ``folder``, read with its projections stacked and kept apart."""
    return [("W4A16 checkpoint g32", {"model": folder}),
            ("W4A16 checkpoint g32 apart", {"model": folder, "stack": False})]


def build(parts: dict) -> LLM:
    """A pipeline of the embedded model (or ``parts["model"]``); ``stack`` False keeps a
    checkpoint's int4 projections apart (as before they were stacked at load)."""
    from tessellm.plugins.quant.int4.linear import Int4WeightLinear

    parts = {"model": "smollm2-135m", **parts}
    stack = Int4WeightLinear.stack
    if parts.pop("stack", True) is False:
        Int4WeightLinear.stack = None  # fuse_projections finds no way to join them
    try:
        return LLM({"device": "cpu", "dtype": "float32", **parts})
    finally:
        Int4WeightLinear.stack = stack


def decode_seconds(llm) -> float:
    start = time.perf_counter()
    llm.generate(PROMPT, {"max_tokens": 64, "ignore_eos": True})
    return time.perf_counter() - start


def interleaved_rates(llms: dict, rounds: int) -> dict[str, tuple[float, list[float]]]:
    """name -> (median tok/s, each round's ratio to the first variant's time that round)."""
    for llm in llms.values():
        llm.generate(PROMPT, {"max_tokens": 8, "ignore_eos": True})
    times: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(rounds):
        for name, llm in llms.items():
            times[name].append(decode_seconds(llm))
    first = next(iter(times.values()))
    return {name: (64 / statistics.median(ts), [a / b for a, b in zip(first, ts)]) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--skip-perplexity", action="store_true")
    ap.add_argument("--prequantized", action="store_true", help="add a W4A16 checkpoint of the embedded model")
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
    runs = variants()
    if args.prequantized:
        from tessellm.core.model.loader import model_folder, resolve_model
        from tessellm.testing.prequantized import build_compressed_tensors_w4a16

        folder = Path(tempfile.mkdtemp(prefix="smollm2-w4a16-"))
        build_compressed_tensors_w4a16(model_folder(resolve_model("smollm2-135m")), folder, group_size=32,
                                       symmetric=False)
        runs += prequantized_variants(str(folder))
    llms = {name: build(parts) for name, parts in runs}
    for name, (rate, ratios) in interleaved_rates(llms, args.rounds).items():
        line = (f"{name:26s} {rate:6.1f} tok/s ({statistics.median(ratios):.2f}x float32, rounds "
                f"{min(ratios):.2f}-{max(ratios):.2f})")
        if not args.skip_perplexity:
            ppl = {t: perplexity(llms[name], load_text(t)[1], window=512, stride=256, max_tokens=1024).perplexity
                   for t in sorted(BUNDLED)}
            line += "  perplexity " + ", ".join(f"{t} {p:.3f}" for t, p in ppl.items())
        print(line, flush=True)

if __name__ == "__main__":
    main()
