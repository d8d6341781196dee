"""Quality bounds of the int8 variants on the real SmolLM2-135M against float32: perplexity
on the first 1,024 tokens of both bundled texts, windows of 512 with stride 256. int8-weight
and the int8 KV cache stay within +1%, w8a8 with SmoothQuant within +3% (docs/benchmarks.md
has the measured figures, on these cases and on the whole texts)."""

from __future__ import annotations

import pytest

from tessellm.eval.texts import BUNDLED
from tessellm.testing.quality import smollm2_perplexities as smollm2_perplexities_of

BOUNDS = {"int8-weight": ({"quant": {"name": "int8-weight"}}, 0.01),
          "w8a8-smoothquant": ({"quant": {"name": "w8a8", "options": {"smoothquant_alpha": 0.5}}}, 0.03),
          "int8-kv": ({"cache": {"name": "paged", "options": {"kv_dtype": "int8"}}}, 0.01)}


TEXTS = [pytest.param(t, marks=pytest.mark.extended) if t != "paradise-lost" else t for t in sorted(BUNDLED)]
"""One text in make test (both texts hold the same relation); the other under make test-all."""


@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.extended) if v == "w8a8-smoothquant" else v
                                     for v in sorted(BOUNDS)])  # w8a8's calibration pass: make test-all
@pytest.mark.parametrize("text", TEXTS)
def test_perplexity_within_the_bound_of_float32(smollm2_dir, variant, text):
    parts, bound = BOUNDS[variant]
    measured = smollm2_perplexities_of({"float32": {}, variant: parts}, [text])
    reference, quantized = measured["float32"][text], measured[variant][text]
    assert quantized <= reference * (1 + bound), (f"{variant} perplexity {quantized:.3f} on {text} is more than "
                                                  f"+{bound:.0%} over float32's {reference:.3f}")
