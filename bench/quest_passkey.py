"""QUEST against dense attention on `tessellm eval passkey`'s prompt family, and why it
loses the keys it loses.

Two parts, one run:

- ``--arms``: the passkey evaluation (``tessellm.eval.passkey``) through dense attention
  (`sdpa`) and through `quest` with each set of options given; for each arm its accuracy,
  the share of the keys dense finds that it finds too (the target: at least 90% at budget
  256 and 97% at 512 at 4k tokens), accuracy by depth decile, and per sparse layer the share
  of the key's blocks QUEST selected.
- ``--diagnose N``: for the first N prompts, a dense run that keeps every layer's queries
  and keys, then offline, at each decode step of the answer and for every layer and KV head,
  the blocks each rule would choose at the budget: ``quest``, the block's key-bound score,
  the largest over the KV head's query heads (QUEST's rule under GQA); ``relative``, each
  query head's bound less that head's best block's, the largest over the heads (every head's
  ranking counts alike, whatever its query's norm); ``bound_mass``, the sum over the heads of
  the softmax of the bounds (the attention mass the bounds allow); ``per_query_head``, each
  query head's own bound (what the group costs); ``true_max``, the true largest q.k of each
  block (what the bound's looseness costs); ``attention``, the dense attention weights (a
  perfect selection). Each is the share of the key's blocks kept, over the (layer, query
  head) pairs that attend to the key (dense attention mass on its blocks above
  ``--retrieval-mass``), per layer and overall.

How to run
----------
    python bench/quest_passkey.py --context 4096 --trials 30 --arms '{}' '{"token_budget": 512}' \\
        --budget 256 --diagnose 10 --json out.json
(each arm is a JSON object of `quest` options, and optionally the cache's ``block_size`` and
``bounds_page_size``; token_budget defaults to ``--budget``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone

import torch

from tessellm import LLM
from tessellm.bench.offline import describe_device
from tessellm.eval.passkey import case_prompt, draw_cases, passkey


def pipeline(attention: dict, context: int, block_size: int, prefix_caching: bool = True,
             bounds_page_size: int | None = None) -> LLM:
    cache = {"block_size": block_size, "prefix_caching": prefix_caching}
    if bounds_page_size is not None:
        cache["bounds_page_size"] = bounds_page_size
    return LLM({"model": "smollm2-135m", "device": "cpu", "dtype": "float32", "max_model_len": min(context + 32, 8192),
                "attention": attention, "cache": {"name": "paged", "options": cache},
                "scheduler": {"name": "continuous", "options": {"max_num_batched_tokens": 4096}}})


def run_arms(args: argparse.Namespace, cases: list) -> list[dict]:
    arms = [({"name": "sdpa"}, args.block_size, None)]
    for text in args.arms:
        options = {"token_budget": args.budget, **json.loads(text)}
        arms.append(({"name": "quest", "options": options}, options.pop("block_size", args.block_size),
                     options.pop("bounds_page_size", None)))
    results, dense_found = [], None
    for attention, block_size, page in arms:
        llm = pipeline(attention, args.context, block_size, bounds_page_size=page)
        start = time.perf_counter()
        # past dense, only the prompts dense answers (what an arm keeps of dense's finds)
        run = cases if dense_found is None or not args.dense_found_only else \
            [c for c, ok in zip(cases, dense_found) if ok]
        result = passkey(llm, context=args.context, cases=run)
        found = [t.correct for t in result.trials]
        if dense_found is None:
            dense_found = found
        elif args.dense_found_only:
            it = iter(found)
            found = [next(it) if ok else False for ok in dense_found]
        kept = sum(a and b for a, b in zip(found, dense_found)) / max(sum(dense_found), 1)
        row = {"attention": attention, "block_size": block_size, "bounds_page": llm.pipeline.cache.layout.bounds_page,
               "accuracy": result.accuracy, "found": sum(found),
               "found_of_dense": round(kept, 4), "by_decile": result.by_decile, "selection": result.selection,
               "misses": [i for i, ok in enumerate(found) if not ok], "seconds": round(time.perf_counter() - start, 1)}
        print(json.dumps(row), flush=True)
        results.append(row)
        del llm
    return results


class Capture:
    """Every layer's queries of decode steps and keys of every position, from a dense run."""

    def __init__(self, llm: LLM):
        self.queries: dict[int, list[torch.Tensor]] = {}
        self.keys: dict[int, list[torch.Tensor]] = {}
        backend = llm.pipeline.attention
        original = backend.forward

        def forward(layer, q, k, v, kv, plan):
            self.keys.setdefault(layer, []).append(k.detach().clone())
            if q.shape[0] == 1:
                self.queries.setdefault(layer, []).append(q[0].detach().clone())
            return original(layer, q, k, v, kv, plan)

        backend.forward = forward

    def reset(self) -> None:
        self.queries.clear()
        self.keys.clear()


def block_stats(q: torch.Tensor, keys: torch.Tensor, bs: int, scale: float) -> dict[str, torch.Tensor]:
    """For one query q [Hq, D] over keys [P, Hkv, D]: per query head and block, the key-bound
    score, the true largest q.k and the attention mass. -> each [Hq, N]."""
    p, hkv, d = keys.shape
    g = q.shape[0] // hkv
    n = -(-p // bs)
    padded = torch.cat([keys, keys[-1:].expand(n * bs - p, hkv, d)]) if n * bs > p else keys
    blocks = padded.view(n, bs, hkv, d)
    kmax, kmin = blocks.amax(1), blocks.amin(1)  # [N, Hkv, D]
    qh = q.view(hkv, g, d).double()
    bound = (torch.einsum("hgd,nhd->hgn", qh.clamp(min=0), kmax.double())
             - torch.einsum("hgd,nhd->hgn", (-qh).clamp(min=0), kmin.double()))
    logits = torch.einsum("hgd,phd->hgp", qh, keys.double())  # [Hkv, G, P]
    true_max = torch.cat([logits, logits[..., -1:].expand(-1, -1, n * bs - p)], -1).view(hkv, g, n, bs).amax(-1)
    mass = torch.softmax(logits * scale, dim=-1)
    mass = torch.cat([mass, mass.new_zeros(hkv, g, n * bs - p)], -1).view(hkv, g, n, bs).sum(-1)
    return {"bound": bound.reshape(hkv * g, n), "true_max": true_max.reshape(hkv * g, n),
            "mass": mass.reshape(hkv * g, n)}


def kept(scores: torch.Tensor, forced: list[int], budget_blocks: int, key_blocks: list[int]) -> float:
    """The share of ``key_blocks`` among the forced blocks and the best-scored others."""
    s = scores.clone()
    s[forced] = float("inf")
    top = set(s.topk(min(max(budget_blocks, len(forced)), s.numel())).indices.tolist())
    return sum(b in top for b in key_blocks) / len(key_blocks)


def diagnose(args: argparse.Namespace, cases: list) -> dict:
    llm = pipeline({"name": "sdpa"}, args.context, args.block_size, prefix_caching=False)  # every key captured
    spec = llm.pipeline.runner.spec
    scale = spec.head_dim ** -0.5
    hq, hkv = spec.num_heads, spec.num_kv_heads
    capture = Capture(llm)
    bs, budget_blocks = args.block_size, args.budget // args.block_size
    rules = ("quest", "relative", "bound_mass", "per_query_head", "true_max", "attention")
    per_layer: dict[int, dict[str, list[float]]] = {}
    for case in cases[:args.diagnose]:
        capture.reset()
        ids, key_tokens = case_prompt(llm, case, args.context)
        out = llm.generate([ids], {"max_tokens": len(case.key) + 2, "temperature": 0.0})[0]
        key_blocks = sorted({t // bs for t in key_tokens})
        for layer in range(args.dense_layers, spec.num_layers):
            keys = torch.cat(capture.keys[layer])  # [prompt + decoded, Hkv, D]
            for step, q in enumerate(capture.queries.get(layer, [])[:len(case.key)]):
                pos = len(ids) + step  # the query's position: it sees keys 0 .. pos
                stats = block_stats(q, keys[:pos + 1], bs, scale)
                forced = [0, pos // bs]
                for head in range(hq):
                    mass_on_key = float(stats["mass"][head, key_blocks].sum())
                    if mass_on_key < args.retrieval_mass:
                        continue
                    group = slice((head // (hq // hkv)) * (hq // hkv), (head // (hq // hkv) + 1) * (hq // hkv))
                    row = per_layer.setdefault(layer, {r: [] for r in rules + ("mass_on_key",)})
                    bound = stats["bound"][group]
                    row["quest"].append(kept(bound.amax(0), forced, budget_blocks, key_blocks))
                    relative = (bound - bound.amax(-1, keepdim=True)).amax(0)
                    row["relative"].append(kept(relative, forced, budget_blocks, key_blocks))
                    row["bound_mass"].append(kept(torch.softmax(bound * scale, -1).sum(0), forced, budget_blocks,
                                                  key_blocks))
                    row["per_query_head"].append(kept(stats["bound"][head], forced, budget_blocks, key_blocks))
                    row["true_max"].append(kept(stats["true_max"][head], forced, budget_blocks, key_blocks))
                    row["attention"].append(kept(stats["mass"][head], forced, budget_blocks, key_blocks))
                    row["mass_on_key"].append(mass_on_key)
        print(f"diagnosed key {case.key} at depth {case.depth:.2f} ({case.filler}): answer {out.text!r}", flush=True)
    summary = {layer: {k: round(sum(v) / len(v), 3) for k, v in row.items()} | {"pairs": len(row["quest"])}
               for layer, row in sorted(per_layer.items())}
    every = {r: [x for row in per_layer.values() for x in row[r]] for r in rules}
    overall = {r: round(sum(v) / max(len(v), 1), 3) for r, v in every.items()}
    return {"per_layer": summary, "overall": overall, "pairs": len(every["quest"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--arms", nargs="*", default=[], metavar="JSON", help="quest options of each arm")
    ap.add_argument("--dense-found-only", action="store_true",
                    help="run the quest arms on the prompts dense answers only (the ratio is the same; accuracy "
                         "and deciles then count those)")
    ap.add_argument("--only", type=int, nargs="+", metavar="I",
                    help="run only these prompts of the drawn family (indices, from 0), e.g. one a run missed")
    ap.add_argument("--diagnose", type=int, default=0, metavar="N", help="prompts to diagnose (0: none)")
    ap.add_argument("--dense-layers", type=int, default=2, help="layers the diagnosis skips (QUEST runs them dense)")
    ap.add_argument("--retrieval-mass", type=float, default=0.1,
                    help="a (layer, head) counts as retrieving when its attention mass on the key's blocks is this")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cases = draw_cases(args.trials, args.seed)
    if args.only:
        bad = [i for i in args.only if not 0 <= i < len(cases)]
        if bad:
            ap.error(f"--only {bad[0]}: the family has prompts 0 to {len(cases) - 1}")
        cases = [cases[i] for i in args.only]
    report = {"command": "python bench/quest_passkey.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": describe_device("cpu"), "machine": platform.processor() or platform.machine(),
              "context": args.context, "trials": args.trials, "block_size": args.block_size}
    if args.arms:
        report["arms"] = run_arms(args, cases)
    if args.diagnose:
        report["diagnosis"] = diagnose(args, cases)
        print(json.dumps(report["diagnosis"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
