"""Perplexity of the embedded SmolLM2 under several configurations, for the quality tests of
quantizers and quantized caches: the first 1,024 tokens of each bundled text, windows of 512
with stride 256."""

from __future__ import annotations

from typing import Any


def smollm2_perplexities(variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{variant: {text: perplexity}} for each variant's config pieces (added to SmolLM2 in
    float32 on the CPU; ``{}`` is float32 itself). One pipeline at a time."""
    from tessellm import LLM
    from tessellm.eval.perplexity import perplexity
    from tessellm.eval.texts import BUNDLED, load_text

    results = {}
    for variant, parts in variants.items():
        llm = LLM({"model": "smollm2-135m", "device": "cpu", "dtype": "float32", **parts})
        results[variant] = {name: perplexity(llm, load_text(name)[1], window=512, stride=256, max_tokens=1024).perplexity
                            for name in BUNDLED}
        del llm
    return results
