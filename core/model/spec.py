"""The shape facts of a Llama-family model, read from its Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tessellm.core.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
UNSUPPORTED_ROPE = ("dynamic", "longrope")  # their frequencies change with sequence length


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

    @property
    def attention_scale(self) -> float:
        return self.head_dim ** -0.5

    def inv_freq(self) -> tuple[torch.Tensor, float]:
        """RoPE inverse frequencies [head_dim / 2] float32 and the cos/sin scaling factor,
        computed as transformers does so outputs match it exactly."""
        if self.rope_type == "default":
            params = getattr(self.hf_config, "rope_parameters", None) or {}
            base = params.get("rope_theta", getattr(self.hf_config, "rope_theta", 10000.0))
            dim = self.head_dim
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
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
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
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
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
        )
