"""SmolLM3: Llama's decoder with RoPE skipped on some layers (NoPE). transformers' config
lists ``no_rope_layers``, one flag per layer, which despite its name is "use RoPE": layer i
rotates q and k when ``no_rope_layers[i]`` is 1 and not when it is 0 (the released 3B: every
fourth layer without). With ``use_sliding_window`` the layers ``layer_types`` calls
"sliding_attention" see only the last ``sliding_window`` tokens."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

import tessellm
from tessellm.core.errors import ModelLoadError
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.model.decoder import DecoderForCausalLM
from tessellm.core.model.spec import ModelSpec, decoder_spec, refuse_quantized


class SmolLM3Architecture(ModelArchitecture):
    """SmolLM3: per-layer RoPE on or off (``LayerAttention.rope``), optional per-layer windows."""

    name = "smollm3"
    api_version = "1.19"
    model_types = ("smollm3",)

    def spec(self, hf_config: Any) -> ModelSpec:
        refuse_quantized(hf_config)
        spec = decoder_spec(hf_config)
        flags = list(getattr(hf_config, "no_rope_layers", None) or [1] * spec.num_layers)
        if len(flags) != spec.num_layers or any(f not in (0, 1) for f in flags):
            raise ModelLoadError(f"smollm3 no_rope_layers must hold a 0 or 1 per layer ({spec.num_layers} layers; "
                                 f"1: the layer uses RoPE), got {flags}")
        # decoder_spec's window per layer (or the model-wide one), with RoPE where the flag says
        layers = tuple(dataclasses.replace(spec.attention_of(i), rope="default" if flags[i] else None)
                       for i in range(spec.num_layers))
        return dataclasses.replace(spec, layer_attention=layers)

    def build(self, spec: ModelSpec) -> nn.Module:
        return DecoderForCausalLM(spec)


@tessellm.hookimpl
def register_model(register):
    register(SmolLM3Architecture)
