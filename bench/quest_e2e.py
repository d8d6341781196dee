"""End to end, batch 1, long context: decode with `quest` against dense attention on the same
model and prompt, every arm in one run.

What it measures: a random-weight model with Llama-3.2-1B's shapes and its long (llama3)
RoPE, built here from its config with ``torch.manual_seed(0)`` (bench/e2e_gpu.py's builder;
bf16 on CUDA), one request of ``--context`` prompt tokens generating ``--new-tokens``
(ignore_eos), through the paged cache and continuous batching without prefix caching. Per
arm: time per output token (``tpot_ms``, the decode rate the issue's target is about) and
time to first token (dense prefill in every arm). Arms: dense (`flash` on CUDA, `sdpa` on a
CPU) and `quest` at each ``--budgets`` (its first two layers dense, QUEST's default).

How to run
----------
    python bench/quest_e2e.py --context 32768 --budgets 2048 --json out.json   # on a GPU
    python bench/quest_e2e.py --smoke                                          # CPU: tiny model, code path only
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

from e2e_gpu import LLAMA_32_1B, TINY, build_model  # bench/ is the script's folder
from tessellm import LLM
from tessellm.bench.offline import describe_device, run_offline
from tessellm.bench.workloads import BenchRequest


def arm(folder: Path, cuda: bool, dtype: torch.dtype, context: int, new_tokens: int, attention: dict,
        page: int = 4) -> dict:
    llm = LLM({"model": str(folder), "device": "cuda" if cuda else "cpu", "dtype": str(dtype).split(".")[1],
               "max_model_len": context + new_tokens + 16, "attention": attention,
               "cache": {"name": "paged", "options": {"prefix_caching": False, "bounds_page_size": page}},
               "scheduler": {"name": "continuous", "options": {"max_num_seqs": 1}}})
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, min(1000, llm.engine.vocab_size), (context,), generator=g).tolist()
    metrics = run_offline(llm, [BenchRequest("long", prompt, new_tokens)]).metrics()
    del llm
    if cuda:
        torch.cuda.empty_cache()
    return {"attention": attention, "tpot_ms": metrics["tpot_ms"]["mean"], "ttft_ms": metrics["ttft_ms"]["mean"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048])
    ap.add_argument("--smoke", action="store_true", help="a tiny model (CPU), a short context")
    ap.add_argument("--page", type=int, default=4, help="tokens per key-bounds page (the cache's bounds_page_size)")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = dict(LLAMA_32_1B) if not args.smoke else dict(TINY)
    context = args.context if not args.smoke else 200
    budgets = args.budgets if not args.smoke else [32]
    shapes["max_position_embeddings"] = max(shapes["max_position_embeddings"], context + args.new_tokens + 16)
    report = {"command": "python bench/quest_e2e.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": describe_device("cuda" if cuda else "cpu"),
              "context": context, "new_tokens": args.new_tokens, "arms": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_model(folder, shapes, dtype)
        dense = {"name": "flash" if cuda else "sdpa"}
        report["arms"].append(arm(folder, cuda, dtype, context, args.new_tokens, dense))
        for budget in budgets:
            quest = {"name": "quest", "options": {"token_budget": budget}}
            report["arms"].append(arm(folder, cuda, dtype, context, args.new_tokens, quest, args.page))
            last = report["arms"][-1]
            last["decode_speedup"] = round(report["arms"][0]["tpot_ms"] / last["tpot_ms"], 3)
            print(json.dumps(report["arms"][-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
