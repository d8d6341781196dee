"""Prompts with images under memory pressure: a sequence preempted mid-prompt or mid-decode is
recomputed from its prompt, images included, and ends with the tokens it would have had with
room to spare; every block comes back."""

from __future__ import annotations

import numpy as np
import pytest

from tessellm import LLM
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.testing.models import build_tiny_qwen2_vl

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402


def picture(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def make_llm(folder, num_blocks: int, encoder_cache_tokens: int = 4096) -> LLM:
    return LLM({"model": str(folder), "device": "cpu", "dtype": "float32", "decoding": {"name": "greedy"},
                "cache": {"name": "paged", "options": {"block_size": 4, "num_blocks": num_blocks}},
                "scheduler": {"name": "continuous", "options": {"max_num_batched_tokens": 16}},
                "images": {"encoder_cache_tokens": encoder_cache_tokens}})


def test_preempted_image_prompts_are_recomputed_to_the_same_tokens(tmp_path):
    folder = build_tiny_qwen2_vl(tmp_path / "qwen2_vl")
    roomy = make_llm(folder, num_blocks=256)
    marker = roomy.pipeline.image_processor.image_marker
    prompts = [f"t{i} {marker} t{i + 1} t{i + 2}" for i in range(4)]
    images = [[picture(64 + 8 * i, 72, i)] for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, images=images)]

    # no encoder cache: a recomputed prompt encodes its image again
    tight = make_llm(folder, num_blocks=20, encoder_cache_tokens=0)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, images=images)]
    engine = tight.engine
    assert engine.stats.preemptions > 0, "the cache was meant to be too small for all four at once"
    assert got == expected
    assert engine.stats.images_encoded > len(prompts)  # recomputation encoded some image again
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    assert not engine._with_images
