"""The CPU's few-rows products on SmolLM2-135M's layer shapes, one layer at a time: float32
(torch's BLAS) against int4 group 32 through torch's int4 kernel (``int4pack``), the
int8-dot kernel with one and with two activation digits, and the tiled path; the variants
interleaved round by round (a shared machine's slow spells fall on all alike), medians of
each round's median, and ratios to float32.

    .venv/bin/python bench/int8_dot_layers.py [--rows 1] [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
from datetime import datetime, timezone

import torch

from tessellm.core.model.compiled import median_seconds

SHAPES = {"q/k/v fused (576 -> 960)": (960, 576), "gate/up fused (576 -> 3072)": (3072, 576),
          "down (1536 -> 576)": (576, 1536), "lm_head (576 -> 49152)": (49152, 576)}
"""out_features, in_features of SmolLM2-135M's products (hidden 576, 1536 intermediate)."""


def variants(out_features: int, in_features: int, rows: int) -> dict:
    from tessellm.plugins.quant.int4.linear import Int4WeightLinear

    g = torch.Generator().manual_seed(out_features + in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=g) * 0.05)
    x = torch.randn(rows, in_features, generator=g)
    layer = Int4WeightLinear.from_linear(linear, 32, int4pack=True, small_batch_rows=128)

    def dot(digits: int):
        def run():
            layer.dot_digits = digits
            return layer.run("int8-dot", x)
        return run

    return {"float32": lambda: linear(x), "int4pack": lambda: layer.run("int4pack", x),
            "int8-dot 1 digit": dot(1), "int8-dot 2 digits": dot(2), "tiled": lambda: layer.run("tiled", x)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tessellm.bench.offline import cpu_name
    from tessellm.plugins.quant.cpu.build import kernels

    found = kernels()
    print(f"# {datetime.now(timezone.utc).isoformat(timespec='seconds')} {cpu_name()}, {args.threads} threads, "
          f"int8-dot {found.isa if found else 'unavailable'}, {args.rows} rows, {args.rounds} rounds")
    with torch.inference_mode():
        for label, (n, k) in SHAPES.items():
            runs = variants(n, k, args.rows)
            times = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, fn in runs.items():
                    times[name].append(median_seconds(fn, calls=15))
            base = times["float32"]
            cells = [f"{name} {1e6 * statistics.median(ts):.0f} us ({statistics.median([b / t for b, t in zip(base, ts)]):.2f}x)"
                     for name, ts in times.items()]
            print(f"{label:30s} " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
