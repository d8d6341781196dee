"""KV-cache memory figures: waste and the batch a fixed budget reaches, paged vs contiguous;
and the memory parallel sampling (n > 1) saves by sharing the prompt's blocks.

What it measures
----------------
1. The `mixed` workload (``tessellm bench``'s, same seed) through the continuous scheduler
   twice, with the same KV memory budget (``--budget-mib``): once over the `paged` cache
   (block 16) and once over the `contiguous` cache, whose regions of ``--max-model-len``
   tokens fit the budget ``budget // region bytes`` times. Reported per side: KV waste
   (allocated slots holding no token, over allocated, averaged over engine steps), the most
   sequences running at once (the batch size the budget reached), peak blocks, preemptions
   and output tokens/s.
2. One prompt sampled ``n`` ways (``--n``): the paged cache's peak blocks when the samples
   share the prompt's blocks, against ``n`` times the peak of a single sample (what copying
   the prompt per sample, as the contiguous cache does, would hold).

How to run
----------
    .venv/bin/python bench/kv_memory.py                       # table
    .venv/bin/python bench/kv_memory.py --json --out bench/results/kv_memory_cpu.json
    .venv/bin/python bench/kv_memory.py --num-requests 8 --budget-mib 64   # quick check
    .venv/bin/python bench/kv_memory.py --device cuda --dtype bfloat16   # on a GPU

Memory accounting does not depend on timing, so these figures are exact for the workload;
the tokens/s columns are CPU timings and, like every timing here, want an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import datetime, timezone

from tessellm import LLM
from tessellm.bench.offline import describe_device, run_offline
from tessellm.bench.workloads import BenchRequest, make_workload
from tessellm.core.config import config_from_dict
from tessellm.core.model.loader import load_hf_config
from tessellm.core.model.spec import ModelSpec
from tessellm.core.resolve import DTYPES, model_dir_for
from tessellm.plugins.cache.paged import bytes_per_block


def config(args: argparse.Namespace, cache: dict) -> dict:
    return {"model": args.model, "device": args.device, "dtype": args.dtype, "max_model_len": args.max_model_len,
            "cache": cache, "scheduler": {"name": "continuous", "options": {"max_num_seqs": args.max_num_seqs}}}


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    """K and V bytes of one token across all layers, from the model's config (no weights loaded)."""
    cfg = config_from_dict(config(args, {"name": "paged"}))
    spec = ModelSpec.from_hf_config(load_hf_config(model_dir_for(cfg)))
    return bytes_per_block(spec, 1, DTYPES[args.dtype])


def side(llm: LLM, requests: list[BenchRequest]) -> dict:
    metrics = run_offline(llm, requests).metrics()
    cache = llm.pipeline.cache
    return {"cache": llm.pipeline.resolved.summary()["cache"], "num_blocks": cache.num_blocks,
            "block_size": cache.layout.block_size,
            **{k: metrics[k] for k in ("kv_waste", "peak_running", "peak_kv_blocks", "preemptions",
                                       "output_tokens_per_s", "elapsed_s", "total_output_tokens")}}


def parallel_sampling(llm: LLM, prompt_len: int, n: int, max_tokens: int) -> dict:
    prompt = list(range(1000, 1000 + prompt_len))
    peaks = {}
    for samples in (1, n):
        llm.pipeline.cache.reset_prefix_cache()
        llm.engine.stats.peak_kv_blocks = 0
        llm.generate([prompt], {"max_tokens": max_tokens, "n": samples, "temperature": 1.0, "seed": 0,
                                "ignore_eos": True}, progress=False)
        peaks[samples] = llm.engine.stats.peak_kv_blocks
    unshared = n * peaks[1]
    return {"n": n, "prompt_tokens": prompt_len, "max_tokens": max_tokens, "peak_blocks_single": peaks[1],
            "peak_blocks_shared": peaks[n], "peak_blocks_unshared": unshared,
            "memory_saved": round(1 - peaks[n] / unshared, 4), "cow_copies": llm.pipeline.cache.cow_copies}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the figures do not depend on it)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=2048, help="the contiguous cache's region size")
    ap.add_argument("--budget-mib", type=int, default=256, help="KV memory both caches get")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the scheduler's cap (set high: memory limits)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)

    budget = args.budget_mib * 2**20
    per_token = kv_bytes_per_token(args)
    # the same bytes on any device: the budget as a block count for paged, as regions for contiguous
    paged = LLM(config(args, {"name": "paged", "options": {"block_size": 16, "num_blocks": budget // (16 * per_token)}}))
    regions = budget // (args.max_model_len * per_token)
    requests = make_workload("mixed", seed=args.seed, num_requests=args.num_requests, tokenizer=paged.tokenizer,
                             max_model_len=min(args.max_model_len, paged.pipeline.cache.max_seq_tokens))
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
              "device": describe_device(paged.pipeline.resolved.device), "dtype": args.dtype,
              "model": args.model, "budget_mib": args.budget_mib, "kv_bytes_per_token": per_token,
              "workload": {"name": "mixed", "seed": args.seed, "num_requests": len(requests),
                           "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                           "output_tokens": sum(r.output_len for r in requests)}}
    report["paged"] = side(paged, requests)
    report["parallel_sampling"] = parallel_sampling(paged, 512, args.n, 64)
    del paged
    contiguous = LLM(config(args, {"name": "contiguous", "options": {"max_seqs": max(regions, 1)}}))
    report["contiguous"] = side(contiguous, requests)
    report["batch_ratio"] = round(report["paged"]["peak_running"] / report["contiguous"]["peak_running"], 2)
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        print(text)
    else:
        for name in ("paged", "contiguous"):
            r = report[name]
            print(f"{name:11s} waste {r['kv_waste']:.1%}  peak running {r['peak_running']:4d}  "
                  f"peak blocks {r['peak_kv_blocks']:5d}/{r['num_blocks']}  preemptions {r['preemptions']:3d}  "
                  f"{r['output_tokens_per_s']:.1f} tok/s")
        ps = report["parallel_sampling"]
        print(f"n={ps['n']} sampling of a {ps['prompt_tokens']}-token prompt: {ps['peak_blocks_shared']} blocks "
              f"shared vs {ps['peak_blocks_unshared']} unshared ({ps['memory_saved']:.0%} saved)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
