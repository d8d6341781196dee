"""Gemma 3's images (Gemma3ForConditionalGeneration), for the `gemma` model plugin: the SigLIP
vision tower and the multimodal projector, transformers' own modules loaded from the
checkpoint, in front of Gemma's decoder.

As transformers computes it (models/gemma3/modeling_gemma3.py):

- an image is resized to the tower's square input and becomes ``mm_tokens_per_image``
  ``<image_soft_token>`` placeholders between ``<start_of_image>`` and ``<end_of_image>``
  (the processor expands each ``<start_of_image>`` in the prompt);
- the projector average-pools the tower's patch grid to that many tokens, normalises them
  (a Gemma RMSNorm) and projects them to the decoder's width; they replace the placeholders'
  embeddings unscaled (the text tokens' embeddings are scaled by sqrt(hidden));
- an image's placeholders attend to each other in both directions, on every layer (the
  sliding ones within their window), while text stays causal: the spec's
  ``VisionSpec.whole_images``, which makes a prefill chunk take an image whole and asks the
  attention backend for "bidirectional_images".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.multimodal import ImageInput
from tessellm.core.model.spec import ModelSpec, VisionSpec
from tessellm.core.model.vision import HFImageProcessor, hf_module, load_hf_processor, placeholder_runs


def image_token_id(config: Any) -> int:
    return getattr(config, "image_token_id", None) or config.image_token_index


def vision_spec(config: Any) -> VisionSpec:
    """A multimodal Gemma 3's images: whole (bidirectional within each), 1-D RoPE."""
    return VisionSpec(image_token_id=image_token_id(config), whole_images=True, hf_config=config)


class Gemma3Vision:
    """What a multimodal Gemma 3's module adds to the decoder (a mixin over
    ``GemmaForCausalLM``): ``vision_tower`` and ``multi_modal_projector``, and the encoder."""

    def add_vision(self, spec: ModelSpec) -> None:
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        config = spec.vision.hf_config
        self.vision_tower = hf_module(lambda: AutoModel.from_config(config.vision_config))
        self.multi_modal_projector = hf_module(lambda: Gemma3MultiModalProjector(config))

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Every image's ``mm_tokens_per_image`` embeddings, all images in one call."""
        weight = self.lm_head.weight
        pixels = torch.cat([image.data["pixel_values"] for image in images]).to(weight.device, weight.dtype)
        hidden = self.vision_tower(pixel_values=pixels).last_hidden_state
        return list(self.multi_modal_projector(hidden))  # each [mm_tokens_per_image, hidden]

    def rope_positions(self, prompt: list[int], images: Any) -> None:
        return None


CHECKPOINT_PREFIXES = (("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."))
"""transformers 5's names of the vision parts (the hub's older ones, without ``model.``, are the module's)."""


def image_processor(model_dir: Any, config: Any) -> HFImageProcessor:
    """Gemma3Processor of the checkpoint: one pixel tensor and one placeholder run per image.
    Pan-and-scan crops (each its own run, attended both ways alone) are off, as in
    transformers' processor unless its call asks for them; should crops appear, the prompt
    is refused naming them, never served as one image."""
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    processor = load_hf_processor(Path(model_dir), Gemma3Processor)
    token = image_token_id(config)

    def split(outputs: dict[str, torch.Tensor], ids: list[int]) -> list[tuple[dict, int, int, Any]]:
        pixels = outputs["pixel_values"]
        runs = placeholder_runs(ids, token)
        if len(runs) != pixels.shape[0] or "num_crops" in outputs and int(outputs["num_crops"].sum()) > 0:
            raise InvalidRequestError("the checkpoint's image processor cut an image into pan-and-scan crops "
                                      "(do_pan_and_scan), which the gemma plugin does not serve; turn "
                                      "do_pan_and_scan off", field="images")
        return [({"pixel_values": pixels[i:i + 1]}, a, b - a, None) for i, (a, b) in enumerate(runs)]

    return HFImageProcessor(processor, processor.boi_token, split)
