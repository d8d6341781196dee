"""``tessellm bench --workload embed``: an embedding (or reranking) pipeline's throughput on
random texts against sentence-transformers on the same texts, in interleaved rounds.

The texts are drawn as token ids (log-normal lengths, the tokenizer's ordinary tokens) and
decoded, so both sides tokenize the same strings. Each round runs every text through
tessellm (``LLM.embed``: all submitted at once, continuous batching) and through
sentence-transformers (``SentenceTransformer.encode`` in batches of ``batch_size``; for a
reranker, ``LLM.score`` against ``CrossEncoder.predict`` on (query, text) pairs), alternating
which goes first. The report gives each side's texts/s and tokens/s (median over rounds), the
ratio per round and its median, and how far the outputs agree (the lowest cosine of two
embeddings, or the largest score difference)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch
from pydantic import Field

from tessellm.bench.workloads import WorkloadParams, lognormal_lengths, plain_token_ids
from tessellm.core.errors import ConfigError


class EmbedParams(WorkloadParams):
    """Random texts to embed (or to rerank against one query)."""

    length_median: int = Field(64, ge=1)
    """Median text length in tokens (before the text is decoded and tokenized again)."""
    length_sigma: float = Field(0.6, ge=0.0, le=3.0)
    """Spread of log(length)."""
    length_min: int = Field(4, ge=1)
    length_max: int = Field(256, ge=1)
    batch_size: int = Field(32, ge=1)
    """sentence-transformers' batch size (its encode/predict default is 32)."""
    rounds: int = Field(3, ge=1, le=50)
    """Runs of each side, interleaved (A B, B A, ...)."""

    ranges = ("length",)


def embed_texts(params: EmbedParams, tokenizer: Any, seed: int, num_texts: int, max_len: int) -> list[str]:
    """``num_texts`` random texts of log-normal token lengths, decoded from ordinary tokens."""
    hi = min(params.length_max, max_len - 8)  # room for special tokens and re-tokenization drift
    if hi < params.length_min:
        raise ConfigError(f"workload embed: length_min ({params.length_min}) does not fit under the model's "
                          f"{max_len} tokens less 8 kept for special tokens; lower length_min")
    rng = np.random.default_rng(seed)
    ids = plain_token_ids(tokenizer)
    lengths = lognormal_lengths(rng, params.length_median, params.length_sigma, num_texts, params.length_min, hi)
    return [tokenizer.decode(rng.choice(ids, size=int(n)).tolist(), skip_special_tokens=True).strip() or "a"
            for n in lengths]


def run_embed_bench(llm: Any, texts: list[str], params: EmbedParams, progress: bool = False) -> dict[str, Any]:
    """Interleaved rounds of tessellm and sentence-transformers on ``texts``; the figures."""
    pipeline = llm.pipeline
    scoring = pipeline.task == "score"
    query = texts[0][:200]
    reference = _reference(pipeline, scoring)
    inputs = llm.score_inputs([query] * len(texts), texts) if scoring else llm.embedding_inputs(texts)
    tokens = sum(len(item.token_ids) for item in inputs)  # what both sides run: pairs for a reranker

    def ours() -> torch.Tensor:
        if scoring:
            return torch.tensor([o.score for o in llm.score(query, texts, progress=progress)])
        return torch.tensor([o.embedding for o in llm.embed(texts, progress=progress)])

    def theirs() -> torch.Tensor:
        if scoring:
            return torch.as_tensor(reference.predict([(query, t) for t in texts], batch_size=params.batch_size))
        return torch.as_tensor(reference.encode(texts, batch_size=params.batch_size))

    times: dict[str, list[float]] = {"tessellm": [], "sentence-transformers": []}
    outputs: dict[str, torch.Tensor] = {}
    sides = [("tessellm", ours), ("sentence-transformers", theirs)]
    for r in range(params.rounds):
        for name, run in sides if r % 2 == 0 else sides[::-1]:
            start = time.perf_counter()
            outputs[name] = run()
            times[name].append(time.perf_counter() - start)
    ratios = [s / t for t, s in zip(times["tessellm"], times["sentence-transformers"])]
    a, b = outputs["tessellm"].float(), outputs["sentence-transformers"].float().reshape(outputs["tessellm"].shape)
    agreement = ({"max_abs_score_difference": float((a - b).abs().max())} if scoring else
                 {"min_cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())})
    return {"task": pipeline.task, "num_texts": len(texts), "num_tokens": tokens, "rounds": params.rounds,
            "seconds": times, **{f"{name}_texts_per_s": len(texts) / statistics.median(t) for name, t in times.items()},
            **{f"{name}_tokens_per_s": tokens / statistics.median(t) for name, t in times.items()},
            "ratio_per_round": ratios, "ratio_median": statistics.median(ratios), "agreement": agreement}


def _reference(pipeline: Any, scoring: bool) -> Any:
    """sentence-transformers' model of the same folder, on the same device and dtype."""
    try:
        import sentence_transformers
    except ImportError:
        raise ConfigError("--workload embed compares with sentence-transformers: pip install sentence-transformers") \
            from None
    cls = sentence_transformers.CrossEncoder if scoring else sentence_transformers.SentenceTransformer
    model = cls(str(pipeline.model_dir), device=str(pipeline.resolved.device))
    return model.to(pipeline.resolved.dtype)


def format_embed_report(report: dict[str, Any]) -> str:
    """The text report of ``run_embed_bench``'s figures (and what was run where)."""
    unit = "pairs" if report["task"] == "score" else "texts"
    lines = [f"tessellm bench: workload embed ({report['num_texts']} {unit}, {report['num_tokens']} tokens, "
             f"seed {report['seed']}), {report['rounds']} interleaved rounds on {report['device']}",
             f"{'':28}{'tessellm':>12}{'sentence-transformers':>24}",
             f"{unit + '/s (median)':28}{report['tessellm_texts_per_s']:>12.1f}"
             f"{report['sentence-transformers_texts_per_s']:>24.1f}",
             f"{'tokens/s (median)':28}{report['tessellm_tokens_per_s']:>12.0f}"
             f"{report['sentence-transformers_tokens_per_s']:>24.0f}",
             f"ratio tessellm / sentence-transformers: {report['ratio_median']:.3g} (rounds "
             f"{', '.join(f'{r:.3g}' for r in report['ratio_per_round'])})",
             "agreement: " + ", ".join(f"{k.replace('_', ' ')} {v:.6g}" for k, v in report["agreement"].items())]
    return "\n".join(lines)
