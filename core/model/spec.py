"""The shape facts of a decoder-only model, read from its Hugging Face config: the Llama
family (llama, mistral, qwen2) and DeepSeek-V2/V3 (multi-head latent attention, MoE)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import math

import torch

from tessellm.core.errors import ModelLoadError

LLAMA_ARCHITECTURES = ("llama", "mistral", "qwen2")
MLA_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
SUPPORTED_ARCHITECTURES = LLAMA_ARCHITECTURES + MLA_ARCHITECTURES
UNSUPPORTED_ROPE = ("dynamic", "longrope")  # their frequencies change with sequence length


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention's shapes (DeepSeek-V2/V3).

    Each token's keys and values are up-projected from one compressed latent of
    ``kv_lora_rank`` values plus one rotary key of ``qk_rope_head_dim`` shared by all heads;
    the cache holds those ``latent_dim`` values per token and layer, nothing per head. A
    head's query and key have ``qk_nope_head_dim + qk_rope_head_dim`` values, its value
    ``v_head_dim``. ``rope_interleave``: the checkpoint's rotary dims pair up as (0, 1),
    (2, 3), ... rather than as the two halves."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoESpec:
    """A DeepSeek mixture of experts: layers from ``first_dense_layers`` on replace the MLP
    by ``num_shared_experts`` always-on experts (one MLP of that many times the width) plus
    ``top_k`` of ``num_experts`` routed ones.

    Routing: ``scoring`` "softmax" (V2) or "sigmoid" (V3) of the router logits; V3 adds
    ``score_bias`` (e_score_correction_bias) for choosing, not for weighting. ``topk_method``
    "greedy" takes the top k; "group_limited_greedy" (V2) first keeps the ``topk_group`` of
    ``num_groups`` expert groups with the highest best score; "noaux_tc" (V3) the groups with
    the highest sum of their two best biased scores. Weights are renormalised to sum to one
    when ``norm_topk_prob`` and then multiplied by ``routed_scaling_factor``."""

    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int
    first_dense_layers: int
    scoring: str
    topk_method: str
    num_groups: int | None
    topk_group: int | None
    norm_topk_prob: bool
    routed_scaling_factor: float
    score_bias: bool


@dataclass(frozen=True)
class KVShape:
    """What one token of one layer puts in the KV cache: ``tensors`` vectors (2 for a key
    and a value, 1 for an MLA latent) of ``num_heads`` x ``head_dim`` values."""

    format: str  # a KVLayout format: "kv" or "latent"
    num_heads: int
    head_dim: int

    @property
    def tensors(self) -> int:
        return 1 if self.format == "latent" else 2

    @property
    def values_per_token(self) -> int:
        return self.tensors * self.num_heads * self.head_dim


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shapes and numerics, independent of weights."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    rope_type: str
    hf_config: Any  # transformers PretrainedConfig, for RoPE initialisation
    mla: MLASpec | None = None  # multi-head latent attention (head_dim is then the query/key head size)
    moe: MoESpec | None = None

    @property
    def attention_scale(self) -> float:
        """The softmax scale; YaRN-scaled MLA models multiply it by the square of the
        YaRN attention factor of ``mscale_all_dim``, as DeepSeek does."""
        scale = self.head_dim ** -0.5
        if self.mla is not None and self.rope_type != "default":
            params = _rope_params(self.hf_config)
            all_dim = params.get("mscale_all_dim") or 0
            factor = params.get("factor", 1.0)
            if all_dim and factor > 1:
                mscale = 0.1 * all_dim * math.log(factor) + 1.0
                scale *= mscale * mscale
        return scale

    @property
    def rope_dim(self) -> int:
        """How many dims of a query or key head RoPE rotates."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def kv_shape(self) -> KVShape:
        """What the KV cache stores per token and layer for this model."""
        if self.mla is not None:
            return KVShape("latent", 1, self.mla.latent_dim)
        return KVShape("kv", self.num_kv_heads, self.head_dim)

    @property
    def mha_values_per_token(self) -> int:
        """Values one token of one layer would cache under plain multi-head attention with
        this model's query heads (a key and a value per head, no GQA sharing, no latent): the
        baseline a latent or grouped cache is compared with."""
        v_dim = self.mla.v_head_dim if self.mla is not None else self.head_dim
        return self.num_heads * (self.head_dim + v_dim)

    def inv_freq(self) -> tuple[torch.Tensor, float]:
        """RoPE inverse frequencies [head_dim / 2] float32 and the cos/sin scaling factor,
        computed as transformers does so outputs match it exactly."""
        if self.rope_type == "default":
            params = getattr(self.hf_config, "rope_parameters", None) or {}
            base = params.get("rope_theta", getattr(self.hf_config, "rope_theta", 10000.0))
            dim = self.rope_dim
            return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self.hf_config)
        return inv_freq.float(), float(scaling)

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelSpec":
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"model_type {model_type!r} is not supported; supported: "
                                 f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if model_type in MLA_ARCHITECTURES:  # every head has its own key, up-projected from the latent
            head_dim, kv_heads = config.qk_nope_head_dim + config.qk_rope_head_dim, heads
        params = _rope_params(config)
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        known = ["default", *(t for t in ROPE_INIT_FUNCTIONS if t not in UNSUPPORTED_ROPE)]
        if rope_type not in known:
            why = " (its frequencies depend on sequence length)" if rope_type in UNSUPPORTED_ROPE else ""
            raise ModelLoadError(f"rope_type {rope_type!r} is not supported{why}; supported: {', '.join(known)}")
        sliding = getattr(config, "sliding_window", None)
        if model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
            sliding = None
        layer_types = set(getattr(config, "layer_types", None) or [])
        if sliding is not None and "full_attention" in layer_types:
            # e.g. Qwen2 with max_window_layers < num_hidden_layers: windows on some layers only
            raise ModelLoadError(f"{model_type} with sliding-window attention on some layers and full attention "
                                 f"on others (layer_types {sorted(layer_types)}) is not supported; supported: "
                                 f"the same attention on every layer")
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            sliding_window=sliding,
            rope_type=rope_type,
            hf_config=config,
            mla=_mla_spec(config) if model_type in MLA_ARCHITECTURES else None,
            moe=_moe_spec(config) if model_type in MLA_ARCHITECTURES else None,
        )


def _rope_params(config: Any) -> dict:
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def _mla_spec(config: Any) -> MLASpec:
    if getattr(config, "quantization_config", None):
        method = config.quantization_config.get("quant_method", "?") if isinstance(
            config.quantization_config, dict) else "?"
        raise ModelLoadError(f"{config.model_type} checkpoint quantized with {method!r} is not supported; "
                             f"supported: unquantized (bfloat16/float32) weights, e.g. a bf16 conversion")
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
    return MoESpec(
        num_experts=experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        num_shared_experts=getattr(config, "n_shared_experts", None) or 0,
        first_dense_layers=getattr(config, "first_k_dense_replace", 0) or 0,
        scoring="sigmoid" if v3 else "softmax",
        topk_method=method,
        num_groups=groups,
        topk_group=getattr(config, "topk_group", None),
        # transformers' V2 router never renormalises; V3's does when the config says so
        norm_topk_prob=v3 and bool(getattr(config, "norm_topk_prob", False)),
        routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0)),
        score_bias=v3,
    )
