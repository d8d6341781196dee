"""Perplexity of the embedded SmolLM2 under several configurations, for the quality tests of
quantizers and quantized caches: the first 1,024 tokens of each bundled text, windows of 512
with stride 256."""

from __future__ import annotations

import json
from typing import Any, Iterable

_measured: dict[tuple[str, str], float] = {}  # (config pieces as JSON, text) -> perplexity, per process


def smollm2_perplexities(variants: dict[str, dict[str, Any]], texts: Iterable[str] | None = None
                         ) -> dict[str, dict[str, float]]:
    """{variant: {text: perplexity}} for each variant's config pieces (added to SmolLM2 in
    float32 on the CPU; ``{}`` is float32 itself) on ``texts`` (default: every bundled one).
    One pipeline at a time; what was measured before in this process (float32, by every
    quality test) is not measured again."""
    from tessellm import LLM
    from tessellm.eval.perplexity import perplexity
    from tessellm.eval.texts import BUNDLED, load_text

    names = list(BUNDLED if texts is None else texts)
    results = {}
    for variant, parts in variants.items():
        key = json.dumps(parts, sort_keys=True)
        missing = [name for name in names if (key, name) not in _measured]
        if missing:
            llm = LLM({"model": "smollm2-135m", "device": "cpu", "dtype": "float32", **parts})
            for name in missing:
                _measured[key, name] = perplexity(llm, load_text(name)[1], window=512, stride=256,
                                                  max_tokens=1024).perplexity
            del llm
        results[variant] = {name: _measured[key, name] for name in names}
    return results
