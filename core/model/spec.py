"""Building a decoder-only model's spec from its Hugging Face config: ``decoder_spec`` reads
the fields most families share; ``spec_from_hf_config`` asks the model plugin serving it.
The spec types themselves (``ModelSpec``, ``LayerAttention``, ``KVShape``, ...) live in
core/interfaces/spec.py, below the interfaces; they are importable from here as before."""

from __future__ import annotations

from typing import Any

from tessellm.core.errors import ModelLoadError
from tessellm.core.interfaces.spec import (LAYER_FEATURES, KVShape, LayerAttention, MLASpec, ModelSpec, MoESpec,
                                           VisionSpec, _rope_params)

__all__ = ["LAYER_FEATURES", "KVShape", "LayerAttention", "MLASpec", "ModelSpec", "MoESpec", "VisionSpec", "decoder_spec",
           "quantization_config", "quantized_checkpoint_readers", "refuse_quantized", "spec_from_hf_config"]

UNSUPPORTED_ROPE = ("dynamic", "longrope")  # their frequencies change with sequence length


def spec_from_hf_config(config: Any, registry: Any = None) -> ModelSpec:
    """The spec the model plugin serving ``config.model_type`` builds (looked up in
    ``registry``, default the process-wide one); a ModelLoadError naming the supported
    model types when none serves it."""
    from tessellm.core.registry import get_registry

    return (registry or get_registry()).architecture_for(config).load_spec(config)


ModelSpec.from_hf_config = classmethod(lambda cls, config, registry=None: spec_from_hf_config(config, registry))
"""(``ModelSpec.from_hf_config``, its spelling before the spec types moved below the interfaces.)"""


def decoder_spec(config: Any, **fields: Any) -> ModelSpec:
    """A ``ModelSpec`` from the fields most Hugging Face decoder configs share (Llama's
    names: hidden_size, num_attention_heads, head_dim, num_key_value_heads, rms_norm_eps,
    rope_parameters, sliding_window, attention_bias, mlp_bias, ...); ``fields`` override
    or add to what is read (e.g. ``qkv_bias=True``, ``moe=...``). ``layer_types`` with
    "sliding_attention" and "full_attention" layers give ``layer_attention`` a window on the
    former only (``sliding_window`` is then None). A RoPE type whose frequencies depend on the
    sequence length is a ModelLoadError naming what is supported."""
    model_type = getattr(config, "model_type", None)
    heads = config.num_attention_heads
    params = _rope_params(config)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    known = ["default", *(t for t in ROPE_INIT_FUNCTIONS if t not in UNSUPPORTED_ROPE)]
    if rope_type not in known:
        why = " (its frequencies depend on sequence length)" if rope_type in UNSUPPORTED_ROPE else ""
        raise ModelLoadError(f"rope_type {rope_type!r} is not supported{why}; supported: {', '.join(known)}")
    sliding = getattr(config, "sliding_window", None)
    if hasattr(config, "use_sliding_window") and not config.use_sliding_window:
        sliding = None  # the Qwen families carry a window size they do not use unless told
    layer_types = list(getattr(config, "layer_types", None) or [])
    layers: tuple[LayerAttention, ...] = ()
    if sliding is not None and "full_attention" in layer_types:
        # windows on some layers only (Gemma 2/3, GPT-OSS; Qwen2 past max_window_layers)
        layers = tuple(LayerAttention(sliding_window=sliding if t == "sliding_attention" else None)
                       for t in layer_types)
        sliding = None
    if "mlp_activation" not in fields:
        fields["mlp_activation"] = _activation(config)
    bias = bool(getattr(config, "attention_bias", False))
    values = dict(
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        sliding_window=sliding,
        rope_type=rope_type,
        hf_config=config,
        layer_attention=layers,
    )
    values.update(fields)
    return ModelSpec(**values)


def quantization_config(config: Any) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` as a dict (None: float weights)."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    return dict(quant) if isinstance(quant, dict) else quant.to_dict()


def quantized_checkpoint_readers(quant: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(names of the installed quant plugins that load a checkpoint with ``quant``, each
    other plugin's reason as "name: reason")."""
    from tessellm.core.registry import get_registry

    registry = get_registry()
    readers, reasons = [], []
    for name in registry.names("quant"):
        reason = registry.get("quant", name).cls.checkpoint_support(quant)
        if reason is None:
            readers.append(name)
        else:
            reasons.append(f"{name}: {reason}")
    return readers, reasons


def refuse_quantized(config: Any, supported: str = "unquantized (bfloat16/float16/float32) weights") -> None:
    """A ModelLoadError for a checkpoint whose config declares a quantization method that no
    installed quant plugin loads (``Quantizer.checkpoint_support``), with each one's reason."""
    quant = quantization_config(config)
    if quant is None:
        return
    readers, reasons = quantized_checkpoint_readers(quant)
    if not readers:
        why = "".join(f"; {r}" for r in reasons if "reads no pre-quantized" not in r)
        raise ModelLoadError(f"{config.model_type} checkpoint quantized with {quant.get('quant_method', '?')!r} "
                             f"is not supported{why}; supported: {supported}, or a pre-quantized format a quant "
                             f"plugin reads (tessellm plugins)")


ACTIVATION_NAMES = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_pytorch_tanh"}
"""Hugging Face ``hidden_act`` names the gated MLP serves, and what it calls them."""


def _activation(config: Any) -> str:
    """The gated MLP's activation from the config's ``hidden_act``, or a ModelLoadError."""
    name = getattr(config, "hidden_act", None) or "silu"
    if name not in ACTIVATION_NAMES:
        raise ModelLoadError(f"{getattr(config, 'model_type', None)} with hidden_act {name!r} is not supported; "
                             f"supported: {', '.join(ACTIVATION_NAMES)}")
    return ACTIVATION_NAMES[name]
