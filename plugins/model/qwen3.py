"""Qwen3 and Qwen3-MoE: Llama's decoder with an RMSNorm over each query and key head before
RoPE; Qwen3-MoE replaces the MLP by a mixture of experts (softmax top-k, renormalised when
``norm_topk_prob``, no shared expert) on every ``decoder_sparse_step``-th layer not in
``mlp_only_layers``."""

from __future__ import annotations

from typing import Any

from torch import nn

import tessellm
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.model.decoder import DecoderForCausalLM
from tessellm.core.model.spec import ModelSpec, MoESpec, decoder_spec, refuse_quantized


def qwen_sparse_layers(hf_config: Any) -> frozenset[int]:
    """The layers the Qwen MoE families give experts: every ``decoder_sparse_step``-th layer
    (counting from 1) that is not in ``mlp_only_layers``."""
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return frozenset(i for i in range(hf_config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)


class Qwen3Architecture(ModelArchitecture):
    """Qwen3 (dense) and Qwen3-MoE: per-head q/k RMSNorm; experts on the sparse layers."""

    name = "qwen3"
    api_version = "1.19"
    model_types = ("qwen3", "qwen3_moe")

    def spec(self, hf_config: Any) -> ModelSpec:
        refuse_quantized(hf_config)
        moe = None
        if hf_config.model_type == "qwen3_moe" and getattr(hf_config, "num_experts", 0):
            moe = MoESpec(num_experts=hf_config.num_experts, top_k=hf_config.num_experts_per_tok,
                          intermediate_size=hf_config.moe_intermediate_size,
                          sparse_layers=qwen_sparse_layers(hf_config),
                          norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)))
        return decoder_spec(hf_config, qk_norm=True, moe=moe)

    def build(self, spec: ModelSpec) -> nn.Module:
        return DecoderForCausalLM(spec)


@tessellm.hookimpl
def register_model(register):
    register(Qwen3Architecture)
