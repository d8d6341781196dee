"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) and a mixture
of experts with one shared expert behind a sigmoid gate; the checkpoint's ``shared_expert``
is the MoE block's ``shared_experts``."""

from __future__ import annotations

from typing import Any

from torch import nn

import tessellm
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.model.decoder import DecoderForCausalLM
from tessellm.core.model.spec import ModelSpec, MoESpec, decoder_spec, refuse_quantized
from tessellm.plugins.model.qwen3 import qwen_sparse_layers


class Qwen2MoeArchitecture(ModelArchitecture):
    """Qwen2-MoE: softmax top-k routing and a shared expert behind a sigmoid gate.

    Dense layers where the config says (``mlp_only_layers``, ``decoder_sparse_step``)."""

    name = "qwen2-moe"
    api_version = "1.19"
    model_types = ("qwen2_moe",)

    def spec(self, hf_config: Any) -> ModelSpec:
        refuse_quantized(hf_config)
        moe = MoESpec(num_experts=hf_config.num_experts, top_k=hf_config.num_experts_per_tok,
                      intermediate_size=hf_config.moe_intermediate_size,
                      sparse_layers=qwen_sparse_layers(hf_config),
                      shared_intermediate_size=getattr(hf_config, "shared_expert_intermediate_size", 0) or 0,
                      shared_gate=True, norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)))
        return decoder_spec(hf_config, qkv_bias=True, o_bias=False, moe=moe)

    def build(self, spec: ModelSpec) -> nn.Module:
        return DecoderForCausalLM(spec)

    def checkpoint_name(self, name: str) -> str | None:
        return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")


@tessellm.hookimpl
def register_model(register):
    register(Qwen2MoeArchitecture)
