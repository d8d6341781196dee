"""IBM Granite 3 (model_type "granite"): Llama's block with four scalars from the config:
the input embedding times ``embedding_multiplier``, ``attention_multiplier`` as the softmax
scale (instead of head_dim ** -0.5), each residual branch (attention and MLP output) times
``residual_multiplier`` before it is added, and the logits divided by ``logits_scaling``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import tessellm
from tessellm.core.errors import ModelLoadError
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.model.decoder import DecoderForCausalLM, DecoderLayer
from tessellm.core.model.spec import ModelSpec, decoder_spec, refuse_quantized

MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


class GraniteDecoderLayer(DecoderLayer):
    """Pre-norm attention then MLP, each output times ``residual_multiplier`` before the add."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__(spec, layer)
        self.residual_multiplier = float(spec.hf_config.residual_multiplier)

    def forward(self, x, cos, sin, backend, cache, plan):
        m = self.residual_multiplier
        x = x + self._reduce(self.self_attn(self.input_layernorm(x), cos, sin, backend, cache, plan)) * m
        return x + self._reduce(self.mlp(self.post_attention_layernorm(x))) * m


class GraniteForCausalLM(DecoderForCausalLM):
    """GraniteForCausalLM: scaled embeddings and residuals, logits / logits_scaling (the
    attention scale is the spec's). The fused CUDA path, which adds residuals unscaled,
    stays off."""

    layer_cls = GraniteDecoderLayer
    adjusts_logits = True

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.embedding_multiplier = float(spec.hf_config.embedding_multiplier)
        self.logits_scaling = float(spec.hf_config.logits_scaling)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.embedding_multiplier

    def adjust_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits / self.logits_scaling


class GraniteArchitecture(ModelArchitecture):
    """Granite 3.x dense models: Llama with embedding, attention, residual and logit scalars."""

    name = "granite"
    api_version = "1.19"
    model_types = ("granite",)

    def spec(self, hf_config: Any) -> ModelSpec:
        refuse_quantized(hf_config)
        for field in MULTIPLIERS:
            value = getattr(hf_config, field, None)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ModelLoadError(f"granite config field {field} is {value!r}; it must be a positive number")
        return decoder_spec(hf_config, scale=float(hf_config.attention_multiplier))

    def build(self, spec: ModelSpec) -> nn.Module:
        return GraniteForCausalLM(spec)


@tessellm.hookimpl
def register_model(register):
    register(GraniteArchitecture)
