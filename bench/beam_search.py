"""Beam search on the embedded SmolLM2: the cache blocks a beam group holds against independent
copies of its prompt, and throughput against transformers' generate on the same prompts.

What it measures, on the CPU in float32:

- memory: one request of a ``--prompt-len``-token prompt with ``--beams`` beams and
  ``--new-tokens`` tokens (``decoding.name=beam``, paged blocks of 16) against ``--beams``
  independent greedy requests of the same prompt with prefix caching off (four copies of the
  prompt): the peak of KV blocks held (``EngineStats.peak_kv_blocks``);
- speed: ``--prompts`` prompts of the bundled texts, each a beam search of ``--beams`` beams
  and up to ``--new-tokens`` tokens: tessellm with every request in one continuous batch
  against transformers' ``generate(num_beams=...)`` on one prompt at a time and on all
  prompts as one left-padded batch; requests per second, and whether the best beams are the
  same tokens (transformers' cut to tessellm's length: it pads ended beams).

How to run
----------
    python bench/beam_search.py --json bench/results/beam_search_cpu_DATE.json
    python bench/beam_search.py --smoke      # small sizes: the code path only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from tessellm import LLM
from tessellm.bench.offline import describe_device
from tessellm.eval.texts import load_text


def memory(args: argparse.Namespace, prompt: list[int]) -> dict:
    def peak(decoding: dict, params: dict, copies: int, prefix_caching: bool) -> int:
        llm = LLM({"model": "smollm2-135m", "device": "cpu", "dtype": "float32", "decoding": decoding,
                   "cache": {"name": "paged", "options": {"block_size": 16, "prefix_caching": prefix_caching}},
                   "scheduler": {"name": "continuous"}})
        llm.generate([prompt] * copies, params)
        return llm.engine.stats.peak_kv_blocks

    beams = peak({"name": "beam"}, {"max_tokens": args.new_tokens, "ignore_eos": True,
                                    "extra_args": {"num_beams": args.beams}}, 1, True)
    copies = peak({"name": "greedy"}, {"max_tokens": args.new_tokens, "ignore_eos": True}, args.beams, False)
    return {"prompt_tokens": len(prompt), "beams": args.beams, "new_tokens": args.new_tokens,
            "beam_group_peak_blocks": beams, "independent_copies_peak_blocks": copies,
            "blocks_ratio": round(beams / copies, 3)}


def speed(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from transformers import AutoModelForCausalLM

    llm = LLM({"model": "smollm2-135m", "device": "cpu", "dtype": "float32", "decoding": {"name": "beam"}})
    params = {"max_tokens": args.new_tokens, "extra_args": {"num_beams": args.beams}}
    llm.generate(prompts[:1], params)  # warm-up
    start = time.perf_counter()
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    tessellm_s = time.perf_counter() - start
    hf = AutoModelForCausalLM.from_pretrained(llm.pipeline.model_dir, dtype=torch.float32).eval()
    eos = sorted(llm.pipeline.stop.eos_token_ids)
    kwargs = dict(num_beams=args.beams, do_sample=False, max_new_tokens=args.new_tokens, length_penalty=1.0,
                  early_stopping=False, eos_token_id=eos, pad_token_id=eos[0])
    with torch.no_grad():
        hf.generate(torch.tensor([prompts[0]]), **kwargs)  # warm-up
        start = time.perf_counter()
        theirs = [_cut(hf.generate(torch.tensor([p]), **kwargs)[0, len(p):].tolist(), len(o))
                  for p, o in zip(prompts, ours)]
        one_s = time.perf_counter() - start
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[kwargs["pad_token_id"]] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        start = time.perf_counter()
        hf.generate(ids, attention_mask=mask, **kwargs)
        batched_s = time.perf_counter() - start
    n = len(prompts)
    same = sum(a == b for a, b in zip(ours, theirs))
    return {"prompts": n, "beams": args.beams, "max_new_tokens": args.new_tokens,
            "tokens_of_best_beams": sum(len(o) for o in ours),
            "tessellm_requests_per_s": round(n / tessellm_s, 3),
            "transformers_one_at_a_time_requests_per_s": round(n / one_s, 3),
            "transformers_batched_requests_per_s": round(n / batched_s, 3),
            "speedup_vs_one_at_a_time": round(one_s / tessellm_s, 3),
            "speedup_vs_batched": round(batched_s / tessellm_s, 3),
            "same_best_beam": f"{same}/{len(prompts)}"}


def _cut(tokens: list[int], length: int) -> list[int]:
    """transformers' best beam without the padding after its end (tessellm's has ``length``)."""
    return tokens[:length]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--speed-prompt-len", type=int, default=64)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.smoke:
        args.prompt_len, args.new_tokens, args.prompts, args.speed_prompt_len = 48, 4, 2, 12
    tokenizer = LLM({"model": "smollm2-135m", "device": "cpu"}).tokenizer
    text = tokenizer.encode(load_text("paradise-lost")[1])
    prompt = text[:args.prompt_len]
    prompts = [text[1000 + 97 * i: 1000 + 97 * i + args.speed_prompt_len] for i in range(args.prompts)]
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": describe_device("cpu"),
              "threads": torch.get_num_threads(), "command": "python " + " ".join(sys.argv),
              "memory": memory(args, prompt), "speed": speed(args, prompts)}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
