"""Out-of-window release in the paged cache, on a Gemma-3-shaped random model: KV memory and
decode speed with and without it, every arm in one run.

What it measures: a random-weight Gemma 3 text model built with transformers' own classes
(``tessellm.testing.models.build_tiny``): 26 layers, five sliding-window layers (window
``--window``) to one global, 1 KV head of dim 128 (Gemma-3-1B's attention pattern and KV
shape; hidden size 512 so a CPU decodes it in seconds), float32 on a CPU, bfloat16 on CUDA.
Per arm (the `paged` cache's ``free_out_of_window`` on and off), `tessellm bench`'s KV
figures for max_model_len = context + new tokens (bytes a token costs at that length, how
many such sequences the cache holds, the longest sequence it admits), then one request of
``--context`` prompt tokens generating ``--new-tokens`` (ignore_eos): time per output token,
and the K/V bytes the sequence held at its end.

How to run
----------
    python bench/window_cache.py --context 4096 --new-tokens 64 --json out.json
    python bench/window_cache.py --smoke      # a short context: the code path only
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

from tessellm import LLM
from tessellm.bench.offline import describe_device, run_offline
from tessellm.bench.workloads import BenchRequest
from tessellm.testing.models import build_tiny

GEMMA3_SHAPED = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=26, num_attention_heads=4,
                     num_key_value_heads=1, head_dim=128, query_pre_attn_scalar=128, final_logit_softcapping=None,
                     layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(26)],
                     rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                      "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})


def arm(folder: Path, device: str, dtype: str, context: int, new_tokens: int, free: bool) -> dict:
    llm = LLM({"model": str(folder), "device": device, "dtype": dtype, "max_model_len": context + new_tokens,
               "cache": {"name": "paged", "options": {"prefix_caching": False, "free_out_of_window": free}},
               "scheduler": {"name": "continuous", "options": {"max_num_seqs": 1}}})
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, llm.engine.vocab_size, (context,), generator=g).tolist()
    result = run_offline(llm, [BenchRequest("long", prompt, new_tokens)])
    metrics = result.metrics()
    cache = llm.pipeline.cache
    return {"free_out_of_window": free, "cache": type(cache).__name__,
            "tpot_ms": metrics["tpot_ms"]["mean"], "ttft_ms": metrics["ttft_ms"]["mean"],
            "kv_bytes_per_token": metrics["kv_bytes_per_token"],
            "kv_bytes_per_token_at_max_len": metrics["kv_bytes_per_token_at_max_len"],
            "kv_sequences_at_max_len": metrics["kv_sequences_at_max_len"],
            "kv_longest_context": metrics["kv_longest_context"],
            "kv_bytes_held_at_end": cache.bytes_for_sequence(context + new_tokens),
            "outputs": result.outputs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--smoke", action="store_true", help="a short context (the code path only)")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    context, new_tokens = (96, 8) if args.smoke else (args.context, args.new_tokens)
    window = 16 if args.smoke else args.window
    report = {"command": "python bench/window_cache.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": describe_device(device),
              "context": context, "new_tokens": new_tokens, "window": window, "arms": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny("gemma3_text", Path(tmp) / "gemma3-shaped", vocab_size=512, weight_std=0.02,
                            sliding_window=window, max_position_embeddings=context + new_tokens, **GEMMA3_SHAPED)
        for free in (False, True):
            report["arms"].append(arm(folder, device, dtype, context, new_tokens, free))
            print(json.dumps({k: v for k, v in report["arms"][-1].items() if k != "outputs"}), flush=True)
    off, on = report["arms"]
    report["identical_outputs"] = off.pop("outputs") == on.pop("outputs")
    report["decode_speed_ratio"] = round(off["tpot_ms"] / on["tpot_ms"], 3)  # > 1: faster with release
    report["kv_held_ratio"] = round(off["kv_bytes_held_at_end"] / on["kv_bytes_held_at_end"], 2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
