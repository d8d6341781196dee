"""Tensor and pipeline parallelism: tokens per second at batch 1 and batch N, and (tensor
parallel) the all-reduces per step counted against the arithmetic (2 per layer, each of
[step tokens, hidden] values).

Run it once per rank layout, the same way tessellm runs:

    python bench/tensor_parallel.py --json tp1.json                                    # one rank
    torchrun --nproc-per-node 2 bench/tensor_parallel.py --tensor 2 --json tp2.json    # two tensor ranks
    torchrun --nproc-per-node 2 bench/tensor_parallel.py --pipeline 2 --json pp2.json  # two stages

Each run generates ``--new-tokens`` greedy tokens (EOS ignored) for one request, then for
``--batch`` requests at once, from prompts of ``--prompt-len`` tokens, after a warm-up run.
Reported (rank 0; the other ranks only compute): output tokens/s, mean time per output token,
and per engine step the all-reduces and the bytes each rank put into them, measured and
computed. ``--set KEY=VALUE`` changes the pipeline (default: the embedded model on the CPU in
float32, the paged cache without prefix caching, so every prompt token is computed,
continuous batching).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from datetime import datetime, timezone

from tessellm import LLM
from tessellm.bench.offline import describe_device


def run(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """One timed generation of ``batch`` requests; its throughput and its all-reduces."""
    engine, tp = llm.engine, llm.pipeline.tp
    prompts = [[(17 * i + 5 * j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
    params = {"max_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    steps0, reduces0, bytes0 = engine.stats.steps, tp.reduces if tp else 0, tp.reduced_bytes if tp else 0
    start = time.perf_counter()
    outs = llm.generate(prompts, params, progress=False)
    elapsed = time.perf_counter() - start
    steps = engine.stats.steps - steps0
    spec = llm.pipeline.spec
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    step_tokens = batch * prompt_len + batch * (new_tokens - 1)  # every prompt token and every fed-back token
    itemsize = llm.pipeline.resolved.dtype.itemsize
    point = {"batch": batch, "output_tokens": tokens, "elapsed_s": round(elapsed, 3),
             "output_tokens_per_s": round(tokens / elapsed, 1), "steps": steps,
             "all_reduces_per_step_computed": 2 * spec.num_layers,
             "all_reduce_bytes_computed": 2 * spec.num_layers * step_tokens * spec.hidden_size * itemsize}
    if tp is not None:
        point["all_reduces_per_step_measured"] = round((tp.reduces - reduces0) / steps, 2)
        point["all_reduce_bytes_measured"] = tp.reduced_bytes - bytes0
    return point


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensor", type=int, default=1, help="tensor-parallel ranks (launch that many with torchrun)")
    ap.add_argument("--pipeline", type=int, default=1, help="pipeline stages (torchrun launches tensor x pipeline)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args(argv)
    config = {"device": "cpu", "dtype": "float32",
              "cache": {"name": "paged", "options": {"num_blocks": 2048, "prefix_caching": False}},
              "scheduler": {"name": "continuous"}, "parallel": {"tensor": args.tensor, "pipeline": args.pipeline}}
    llm = LLM(config, overrides=args.overrides)  # on ranks other than 0 this serves rank 0, then exits
    run(llm, 1, args.prompt_len, 4)  # warm-up
    points = [run(llm, b, args.prompt_len, args.new_tokens) for b in (1, args.batch)]
    report = {"command": shlex.join(["python", *sys.argv]) if argv is None else None,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": describe_device(llm.pipeline.resolved.device), "tensor": args.tensor,
              "pipeline": args.pipeline, "microbatches": llm.pipeline.runner.microbatches,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "points": points}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
