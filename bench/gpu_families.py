"""The model zoo on a device: every built-in family's tiny random checkpoint through tessellm's
default pipeline, against transformers.

For each model type the built-in model plugins declare, a tiny random checkpoint is built
with transformers' own classes (``tessellm.testing.models.build_tiny``), and transformers'
float32 model on the CPU is the reference. Variants, each printed as it finishes:

- ``base``: tessellm's default pipeline on ``--device`` in float32 (on CUDA: flash attention,
  the paged cache, continuous batching, async scheduling, CUDA graphs where the cache allows
  them: not with sliding windows, whose out-of-window blocks are released). Every prompt's
  greedy tokens equal transformers'; a divergence passes only at a near-tie of
  transformers' two best logits (at most 1e-4 x max(1, max |logit|) apart, the model
  conformance suite's rule).
- ``lora``: a random PEFT adapter on q/v (PEFT's own classes) on every other prompt, the
  rest base rows, against transformers + PEFT (families with MLA refuse LoRA: skipped).
- ``ngram``: speculative decoding with n-gram drafts (k=3): transformers' greedy tokens.
- ``int8kv``: the paged cache holding int8 K/V, against the same pipeline's tokens on the CPU
  with sdpa (the same quantization, dequantized by torch); a divergence passes at a near-tie
  of the CPU pipeline's two best logprobs (families whose cache cannot hold int8: skipped).
- ``bf16``: the prompts' prefill logits in bfloat16 against transformers' bfloat16 on the
  CPU: max |ours - theirs| at most 2 x max |theirs - transformers' float32| + 2^-7 x
  max |float32 logit| (bfloat16's own error, twice over, plus a rounding of the largest).

``base`` runs on every family first, then the other variants family by family; ``--budget``
seconds bounds the run (what has not started by then is listed as not run), so a short run
has still checked the default pipeline everywhere. A failing family's ``base`` is rerun with
one part of the pipeline changed at a time (``DIAGNOSES``). ``--device cpu`` rehearses the
run here (slowly, with the CPU's default pipeline unless ``--set`` says otherwise). One JSON
line per family and pass goes to ``--out``.

    python bench/gpu_families.py --device cuda --out families.jsonl --budget 200
    python bench/gpu_families.py --device cpu --families llama,gemma2 --variants base,bf16
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

VARIANTS = ("base", "lora", "ngram", "int8kv", "bf16")
FIRST = ("gemma2",)
"""Families run first: those a device run has seen differ."""
DIAGNOSES = (("graphs_off", {"cuda_graphs": False}), ("sync", {"async_scheduling": False}),
             ("keep_window", {"cache.options.free_out_of_window": False}),
             ("unpacked", {"attention.options.packed_prefill": False}), ("sdpa", {"attention.name": "sdpa"}),
             ("sdpa_sync_graphs_off", {"attention.name": "sdpa", "async_scheduling": False, "cuda_graphs": False}))
"""A failing ``base`` is rerun with one part of the pipeline changed at a time (the count of
prompts that then agree says which part it is)."""
SKIPPED = {"gemma3": "a multimodal checkpoint (served as its gemma3_text language model, which runs here)"}
NEAR_TIE = 1e-4
MAX_MODEL_LEN = 128


def model_types(selected: list[str] | None) -> list[str]:
    """Every model type a built-in model plugin declares (failing families first), or ``selected``."""
    from tessellm.core.registry import get_registry

    declared = [t for entry in get_registry().entries("model") for t in entry.cls.model_types]
    types = [t for t in dict.fromkeys(declared) if t not in SKIPPED]
    if selected:
        unknown = sorted(set(selected) - set(types))
        if unknown:
            sys.exit(f"unknown model types {unknown}; known: {', '.join(types)}")
        return [t for t in types if t in selected]
    return sorted(types, key=lambda t: (t not in FIRST, types.index(t)))


def build_checkpoint(model_type: str, root: Path, vocab: int) -> Path:
    from tessellm.testing.models import build_tiny

    return build_tiny(model_type, root / model_type, vocab_size=vocab)


class Reference:
    """transformers' model of a folder on the CPU (float32 unless told; with a PEFT adapter if
    given), greedy by full forwards. Its attention is transformers' eager implementation, the
    one every family defines: transformers up to at least 5.17 (the H200 image's) picks sdpa
    for Gemma 2, whose sdpa path drops ``attn_logit_softcapping``, so a default-loaded Gemma 2
    is not Gemma 2 (the zoo run of 2026-11-28 compared tessellm against that)."""

    def __init__(self, folder: Path, dtype: torch.dtype = torch.float32, adapter: Path | None = None,
                 attention: str | None = "eager"):
        from transformers import AutoModelForCausalLM

        chosen = {} if attention is None else {"attn_implementation": attention}  # None: transformers' default
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **chosen).eval()
        if adapter is not None:
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, adapter).eval()

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(input_ids=torch.tensor([ids])).logits[0].float()

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(prompt):]


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                None if len(ours) == len(theirs) else min(len(ours), len(theirs)))


def judge(prompts: list[list[int]], ours: list[list[int]], theirs: list[list[int]],
          gap_at: Callable[[int, int], float | None]) -> dict[str, Any]:
    """Agreement of ``ours`` with ``theirs``; a divergence at token i of prompt p passes when
    ``gap_at(p, i)`` (the reference's top-two gap there, relative) is at most NEAR_TIE."""
    equal, ties, fails = 0, [], []
    for p, (a, b) in enumerate(zip(ours, theirs)):
        at = first_difference(a, b)
        if at is None:
            equal += 1
            continue
        gap = gap_at(p, at) if at < min(len(a), len(b)) else None
        record = {"prompt": p, "token": at, "ours": a, "theirs": b, "gap": gap}
        (ties if gap is not None and gap <= NEAR_TIE else fails).append(record)
    return {"equal": equal, "of": len(prompts), "near_ties": ties, "failures": fails, "ok": not fails}


def relative_gap(logits: torch.Tensor, a: int, b: int) -> float:
    return float((logits[a] - logits[b]).abs() / max(1.0, float(logits.abs().max())))


def run_llm(config: dict[str, Any], prompts: list[list[int]], n: int, lora: list[str | None] | None = None,
            logprobs: int | None = None) -> tuple[list[list[int]], list[Any], dict[str, Any]]:
    """Greedy tokens (and top logprobs) of ``prompts`` through a pipeline built from ``config``,
    its resolved choices, and whether decode steps replayed graphs; the pipeline freed after."""
    from tessellm import LLM

    llm = LLM(config)
    try:
        params = {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}
        if logprobs:
            params["logprobs"] = logprobs
        outs = llm.generate(prompts, params, lora=lora)
        summary = llm.pipeline.resolved.summary()
        graphs = llm.pipeline.runner.graphs
        facts = {k: summary[k]["name"] for k in ("attention", "cache", "scheduler", "decoding", "lora") if k in summary}
        facts["graph_replays"] = graphs.replays if graphs is not None else None
        facts["async_scheduling"] = summary.get("async_scheduling")
        return [o.token_ids for o in outs], [o.outputs[0].logprobs for o in outs], facts
    finally:
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class Family:
    """One model type's checkpoint, prompts and references, and its variants' checks."""

    def __init__(self, model_type: str, root: Path, args: argparse.Namespace):
        self.model_type, self.args, self.root = model_type, args, root
        self.folder = build_checkpoint(model_type, root, args.vocab)
        g = torch.Generator().manual_seed(args.seed)
        lengths = [5 + 7 * i for i in range(args.prompts)]  # beyond the tiny windows of 8
        self.prompts = [torch.randint(3, args.vocab, (n,), generator=g).tolist() for n in lengths]
        self.reference = Reference(self.folder)
        self.expected = [self.reference.greedy(p, args.tokens) for p in self.prompts]

    def config(self, device: str | None = None, **extra: Any) -> dict[str, Any]:
        # a cache of 1,024 blocks, not 80% of the GPU's memory (millions of blocks for a tiny model)
        config: dict[str, Any] = {"model": str(self.folder), "device": device or self.args.device, "dtype": "float32",
                                  "max_model_len": MAX_MODEL_LEN, "cuda_graph_max_batch": 8,
                                  "cache": {"options": {"num_blocks": 1024}}}
        for key, value in [*self.args.set, *extra.items()]:
            set_path(config, key, value)
        return config

    def against_reference(self, ours: list[list[int]], references: list[Reference] | None = None,
                          expected: list[list[int]] | None = None) -> dict[str, Any]:
        """``judge`` against transformers' tokens (``references``: one model per prompt)."""
        references = references or [self.reference] * len(self.prompts)
        expected = expected or self.expected

        def gap(p: int, at: int) -> float:
            logits = references[p].logits(self.prompts[p] + expected[p][:at])[-1]
            return relative_gap(logits, expected[p][at], ours[p][at])

        return judge(self.prompts, ours, expected, gap)

    def base(self) -> dict[str, Any]:
        ours, _, facts = run_llm(self.config(), self.prompts, self.args.tokens)
        result = {**self.against_reference(ours), "pipeline": facts, "transformers_default": self.default_attention()}
        if not result["ok"]:  # which part of the pipeline it is: rerun with one part changed at a time
            for name, extra in DIAGNOSES:
                try:
                    tokens, _, _ = run_llm(self.config(**extra), self.prompts, self.args.tokens)
                    result[name] = self.against_reference(tokens)["equal"]
                except Exception as exc:  # noqa: BLE001 - a diagnosis that cannot run says why
                    result[name] = f"{type(exc).__name__}: {exc}"[:200]
        return result

    def default_attention(self) -> dict[str, Any]:
        """transformers' default attention implementation for this checkpoint, and on how many
        prompts its greedy tokens equal the eager reference's (where they differ, the default
        is what computes the family wrongly)."""
        default = Reference(self.folder, attention=None)
        equal = sum(default.greedy(p, self.args.tokens) == e for p, e in zip(self.prompts, self.expected))
        return {"attention": default.model.config._attn_implementation, "equal_to_eager": equal}

    def lora(self) -> dict[str, Any]:
        from tessellm.testing.lora import build_tiny_lora

        adapter = build_tiny_lora(self.folder, self.root / f"{self.model_type}-lora", rank=8, seed=1,
                                  target_modules=("q_proj", "v_proj"))
        names = ["qv" if i % 2 == 0 else None for i in range(len(self.prompts))]
        config = self.config(**{"lora.adapters": {"qv": str(adapter)}})
        ours, _, facts = run_llm(config, self.prompts, self.args.tokens, lora=names)
        with_adapter = Reference(self.folder, adapter=adapter)
        references = [with_adapter if n else self.reference for n in names]
        expected = [r.greedy(p, self.args.tokens) for r, p in zip(references, self.prompts)]
        return {**self.against_reference(ours, references, expected), "pipeline": facts}

    def ngram(self) -> dict[str, Any]:
        config = self.config(**{"decoding.name": "speculative", "decoding.options": {"proposer": "ngram", "k": 3}})
        ours, _, facts = run_llm(config, self.prompts, self.args.tokens)
        return {**self.against_reference(ours), "pipeline": facts}

    def int8kv(self) -> dict[str, Any]:
        int8 = {"cache.name": "paged", "cache.options.kv_dtype": "int8"}
        ours, _, facts = run_llm(self.config(**int8), self.prompts, self.args.tokens)
        cpu = self.config("cpu", **int8, **{"attention.name": "sdpa", "cuda_graphs": False})
        theirs, logprobs, _ = run_llm(cpu, self.prompts, self.args.tokens, logprobs=2)

        def gap(p: int, at: int) -> float:
            top = logprobs[p][at].top
            return abs(top[0][1] - top[1][1]) / max(1.0, abs(top[0][1]))

        return {**judge(self.prompts, ours, theirs, gap), "transformers_equal": self.against_reference(ours)["equal"],
                "pipeline": facts}

    def bf16(self) -> dict[str, Any]:
        from tessellm import LLM

        llm = LLM(self.config(dtype="bfloat16"))
        try:
            ours = [llm.engine.score(p).float().cpu() for p in self.prompts]
        finally:
            del llm
            gc.collect()
        theirs16 = Reference(self.folder, torch.bfloat16)
        worst, bound = 0.0, 0.0
        for p, logits in zip(self.prompts, ours):
            exact, hf16 = self.reference.logits(p), theirs16.logits(p)
            worst = max(worst, float((logits - hf16).abs().max()))
            bound = max(bound, 2 * float((hf16 - exact).abs().max()) + 2 ** -7 * float(exact.abs().max()))
        return {"max_diff": round(worst, 5), "bound": round(bound, 5), "ok": worst <= bound}


def set_path(config: dict[str, Any], key: str, value: Any) -> None:
    """``config[a][b][c] = value`` for key ``a.b.c``; a string value is read as JSON when it parses."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    *parents, leaf = key.split(".")
    for part in parents:
        config = config.setdefault(part, {})
    config[leaf] = value


def summary_line(model_type: str, results: dict[str, Any], seconds: float) -> str:
    parts = []
    for name, r in results.items():
        if "skipped" in r or "error" in r:
            parts.append(f"{name} {'skipped' if 'skipped' in r else 'ERROR'}: {r.get('skipped') or r.get('error')}")
        elif name == "bf16":
            parts.append(f"bf16 {'ok' if r['ok'] else 'FAIL'} max diff {r['max_diff']} (bound {r['bound']})")
        else:
            extra = f" ({len(r['near_ties'])} near-tie)" if r["near_ties"] else ""
            facts, default = r.get("pipeline", {}), r.get("transformers_default", {})
            if name == "base" and facts:
                extra += f" [{facts.get('attention')}, graph replays {facts.get('graph_replays')}, async " \
                         f"{facts.get('async_scheduling')}]"
            if default and default.get("equal_to_eager") != r["of"]:
                extra += f" (transformers' default {default['attention']} attention: {default['equal_to_eager']}/" \
                         f"{r['of']} of eager's tokens)"
            diag = "".join(f" {k}={r[k]}" for k, _ in DIAGNOSES if k in r)
            parts.append(f"{name} {r['equal']}/{r['of']}{extra}{'' if r['ok'] else ' FAIL'}{diag}")
    return f"{model_type}: " + " | ".join(parts) + f" [{seconds:.0f} s]"


def run_variants(family: Family, variants: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in variants:
        try:
            results[name] = getattr(family, name)()
        except Exception as exc:  # noqa: BLE001 - one variant's failure must not hide the others
            from tessellm.core.errors import ConfigError

            if isinstance(exc, ConfigError) and name in ("lora", "int8kv"):
                results[name] = {"skipped": str(exc).split("\n")[0][:160], "ok": True}
            else:
                results[name] = {"error": f"{type(exc).__name__}: {exc}"[:400], "ok": False,
                                 "trace": traceback.format_exc()[-2000:]}
    return results


def passes(variants: list[str]) -> list[list[str]]:
    """``base`` for every family first, then the other variants: a run cut short by its
    budget has still checked the default pipeline on as many families as it could."""
    rest = [v for v in variants if v != "base"]
    return [p for p in (["base"] if "base" in variants else [], rest) if p]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--families", type=lambda s: s.split(","), default=None, help="model types (default: all)")
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=14)
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size (the H200 zoo's; near-ties "
                        "are likelier the larger it is)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], type=lambda s: tuple(s.split("=", 1)),
                        help="KEY=VALUE into every device pipeline's config (dotted keys)")
    parser.add_argument("--budget", type=float, default=None, help="seconds; families not started by then are not run")
    parser.add_argument("--out", type=Path, default=None, help="one JSON line per family")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    start, failed, not_run = time.monotonic(), set(), []
    print(f"device {args.device}, torch {torch.__version__}, float32 matmuls {torch.get_float32_matmul_precision()}"
          + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""), flush=True)
    with tempfile.TemporaryDirectory(prefix="families-") as tmp:
        built: dict[str, Family] = {}
        for variants in passes(args.variants):
            for model_type in model_types(args.families):
                if args.budget is not None and time.monotonic() - start > args.budget:
                    not_run.append(f"{model_type} ({','.join(variants)})")
                    continue
                t0 = time.monotonic()
                try:
                    family = built.get(model_type) or built.setdefault(model_type, Family(model_type, Path(tmp), args))
                    results = run_variants(family, variants)
                except Exception as exc:  # noqa: BLE001 - the checkpoint or reference could not be built
                    results = {"build": {"error": f"{type(exc).__name__}: {exc}"[:400], "ok": False}}
                seconds = time.monotonic() - t0
                print(summary_line(model_type, results, seconds), flush=True)
                if not all(r.get("ok", False) for r in results.values()):
                    failed.add(model_type)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps({"model_type": model_type, "seconds": round(seconds, 1), **results}) + "\n")
    print(f"families failing: {', '.join(sorted(failed)) or 'none'}; not run (budget): {', '.join(not_run) or 'none'}; "
          f"{time.monotonic() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
