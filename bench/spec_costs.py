"""The two costs behind speculative decoding's defaults, measured on the embedded model:

1. A target forward's time against its query tokens per sequence (1 = plain decode, k+1 =
   verifying k drafts), at batch 1 and 8, context 800: the ``verify_cost`` of adaptive k.
2. How often the target with a band of layers skipped picks the full model's greedy token
   (teacher-forced over a generated answer): the ``draft_layers`` default of layer-skip.

    .venv/bin/python bench/spec_costs.py --out bench/results/spec_costs_cpu_2026-11-23.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tessellm import LLM
from tessellm.core.interfaces.batch import ScheduledSeq
from tessellm.core.engine.batch_builder import build_batch
from tessellm.bench.offline import describe_device
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.plugins.decoding.speculative.layer_skip import default_draft_layers


def forward_ms(llm: LLM, batch_size: int, query: int, context: int = 800, repeats: int = 10) -> float:
    p = llm.pipeline
    seqs = []
    for i in range(batch_size):
        seq = Sequence(f"s{i}", list(range(100 + i, 100 + i + context)), SamplingParams())
        p.cache.reserve(seq, context)
        seq.num_computed_tokens = context - query
        seqs.append(seq)
    try:
        batch = build_batch([ScheduledSeq(s, query) for s in seqs], p.cache, p.runner.device, all_logits=True)
        for _ in range(2):
            p.runner.forward(batch)
        start = time.perf_counter()
        for _ in range(repeats):
            p.runner.forward(batch)
        return (time.perf_counter() - start) / repeats * 1000
    finally:
        for seq in seqs:
            p.cache.free(seq)


def agreement(llm: LLM, tokens: list[int], prompt_len: int, layers: list[int] | None) -> torch.Tensor:
    p = llm.pipeline
    seq = Sequence("a", tokens, SamplingParams())
    p.cache.reserve(seq, len(tokens))
    try:
        batch = build_batch([ScheduledSeq(seq, len(tokens))], p.cache, p.runner.device, all_logits=True)
        return p.runner.forward(batch, layers).argmax(-1)[prompt_len - 1:-1]
    finally:
        p.cache.free(seq)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the results as JSON here")
    args = ap.parse_args()
    llm = LLM({"model": "smollm2-135m", "device": "cpu", "dtype": "float32"})
    results: dict = {"device": describe_device("cpu"), "date": time.strftime("%Y-%m-%d"), "forward_ms": {},
                     "layer_skip_agreement": {}}
    for b in (1, 8):
        base = forward_ms(llm, b, 1)
        for q in (1, 5):
            ms = base if q == 1 else forward_ms(llm, b, q)
            results["forward_ms"][f"batch{b}_query{q}"] = round(ms, 2)
        extra = results["forward_ms"][f"batch{b}_query5"] / base - 1
        results["forward_ms"][f"batch{b}_cost_per_verified_token"] = round(extra / 4, 3)
        print(f"batch {b}: 1 token {base:.1f} ms, 5 tokens {results['forward_ms'][f'batch{b}_query5']:.1f} ms: "
              f"{extra / 4:.3f} of a step per extra token")
    prompt = llm.encode("Summarize the following text in three sentences:\n\n" + open(__file__).read()[:1500],
                        chat=True)
    answer = llm.generate([prompt], {"max_tokens": 120})[0].token_ids
    tokens = prompt + answer
    L = llm.pipeline.spec.num_layers
    full = agreement(llm, tokens, len(prompt), None)
    bands = {f"skip {s}-{s + w - 1}": [i for i in range(L) if not s <= i < s + w]
             for w in (2, 4, 8) for s in (3, 4, 10, 16, 22)}
    bands["default"] = default_draft_layers(L)
    for name, layers in bands.items():
        share = float((agreement(llm, tokens, len(prompt), layers) == full).float().mean())
        results["layer_skip_agreement"][name] = round(share, 3)
        print(f"layer-skip {name} ({len(layers)}/{L} layers): {share:.3f} of greedy tokens agree")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
