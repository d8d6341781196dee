"""Where a CPU batch-1 decode token's time goes, int4-weight (group 32, lm_head too) on the
embedded SmolLM2: the time inside the int4 products, then the time left as parts of the
forward are replaced one after another by what costs (almost) nothing.

Decode: one 9-token prompt, 64 new tokens, median of ``--repeats``, milliseconds a token.
Stages, each keeping the replacements before it (the differences are each part's cost):

1. as it runs; with the time spent in ``Int4WeightLinear.forward`` timed in-process;
2. every int4 product returns a zero tensor of its shape (what is left is the floor);
3. RMSNorm returns its input; 4. RoPE returns its input; 5. the attention backend returns q
(no cache store, gather or SDPA); 6. the MLP returns its input; 7. the attention module
returns its input (what remains: embedding, LM head wrapper, sampling and the engine).

With ``--cpu-compile`` a second pipeline runs the decode step compiled as one graph (the
config's ``cpu_compile``): its time a token, and its floor as that time less the products'
time measured in stage 1 (the same kernels run in both; a compiled graph cannot have its
parts replaced from outside, so the stages run eagerly only).

    .venv/bin/python bench/decode_breakdown.py [--threads 2] [--repeats 7] [--kernel auto|int4pack|int8-dot]
        [--cpu-compile] [--no-stages]

A probe, not a model: stages 2-7 generate meaningless tokens, so only their timings count.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from datetime import datetime, timezone

import torch

from tessellm import LLM

PROMPT = [[1, 504, 3458, 314, 260, 1345, 282, 4193, 30]]


def ms_per_token(llm: LLM, repeats: int) -> float:
    llm.generate(PROMPT, {"max_tokens": 8, "ignore_eos": True})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(PROMPT, {"max_tokens": 64, "ignore_eos": True})
        times.append(time.perf_counter() - start)
    return statistics.median(times) / 64 * 1000


def timed_int4(llm: LLM, repeats: int) -> tuple[float, float]:
    """(ms a token, of which ms inside Int4WeightLinear.forward) for ``llm``."""
    from tessellm.plugins.quant.int4.linear import Int4WeightLinear

    spent = [0.0]
    forward = Int4WeightLinear.forward

    def timed(self, x):
        start = time.perf_counter()
        out = forward(self, x)
        spent[0] += time.perf_counter() - start
        return out

    Int4WeightLinear.forward = timed
    try:
        llm.generate(PROMPT, {"max_tokens": 8, "ignore_eos": True})
        spent[0] = 0.0
        total = ms_per_token(llm, repeats)
        return total, spent[0] / (repeats * 64) * 1000
    finally:
        Int4WeightLinear.forward = forward


def replacements() -> list[tuple[str, object, str, object]]:
    """(stage name, owner, attribute, stand-in) in the order they are applied."""
    import tessellm.core.model.decoder as decoder
    from tessellm.plugins.attention.sdpa import SdpaAttention
    from tessellm.plugins.quant.int4.linear import Int4WeightLinear

    return [
        ("int4 products -> zeros", Int4WeightLinear, "forward",
         lambda self, x: torch.zeros(*x.shape[:-1], self.out_features, dtype=x.dtype)),
        ("RMSNorm -> identity", decoder.RMSNorm, "forward", lambda self, x: x),
        ("RoPE -> identity", decoder, "apply_rotary", lambda x, cos, sin: x),
        ("attention backend -> q", SdpaAttention, "forward", lambda self, layer, q, *args, **kwargs: q),
        ("MLP -> identity", decoder.MLP, "forward", lambda self, x, fused=False: x),
        ("attention module -> identity", decoder.Attention, "forward", lambda self, x, *args, **kwargs: x),
    ]


def pipeline(kernel: str, cpu_compile: bool = False) -> LLM:
    """The embedded SmolLM2, int4-weight group 32 with lm_head on CPU kernel ``kernel``."""
    return LLM({"model": "smollm2-135m", "device": "cpu", "dtype": "float32", "cpu_compile": cpu_compile,
                "quant": {"name": "int4-weight",
                          "options": {"group_size": 32, "quantize_lm_head": True, "cpu_kernel": kernel}}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--kernel", default="auto", help="int4-weight's cpu_kernel")
    ap.add_argument("--cpu-compile", action="store_true", help="also time the decode step compiled")
    ap.add_argument("--no-stages", action="store_true", help="skip the replacement stages")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tessellm.bench.offline import cpu_name

    print(f"# {datetime.now(timezone.utc).isoformat(timespec='seconds')} {cpu_name() or platform.machine()}, "
          f"{args.threads} threads, torch {torch.__version__}, int4-weight cpu_kernel {args.kernel}")
    llm = pipeline(args.kernel)
    kernels = sorted({kernel for m in llm.pipeline.model.modules() for _, kernel in getattr(m, "few_rows", ())})
    total, int4 = timed_int4(llm, args.repeats)
    print(f"{'as it runs':32s} {total:6.2f} ms a token ({int4:.2f} inside the int4 layers: {', '.join(kernels)}; "
          f"floor {total - int4:.2f}, {(total - int4) / total:.0%})", flush=True)
    if args.cpu_compile:
        compiled = pipeline(args.kernel, cpu_compile=True)
        now = ms_per_token(compiled, args.repeats)
        print(f"{'compiled (' + compiled.pipeline.runner.compiled.state + ' kept)':32s} {now:6.2f} ms a token "
              f"(floor {now - int4:.2f}, {(now - int4) / now:.0%}, taking the products' {int4:.2f} from above)",
              flush=True)
        del compiled
    if args.no_stages:
        return
    before = total
    saved = []
    try:
        for name, owner, attr, stand_in in replacements():
            saved.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, stand_in)
            now = ms_per_token(llm, args.repeats)
            print(f"{name:32s} {now:6.2f} ms a token ({before - now:+.2f} saved)", flush=True)
            before = now
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


if __name__ == "__main__":
    main()
