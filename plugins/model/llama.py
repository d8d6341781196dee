"""The Llama family: Llama 2/3 (and SmolLM), Mistral (sliding window) and Qwen2 (q/k/v
biases): the plain decoder of core/model, names as the checkpoints have them."""

from __future__ import annotations

from typing import Any

from torch import nn

import tessellm
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.model.decoder import DecoderForCausalLM
from tessellm.core.model.spec import ModelSpec, decoder_spec, refuse_quantized


class LlamaArchitecture(ModelArchitecture):
    """Llama, Mistral and Qwen2: pre-norm attention (RoPE, GQA, optional window) and SwiGLU."""

    name = "llama"
    api_version = "1.19"
    model_types = ("llama", "mistral", "qwen2")

    def spec(self, hf_config: Any) -> ModelSpec:
        refuse_quantized(hf_config)
        if hf_config.model_type == "qwen2":  # biases on q, k and v, none on o
            return decoder_spec(hf_config, qkv_bias=True, o_bias=False)
        return decoder_spec(hf_config)

    def build(self, spec: ModelSpec) -> nn.Module:
        return DecoderForCausalLM(spec)


@tessellm.hookimpl
def register_model(register):
    register(LlamaArchitecture)
