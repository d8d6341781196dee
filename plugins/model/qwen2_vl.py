"""Qwen2-VL and Qwen2.5-VL: Qwen2's decoder (q/k/v biases) with multimodal RoPE, behind
transformers' own vision transformer (patch embedding, windowed attention blocks, the 2x2
patch merger that projects into the decoder's width), loaded from the checkpoint.

What differs from Qwen2, as transformers computes it (models/qwen2_5_vl/modeling_qwen2_5_vl.py):

- an image is a run of ``<|image_pad|>`` tokens, one per 2x2 merged patch of its resized
  grid (the processor's ``smart_resize``); the vision transformer's outputs replace them;
- M-RoPE: each position is (temporal, height, width). Text tokens have all three equal to
  their index shifted past the images before them; an image's tokens start at the position
  after the text before it, its height and width positions walk its merged grid, and the
  text after it resumes at that start plus the grid's longer side (``get_rope_index``).
  A head's rotary frequencies are cut by ``mrope_section`` into a temporal, a height and a
  width part, each rotated by its own position (core/model/vision.py ``MRotaryEmbedding``);
- after the prompt every position is its index plus the prompt's ``rope_delta``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence as Seq

import numpy as np
import torch
from torch import nn

import tessellm
from tessellm.core.errors import ModelLoadError
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.interfaces.multimodal import ImageInput
from tessellm.core.model.decoder import DecoderForCausalLM
from tessellm.core.model.spec import ModelSpec, VisionSpec, decoder_spec, refuse_quantized
from tessellm.core.model.vision import HFImageProcessor, MRotaryEmbedding, hf_module, load_hf_processor, placeholder_runs


def _vision_classes(model_type: str) -> tuple[type, type]:
    """(vision transformer class, processor class) of ``model_type``, from transformers."""
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
        from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

        return Qwen2_5_VisionTransformerPretrainedModel, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    return Qwen2VisionTransformerPretrainedModel, Qwen2VLProcessor


class Qwen2VLForCausalLM(DecoderForCausalLM):
    """Qwen2's decoder with M-RoPE, and the vision transformer (``visual``) that encodes images."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        config = spec.vision.hf_config
        tower_cls, _ = _vision_classes(config.model_type)
        self.visual = hf_module(lambda: tower_cls(config.vision_config))
        self.merge = config.vision_config.spatial_merge_size

    def reset_rotary(self, device: torch.device | None) -> None:
        """M-RoPE tables; the vision transformer's own buffers to ``device`` too."""
        self.rotaries = {"default": MRotaryEmbedding(self.spec, self.spec.vision.mrope_section).to(device)}
        self.rotary = self.rotaries["default"]
        if device is not None and hasattr(self, "visual"):
            self.visual.to(device)

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """The merged patches of every image in one call, split per image."""
        device, dtype = self.lm_head.weight.device, self.lm_head.weight.dtype
        pixels = torch.cat([image.data["pixel_values"] for image in images]).to(device, dtype)
        grid = torch.cat([image.data["image_grid_thw"] for image in images]).to(device)
        merged = self.visual(pixels, grid_thw=grid).pooler_output  # [sum of tokens, hidden]
        return list(merged.split((grid.prod(-1) // self.merge ** 2).tolist()))

    def rope_positions(self, prompt: list[int], images: Seq[ImageInput]) -> tuple[np.ndarray, int]:
        """transformers' ``get_rope_index`` for one prompt of text and still images."""
        length = len(prompt)
        table = np.empty((3, length), dtype=np.int64)
        at = position = 0
        for image in images:
            text = image.offset - at
            table[:, at:image.offset] = position + np.arange(text)
            position += text
            t, h, w = (int(v) for v in image.data["image_grid_thw"][0])
            h, w = h // self.merge, w // self.merge
            grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
            table[:, image.offset:image.end] = position + grid
            position += max(h, w)
            at = image.end
        table[:, at:] = position + np.arange(length - at)
        return table, int(table.max()) + 1 - length


class Qwen2VLArchitecture(ModelArchitecture):
    """Qwen2-VL and Qwen2.5-VL (…ForConditionalGeneration): images and text."""

    name = "qwen2-vl"
    api_version = "1.19"
    model_types = ("qwen2_vl", "qwen2_5_vl")

    def spec(self, hf_config: Any) -> ModelSpec:
        refuse_quantized(hf_config)
        text = getattr(hf_config, "text_config", None)
        if text is None:
            raise ModelLoadError(f"{hf_config.model_type} config without a text_config; the qwen2-vl plugin reads "
                                 f"transformers 5's layout (any {hf_config.model_type} checkpoint loads into it)")
        section = (getattr(text, "rope_parameters", None) or {}).get("mrope_section")
        if not section or 2 * sum(section) != (getattr(text, "head_dim", None) or
                                                text.hidden_size // text.num_attention_heads):
            raise ModelLoadError(f"{hf_config.model_type} rope_parameters.mrope_section {section!r} does not cover "
                                 f"half the head dim; expected three sizes summing to head_dim / 2")
        vision = VisionSpec(image_token_id=hf_config.image_token_id, mrope_section=tuple(section),
                            hf_config=hf_config)
        tie = getattr(hf_config, "tie_word_embeddings", None)  # the root config's decides, as in transformers 5
        tie = bool(getattr(text, "tie_word_embeddings", False) if tie is None else tie)
        return decoder_spec(text, qkv_bias=True, o_bias=False, vision=vision, tie_word_embeddings=tie)

    def build(self, spec: ModelSpec) -> nn.Module:
        return Qwen2VLForCausalLM(spec)

    def checkpoint_name(self, name: str) -> str | None:
        """transformers 5's names (``model.language_model.*``, ``model.visual.*``) and the hub's
        older ones (``model.*``, ``visual.*``) onto the module's."""
        for prefix, target in (("model.language_model.", "model."), ("model.visual.", "visual.")):
            if name.startswith(prefix):
                return target + name[len(prefix):]
        return name

    def image_processor(self, model_dir: Any, hf_config: Any) -> HFImageProcessor:
        _, processor_cls = _vision_classes(hf_config.model_type)
        processor = load_hf_processor(Path(model_dir), processor_cls)
        token = hf_config.image_token_id

        def split(outputs: dict[str, torch.Tensor], ids: list[int]) -> list[tuple[dict, int, int, Any]]:
            grids = outputs["image_grid_thw"]
            patches = grids.prod(-1).tolist()
            starts = np.cumsum([0, *patches]).tolist()
            return [({"pixel_values": outputs["pixel_values"][starts[i]:starts[i + 1]],
                      "image_grid_thw": grids[i:i + 1]}, a, b - a, None)
                    for i, (a, b) in enumerate(placeholder_runs(ids, token))]

        marker = "<|vision_start|>" + processor.image_token + "<|vision_end|>"
        return HFImageProcessor(processor, marker, split)


@tessellm.hookimpl
def register_model(register):
    register(Qwen2VLArchitecture)
