"""The decoding conformance suite on every built-in decoder: greedy, sample, beam, and speculative
with each proposer (n-gram lookup, layer-skip, a draft model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tessellm.testing.conformance import DecodingConformance
from tessellm.testing.models import noisy_copy


@pytest.fixture(scope="module")
def noisy_draft(tessellm_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's weights plus seeded noise: a draft that agrees with its target only
    some of the time, so verification both accepts and rejects."""
    return noisy_copy(tessellm_tiny_model, tmp_path_factory.mktemp("conformance-noisy-draft"))


class TestGreedy(DecodingConformance):
    plugin = "greedy"


class TestSample(DecodingConformance):
    plugin = "sample"


class TestSpeculativeNgram(DecodingConformance):
    plugin = "speculative"
    options = {"proposer": "ngram", "k": 3, "adaptive_k": False}


class TestSpeculativeLayerSkip(DecodingConformance):
    plugin = "speculative"
    options = {"proposer": "layer-skip", "k": 2, "adaptive_k": False, "draft_layers": [0]}


class TestSpeculativeDraft(DecodingConformance):
    plugin = "speculative"
    # adaptive k would not draft at all with a draft as large as its target
    options = {"proposer": "draft", "k": 2, "adaptive_k": False}

    @pytest.fixture(scope="class")
    @classmethod
    def decoding_options(cls, noisy_draft: Path) -> dict[str, Any]:
        return {**cls.options, "draft_model": str(noisy_draft)}


class TestBeam(DecodingConformance):
    """`beam` decodes requests without beams as `sample` does: the suite holds it to that."""

    plugin = "beam"
