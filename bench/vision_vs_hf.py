"""Vision-language throughput against transformers' generate on the same requests, on a tiny
random Qwen2-VL made with transformers' own classes (nothing is downloaded): ``tessellm bench
--workload vision`` on it, or on a checkpoint folder given with ``--model``.

The tiny checkpoint (``build_tiny_qwen2_vl``: a 2-layer decoder of width 64, a 2-block vision
tower, images of 56 to 112 pixels a side, 4 to 16 image tokens each) measures the per-request
and per-step overheads of both sides, not a real model's arithmetic. The figures are ratios of
interleaved rounds in one process.

How to run
----------
    python bench/vision_vs_hf.py --num-requests 32 --rounds 5
    python bench/vision_vs_hf.py --model /models/Qwen2-VL-2B-Instruct --num-requests 16
    python bench/vision_vs_hf.py --smoke      # few requests: the code path only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a vision checkpoint folder (default: the tiny random one)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--images-per-request", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8, help="transformers' batch size")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="few requests and tokens: the code path only")
    args = parser.parse_args()
    from tessellm.cli import main as tessellm_main
    from tessellm.testing.models import build_tiny_qwen2_vl

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or build_tiny_qwen2_vl(Path(tmp) / "qwen2_vl")
        argv = ["bench", "--workload", "vision", "--set", f"model={folder}", "--set", "dtype=float32",
                "--num-requests", str(3 if args.smoke else args.num_requests),
                "--workload-set", f"rounds={1 if args.smoke else args.rounds}",
                "--workload-set", f"max_tokens={2 if args.smoke else args.max_tokens}",
                "--workload-set", f"images_per_request={args.images_per_request}",
                "--workload-set", f"batch_size={args.batch_size}", "--no-progress"]
        return tessellm_main(argv + (["--json"] if args.json else []))


if __name__ == "__main__":
    sys.exit(main())
