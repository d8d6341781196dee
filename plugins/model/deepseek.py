"""DeepSeek-V2 and V3: multi-head latent attention (core/model/mla.py) over a latent cache,
and DeepSeek's mixture of experts (shared experts plus routed ones; V2 softmax routing,
optionally limited to the best expert groups; V3 sigmoid routing with a score-correction
bias and group selection by the two best experts) after ``first_k_dense_replace`` dense
layers."""

from __future__ import annotations

from typing import Any

from torch import nn

import tessellm
from tessellm.core.errors import ModelLoadError
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.model.decoder import DecoderForCausalLM, DecoderLayer
from tessellm.core.model.mla import LatentAttention
from tessellm.core.model.spec import MLASpec, ModelSpec, MoESpec, decoder_spec, refuse_quantized


class DeepseekDecoderLayer(DecoderLayer):
    """MLA, then a dense SwiGLU MLP or the MoE."""

    def make_attention(self, spec: ModelSpec, layer: int) -> nn.Module:
        return LatentAttention(spec, layer)


class DeepseekForCausalLM(DecoderForCausalLM):
    """DeepseekV2ForCausalLM / DeepseekV3ForCausalLM: the decoder's embedding, final norm and
    LM head around MLA + MoE layers; ``forward`` is the same contract. The fused CUDA
    kernels of the Llama path (QKV stacking, fused RoPE) do not apply to MLA."""

    layer_cls = DeepseekDecoderLayer

    def fuse_projections(self) -> None:
        """Nothing to stack: MLA's projections feed different ranks."""


class DeepseekArchitecture(ModelArchitecture):
    """DeepSeek-V2/V3 (MLA + MoE); block-FP8 checkpoints (DeepSeek-V3's own) load through quant fp8."""

    name = "deepseek"
    api_version = "1.19"
    model_types = ("deepseek_v2", "deepseek_v3")

    def spec(self, hf_config: Any) -> ModelSpec:
        refuse_quantized(hf_config, "unquantized (bfloat16/float32) weights, e.g. a bf16 conversion")
        mla = _mla_spec(hf_config)
        # every head has its own key, up-projected from the latent
        return decoder_spec(hf_config, head_dim=mla.qk_head_dim, num_kv_heads=hf_config.num_attention_heads,
                            mla=mla, moe=_moe_spec(hf_config))

    def build(self, spec: ModelSpec) -> nn.Module:
        return DeepseekForCausalLM(spec)


def _mla_spec(config: Any) -> MLASpec:
    return MLASpec(
        q_lora_rank=getattr(config, "q_lora_rank", None),
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        # V2 rotates interleaved pairs always; V3 says so in its config
        rope_interleave=config.model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", True)),
    )


def _moe_spec(config: Any) -> MoESpec | None:
    experts = getattr(config, "n_routed_experts", None)
    if not experts:
        return None
    v3 = config.model_type == "deepseek_v3"
    method = "noaux_tc" if v3 else (getattr(config, "topk_method", None) or "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ModelLoadError(f"{config.model_type} topk_method {method!r} is not supported; supported: "
                             f"greedy, group_limited_greedy (V2), noaux_tc (V3)")
    groups = getattr(config, "n_group", None)
    if method != "greedy" and (not groups or experts % groups):
        raise ModelLoadError(f"{config.model_type} with {method} routing needs n_group dividing "
                             f"n_routed_experts ({experts}), not {groups}")
    first_dense = getattr(config, "first_k_dense_replace", 0) or 0
    return MoESpec(
        num_experts=experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        sparse_layers=frozenset(range(first_dense, config.num_hidden_layers)),
        shared_intermediate_size=config.moe_intermediate_size * (getattr(config, "n_shared_experts", None) or 0),
        scoring="sigmoid" if v3 else "softmax",
        topk_method=method,
        num_groups=groups,
        topk_group=getattr(config, "topk_group", None),
        # transformers' V2 router never renormalises; V3's does when the config says so
        norm_topk_prob=v3 and bool(getattr(config, "norm_topk_prob", False)),
        routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0)),
        score_bias=v3,
    )


@tessellm.hookimpl
def register_model(register):
    register(DeepseekArchitecture)
