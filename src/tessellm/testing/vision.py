"""Checking a vision model plugin against transformers: seeded test images, and transformers'
greedy tokens for a prompt with images through the checkpoint's own processor (the class the
plugin loads), compared with tessellm's by ``assert_same_greedy`` (equal, or a first
divergence only at a near-tie of the reference's two best logits)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessellm.testing.equivalence import assert_close_in_float32, greedy_divergence

_MODELS: dict[Path, Any] = {}


def picture(height: int, width: int, seed: int) -> Any:
    """A PIL RGB image of ``height`` x ``width`` seeded random pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def reference_model(folder: Path) -> Any:
    """transformers' image-text-to-text model of ``folder`` in float32 (kept across calls)."""
    from transformers import AutoModelForImageTextToText

    if folder not in _MODELS:
        model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # tessellm's side ignores EOS: run to max_tokens
        _MODELS[folder] = model
    return _MODELS[folder]


def reference_inputs(llm: Any, text: str, images: list) -> dict[str, torch.Tensor]:
    """The checkpoint's processor's tensors for ``text`` and ``images`` (BOS as a raw prompt gets)."""
    processor = llm.pipeline.image_processor.processor
    return dict(processor(text=[text], images=[images] if images else None, return_tensors="pt",
                          add_special_tokens=True))


def transformers_greedy(llm: Any, text: str, images: list, max_tokens: int) -> list[int]:
    """transformers' ``generate`` greedy tokens after the prompt."""
    inputs = reference_inputs(llm, text, images)
    with torch.no_grad():
        out = reference_model(llm.pipeline.model_dir).generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def assert_same_greedy(llm: Any, text: str, images: list, ours: list[int],
                       first_top: list[tuple[int, float]] | None = None) -> str | None:
    """tessellm's greedy tokens ``ours`` equal transformers' for the prompt, or first differ at a
    near-tie (the report, else an assertion error). ``first_top``: tessellm's (id, logprob)
    of the best tokens after the prompt (``TokenLogprob.top``), which must equal
    transformers' within float32 rounding: logits see what tokens often do not (an image's
    attention mask, say, on a tiny model whose greedy tokens repeat)."""
    if first_top:
        reference = torch.log_softmax(_logits(llm, reference_inputs(llm, text, images)).double(), dim=-1)
        ids = [token for token, _ in first_top]
        assert_close_in_float32(torch.tensor([lp for _, lp in first_top]), reference[ids], f"{text}: logprobs",
                                scale=1e-4)
    expected = transformers_greedy(llm, text, images, len(ours))
    inputs = reference_inputs(llm, text, images)

    def logits_after(prefix: list[int]) -> torch.Tensor:
        return _logits(llm, inputs, prefix)

    return greedy_divergence(ours, expected, logits_after, where=text)


def _logits(llm: Any, inputs: dict[str, torch.Tensor], prefix: list[int] = ()) -> torch.Tensor:
    """transformers' last logits [vocab] for the processed prompt ``inputs`` then ``prefix``."""
    extended = dict(inputs)
    extra = torch.tensor([list(prefix)], dtype=torch.long)
    extended["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
    for name in ("attention_mask", "token_type_ids", "mm_token_type_ids"):
        if name in inputs:  # generated tokens are text
            fill = torch.ones_like(extra) if name == "attention_mask" else torch.zeros_like(extra)
            extended[name] = torch.cat([inputs[name], fill], dim=1)
    with torch.no_grad():
        return reference_model(llm.pipeline.model_dir)(**extended).logits[0, -1]
