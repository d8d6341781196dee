"""Mixtral: Mistral's attention and a sparse mixture of experts on every layer (top-2 of 8 in
the released models; softmax, then the chosen weights renormalised). The checkpoint's
``block_sparse_moe.experts.{e}.w1/w3/w2`` are the MoE block's gate/up/down projections."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

import tessellm
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.model.decoder import DecoderForCausalLM
from tessellm.core.model.spec import ModelSpec, MoESpec, decoder_spec, refuse_quantized

_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_PROJECTION = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


class MixtralArchitecture(ModelArchitecture):
    """Mixtral: experts in every layer, no shared expert."""

    name = "mixtral"
    api_version = "1.19"
    model_types = ("mixtral",)

    def spec(self, hf_config: Any) -> ModelSpec:
        refuse_quantized(hf_config)
        moe = MoESpec(num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                      intermediate_size=hf_config.intermediate_size,
                      sparse_layers=frozenset(range(hf_config.num_hidden_layers)), norm_topk_prob=True)
        return decoder_spec(hf_config, moe=moe)

    def build(self, spec: ModelSpec) -> nn.Module:
        return DecoderForCausalLM(spec)

    def checkpoint_name(self, name: str) -> str | None:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return _EXPERT.sub(lambda m: f".experts.{m[1]}.{_PROJECTION[m[2]]}.", name)


@tessellm.hookimpl
def register_model(register):
    register(MixtralArchitecture)
