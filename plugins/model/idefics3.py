"""Idefics3 and SmolVLM: a LLaVA-style model, Llama's decoder behind transformers' own SigLIP
vision transformer and pixel-shuffle connector, loaded from the checkpoint.

As transformers computes it (models/idefics3/modeling_idefics3.py, models/smolvlm/):

- the processor cuts a large image into a grid of tiles of the tower's input size plus one
  downscaled global view; each tile becomes ``image_seq_len`` ``<image>`` placeholders after
  ``<fake_token_around_image><row_i_col_j>`` (the global view's after ``<global-img>``), so one
  image is several placeholder runs with separator tokens between them;
- the tower encodes every tile (a pixel mask marks padding), the connector pixel-shuffles
  each tile's patches by ``scale_factor`` and projects them to the decoder's width; the
  tiles' embeddings, in order, replace the image's placeholders;
- the decoder is Llama's (``text_config``), causal over images too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import tessellm
from tessellm.core.errors import ModelLoadError
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.interfaces.multimodal import ImageInput
from tessellm.core.model.decoder import DecoderForCausalLM
from tessellm.core.model.spec import ModelSpec, VisionSpec, decoder_spec, refuse_quantized
from tessellm.core.model.vision import HFImageProcessor, hf_module, load_hf_processor, placeholder_runs


def _classes(model_type: str) -> tuple[type, type, type]:
    """(vision transformer, connector, processor) classes of ``model_type``, from transformers."""
    if model_type == "smolvlm":
        from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector, SmolVLMVisionTransformer
        from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor

        return SmolVLMVisionTransformer, SmolVLMConnector, SmolVLMProcessor
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    return Idefics3VisionTransformer, Idefics3Connector, Idefics3Processor


class Idefics3ForCausalLM(DecoderForCausalLM):
    """Llama's decoder, the vision transformer (``vision_model``) and the ``connector``."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        config = spec.vision.hf_config
        tower_cls, connector_cls, _ = _classes(config.model_type)
        self.vision_model = hf_module(lambda: tower_cls(config.vision_config))
        self.connector = hf_module(lambda: connector_cls(config))
        self.patch_size = config.vision_config.patch_size

    def reset_rotary(self, device: torch.device | None) -> None:
        super().reset_rotary(device)
        if device is not None and hasattr(self, "vision_model"):  # the tower's own buffers
            self.vision_model.to(device)
            self.connector.to(device)

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Every tile of every image in one call; each image's tiles' embeddings, in order."""
        weight = self.lm_head.weight
        pixels = torch.cat([image.data["pixel_values"] for image in images]).to(weight.device, weight.dtype)
        mask = torch.cat([image.data["pixel_attention_mask"] for image in images]).to(weight.device)
        p = self.patch_size
        patches = mask.unfold(1, p, p).unfold(2, p, p)  # [tiles, H / p, W / p, p, p]
        hidden = self.vision_model(pixel_values=pixels, patch_attention_mask=patches.sum(dim=(-1, -2)) > 0)
        features = self.connector(hidden.last_hidden_state)  # [tiles, image_seq_len, hidden]
        tiles = [image.data["pixel_values"].shape[0] for image in images]
        return [f.reshape(-1, f.shape[-1]) for f in features.split(tiles)]

    def rope_positions(self, prompt: list[int], images: Any) -> None:
        return None


class Idefics3Architecture(ModelArchitecture):
    """Idefics3 and SmolVLM (…ForConditionalGeneration): images and text."""

    name = "idefics3"
    api_version = "1.19"
    model_types = ("idefics3", "smolvlm")

    def spec(self, hf_config: Any) -> ModelSpec:
        refuse_quantized(hf_config)
        text = getattr(hf_config, "text_config", None)
        if text is None or getattr(text, "model_type", None) not in ("llama", "mistral"):
            raise ModelLoadError(f"{hf_config.model_type} with a {getattr(text, 'model_type', None)!r} text model is not "
                                 f"supported; supported: a llama or mistral text_config")
        tie = getattr(hf_config, "tie_word_embeddings", None)  # the root config's decides, as in transformers 5
        tie = bool(getattr(text, "tie_word_embeddings", False) if tie is None else tie)
        vision = VisionSpec(image_token_id=hf_config.image_token_id, hf_config=hf_config)
        return decoder_spec(text, vision=vision, tie_word_embeddings=tie)

    def build(self, spec: ModelSpec) -> nn.Module:
        return Idefics3ForCausalLM(spec)

    def checkpoint_name(self, name: str) -> str | None:
        for prefix, target in (("model.text_model.", "model."), ("model.vision_model.", "vision_model."),
                               ("model.connector.", "connector.")):
            if name.startswith(prefix):
                return target + name[len(prefix):]
        return name

    def image_processor(self, model_dir: Any, hf_config: Any) -> HFImageProcessor:
        processor = load_hf_processor(Path(model_dir), _classes(hf_config.model_type)[2])
        token = hf_config.image_token_id
        global_tag = processor.tokenizer.convert_tokens_to_ids("<global-img>")

        def split(outputs: dict[str, torch.Tensor], ids: list[int]) -> list[tuple[dict, int, int, Any]]:
            pixels, mask = outputs["pixel_values"][0], outputs["pixel_attention_mask"][0]
            parts, tiles, first = [], 0, None
            for a, b in placeholder_runs(ids, token):  # an image ends with its global view's run
                first = a if first is None else first
                tiles += 1
                if a > 0 and ids[a - 1] == global_tag:
                    span = np.asarray(ids[first:b])
                    used = sum(p[0]["pixel_values"].shape[0] for p in parts)
                    parts.append(({"pixel_values": pixels[used:used + tiles],
                                   "pixel_attention_mask": mask[used:used + tiles]}, first, b - first,
                                  tuple(np.nonzero(span == token)[0].tolist())))
                    tiles, first = 0, None
            return parts

        return HFImageProcessor(processor, processor.image_token, split)


@tessellm.hookimpl
def register_model(register):
    register(Idefics3Architecture)
