"""OLMo 2 and OLMo 3: a post-norm decoder. Each layer normalises what attention and the MLP
return before adding it to the residual (``post_attention_layernorm``,
``post_feedforward_layernorm``; no norm on their inputs), and RMS-normalises the whole query
and key projections (all heads at once, ``q_norm`` over num_heads * head_dim values) before
splitting them into heads and rotating. OLMo 3 adds sliding-window layers (``layer_types``)
whose RoPE parameters may differ from the full layers' (``rope_parameters`` per layer type:
YaRN on the full layers in the released models)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

import tessellm
from tessellm.core.errors import ModelLoadError
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.model.decoder import Attention, DecoderForCausalLM, DecoderLayer, RMSNorm
from tessellm.core.model.spec import UNSUPPORTED_ROPE, LayerAttention, ModelSpec, decoder_spec, refuse_quantized

LAYER_TYPES = ("sliding_attention", "full_attention")
"""OLMo 3's layer types, each with its own rotary table when rope_parameters is per type."""


class Olmo2RMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies in float32 before the cast back (OLMo 2's order;
    Llama's casts first): the same values in float32 and float64, closer in bfloat16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


class ProjectionNorm(Olmo2RMSNorm):
    """OLMo 2's RMSNorm over a whole q or k projection. Under tensor parallelism a rank holds
    some heads' columns: their sum of squares is summed over the ranks (``tp``), divided by
    ``copies`` (the ranks holding each KV head, when they are replicated), and the mean taken
    over the whole projection's ``full_size`` values."""

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        self.tp: Any = None
        self.full_size, self.copies = size, 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(x)
        dtype = x.dtype
        x = x.float()
        squares = self.tp.all_reduce(x.pow(2).sum(-1, keepdim=True)) / self.copies
        x = x * torch.rsqrt(squares / self.full_size + self.eps)
        return (self.weight * x).to(dtype)


class Olmo2Attention(Attention):
    """q/k/v projections, q_norm and k_norm over the whole projections, then heads, RoPE
    and the backend (``Attention.attend``)."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__(spec, layer)
        self.q_norm = ProjectionNorm(self.num_heads * self.head_dim, spec.rms_norm_eps)
        self.k_norm = ProjectionNorm(self.num_kv_heads * self.head_dim, spec.rms_norm_eps)

    def set_tensor_parallel(self, tp: Any, config: Any) -> None:
        """Normalise over the whole projections across ``tp``'s ranks (``config``: the whole
        model's)."""
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        for norm, full in ((self.q_norm, heads), (self.k_norm, kv_heads)):
            norm.tp, norm.full_size = tp, full * self.head_dim
        self.k_norm.copies = max(1, tp.size // kv_heads)  # each KV head on this many ranks

    def fuse_projections(self) -> None:
        """Nothing to stack: q and k are normalised apart."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: Any, cache: Any, plan: Any,
                fused: bool = False) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x)).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_norm(self.k_proj(x)).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attend(q, k, v, cos, sin, backend, cache, plan).reshape(t, -1))


class Olmo2DecoderLayer(DecoderLayer):
    """x + post_attention_layernorm(attn(x)), then + post_feedforward_layernorm(mlp(x))."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__(spec, layer)
        del self.input_layernorm  # OLMo 2 normalises the outputs, not the inputs
        self.post_attention_layernorm = Olmo2RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def make_attention(self, spec: ModelSpec, layer: int) -> nn.Module:
        return Olmo2Attention(spec, layer)

    def forward(self, x, cos, sin, backend, cache, plan):
        x = x + self.post_attention_layernorm(self._reduce(self.self_attn(x, cos, sin, backend, cache, plan)))
        return x + self.post_feedforward_layernorm(self._reduce(self.mlp(x)))


class Olmo2ForCausalLM(DecoderForCausalLM):
    """Olmo2ForCausalLM / Olmo3ForCausalLM: post-norm layers; the fused CUDA path (written
    for pre-norm layers) stays off."""

    layer_cls = Olmo2DecoderLayer

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.model.norm = Olmo2RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def set_tensor_parallel(self, tp: Any) -> None:
        super().set_tensor_parallel(tp)
        for layer in self.held_layers():
            layer.self_attn.set_tensor_parallel(tp, self.spec.hf_config)


class Olmo2Architecture(ModelArchitecture):
    """OLMo 2 (post-norm, whole-projection q/k norms) and OLMo 3 (the same with sliding
    layers and RoPE per layer type)."""

    name = "olmo2"
    api_version = "1.19"
    model_types = ("olmo2", "olmo3")

    def spec(self, hf_config: Any) -> ModelSpec:
        refuse_quantized(hf_config)
        spec = decoder_spec(hf_config)
        params = getattr(hf_config, "rope_parameters", None) or {}
        if not any(isinstance(params.get(t), dict) for t in LAYER_TYPES):
            return spec
        # RoPE per layer type (OLMo 3): each layer reads its type's table; decoder_spec's windows stay
        types = list(hf_config.layer_types)
        tables = tuple((t, _checked_rope(t, params[t])) for t in LAYER_TYPES if t in types)
        layers = tuple(LayerAttention(sliding_window=spec.attention_of(i).sliding_window, rope=types[i])
                       for i in range(spec.num_layers))
        return dataclasses.replace(spec, layer_attention=layers, rope_tables=tables)

    def build(self, spec: ModelSpec) -> nn.Module:
        return Olmo2ForCausalLM(spec)

    def shard_rule(self, name: str, spec: ModelSpec, shard: Any) -> Any:
        """q_norm and k_norm weigh whole projections: each rank reads its heads' share."""
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            (lo, hi) = shard.heads if ".q_norm." in name else shard.kv_heads
            return 0, lo * spec.head_dim, hi * spec.head_dim
        return None


def _checked_rope(layer_type: str, params: dict) -> dict:
    """``params`` (one layer type's RoPE), or a ModelLoadError naming a RoPE type whose
    frequencies depend on the sequence length (what decoder_spec refuses model-wide)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    known = ["default", *(t for t in ROPE_INIT_FUNCTIONS if t not in UNSUPPORTED_ROPE)]
    if rope_type not in known:
        raise ModelLoadError(f"rope_parameters[{layer_type!r}] rope_type {rope_type!r} is not supported; "
                             f"supported: {', '.join(known)}")
    return dict(params)


@tessellm.hookimpl
def register_model(register):
    register(Olmo2Architecture)
