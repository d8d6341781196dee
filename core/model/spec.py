"""Building a decoder-only model's spec from its Hugging Face config: ``decoder_spec`` reads
the fields most families share; ``spec_from_hf_config`` asks the model plugin serving it.
The spec types themselves (``ModelSpec``, ``LayerAttention``, ``KVShape``, ...) live in
core/interfaces/spec.py, below the interfaces; they are importable from here as before."""

from __future__ import annotations

import dataclasses
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

    return (registry or get_registry()).model_for(config)[1]


ModelSpec.from_hf_config = classmethod(lambda cls, config, registry=None: spec_from_hf_config(config, registry))
"""(``ModelSpec.from_hf_config``, its spelling before the spec types moved below the interfaces.)"""


NORM_EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
"""Config fields ``decoder_spec`` reads the norms' epsilon from, first found first: Llama's
name, then GPT-NeoX's and Phi's, Falcon's, and others'."""


def decoder_spec(config: Any, **fields: Any) -> ModelSpec:
    """A ``ModelSpec`` from the fields most Hugging Face decoder configs share; ``fields``
    override or add to what is read, and a field given is never read from the config (so a
    family whose config lacks one, or names it otherwise, passes it: ``rms_norm_eps=...``).

    Read (each a ``ModelSpec`` field; the config's names in brackets): ``vocab_size``,
    ``hidden_size``, ``intermediate_size``, ``num_layers`` [num_hidden_layers],
    ``num_heads`` [num_attention_heads], ``num_kv_heads`` [num_key_value_heads, else the
    heads], ``head_dim`` [head_dim, else hidden / heads], ``rms_norm_eps`` [the first of
    ``NORM_EPS_FIELDS``], ``norm`` ["layer_norm" when the config has a layer-norm epsilon
    and no rms_norm_eps, else "rms_norm"], ``max_position_embeddings``,
    ``tie_word_embeddings``, ``qkv_bias`` and ``o_bias`` [attention_bias], ``mlp_bias``,
    ``sliding_window`` [with use_sliding_window where present], ``layer_attention``
    [layer_types: a window on "sliding_attention" layers only], ``rope_type`` and
    ``rotary_dim`` [rope_parameters (or rope_scaling): rope_type and
    partial_rotary_factor, also read from the config itself, or rotary_pct; the rotated dims
    are int(head_dim * factor), an even count], ``mlp_activation`` [hidden_act, one of
    ``ACTIVATION_NAMES``] and ``parallel_residual`` [use_parallel_residual]. Not read, only
    given: ``gated_mlp`` (default True), ``qk_norm``, ``moe``, ``mla``, ``scale``,
    ``rope_tables``.

    A field the config lacks and ``fields`` does not give is a ModelLoadError naming it and
    how to pass it; so is a RoPE type whose frequencies depend on the sequence length, an
    activation the MLP does not compute, and a rotary fraction that rotates an odd count."""
    model_type = getattr(config, "model_type", None)
    read = _ConfigReader(config, fields)
    params = _rope_params(config)
    if "rope_type" in fields:
        rope_type = fields["rope_type"]
    else:
        rope_type = _rope_type(params)
    values: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=read("vocab_size"),
        hidden_size=read("hidden_size"),
        intermediate_size=read("intermediate_size"),
        num_layers=read("num_layers", "num_hidden_layers"),
        num_heads=read("num_heads", "num_attention_heads"),
        max_position_embeddings=read("max_position_embeddings"),
        rms_norm_eps=read("rms_norm_eps", *NORM_EPS_FIELDS),
        tie_word_embeddings=read.flag("tie_word_embeddings"),
        qkv_bias=read.flag("qkv_bias", "attention_bias"),
        o_bias=read.flag("o_bias", "attention_bias"),
        mlp_bias=read.flag("mlp_bias"),
        parallel_residual=read.flag("parallel_residual", "use_parallel_residual"),
        rope_type=rope_type,
        hf_config=config,
    )
    heads = values["num_heads"]
    values["num_kv_heads"] = read.optional("num_kv_heads", "num_key_value_heads") or heads
    values["head_dim"] = read.optional("head_dim", "head_dim") or values["hidden_size"] // heads
    if "norm" not in fields:
        layer_norm = not hasattr(config, "rms_norm_eps") and any(hasattr(config, f) for f in NORM_EPS_FIELDS[1:3])
        values["norm"] = "layer_norm" if layer_norm else "rms_norm"
    if "mlp_activation" not in fields:
        values["mlp_activation"] = _activation(config)
    if "rotary_dim" not in fields:
        values["rotary_dim"] = _rotary_dim(config, params, fields.get("head_dim", values["head_dim"]))
    if "sliding_window" not in fields or "layer_attention" not in fields:
        sliding, layers = _windows(config)
        values.update(sliding_window=sliding, layer_attention=layers)
    values.update(fields)
    return ModelSpec(**values)


class _ConfigReader:
    """Reads ``ModelSpec`` fields from a Hugging Face config unless ``given`` has them."""

    def __init__(self, config: Any, given: dict[str, Any]):
        self.config, self.given = config, given

    def optional(self, field: str, *names: str) -> Any:
        if field in self.given:
            return self.given[field]
        return next((getattr(self.config, n) for n in names or (field,)
                     if getattr(self.config, n, None) is not None), None)

    def __call__(self, field: str, *names: str) -> Any:
        value = self.optional(field, *names)
        if value is None:
            looked = " or ".join(names or (field,))
            raise ModelLoadError(f"{getattr(self.config, 'model_type', None)} config has no {looked}; the model "
                                 f"plugin reads it with decoder_spec, which takes it as a keyword where the "
                                 f"config lacks it or names it otherwise: decoder_spec(hf_config, {field}=...)")
        return value

    def flag(self, field: str, *names: str) -> bool:
        return bool(self.optional(field, *names) or False)


def _rope_type(params: dict) -> str:
    """The config's RoPE type, or a ModelLoadError naming the supported ones."""
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    known = ["default", *(t for t in ROPE_INIT_FUNCTIONS if t not in UNSUPPORTED_ROPE)]
    if rope_type not in known:
        why = " (its frequencies depend on sequence length)" if rope_type in UNSUPPORTED_ROPE else ""
        raise ModelLoadError(f"rope_type {rope_type!r} is not supported{why}; supported: {', '.join(known)}")
    return rope_type


def _rotary_dim(config: Any, params: dict, head_dim: int) -> int | None:
    """The dims of each head RoPE rotates from ``partial_rotary_factor`` (in the rope
    parameters, or on the config) or ``rotary_pct``; None: all of them."""
    factor = params.get("partial_rotary_factor")
    for name in ("partial_rotary_factor", "rotary_pct"):
        if factor is None:
            factor = getattr(config, name, None)
    if factor is None or float(factor) == 1.0:
        return None
    rotary = int(head_dim * float(factor))  # transformers' rounding (its rope init functions use the same)
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise ModelLoadError(f"{getattr(config, 'model_type', None)} partial_rotary_factor {factor} rotates "
                             f"{rotary} of {head_dim} head dims; allowed: an even count between 2 and {head_dim}")
    return rotary if rotary < head_dim else None


def _windows(config: Any) -> tuple[int | None, tuple[LayerAttention, ...]]:
    """(the model-wide sliding window, per-layer attention) from ``sliding_window``,
    ``use_sliding_window`` and ``layer_types``."""
    sliding = getattr(config, "sliding_window", None)
    if hasattr(config, "use_sliding_window") and not config.use_sliding_window:
        sliding = None  # the Qwen families carry a window size they do not use unless told
    layer_types = list(getattr(config, "layer_types", None) or [])
    if sliding is not None and "full_attention" in layer_types:
        # windows on some layers only (Gemma 2/3, GPT-OSS; Qwen2 past max_window_layers)
        layers = tuple(LayerAttention(sliding_window=sliding if t == "sliding_attention" else None)
                       for t in layer_types)
        sliding = None
    else:
        layers = ()
    if getattr(config, "is_causal", True) is False:  # a decoder trained to attend both ways (some gte-Qwen2 configs)
        layers = tuple(dataclasses.replace(layer, causal=False) for layer in
                       (layers or [LayerAttention(sliding_window=sliding)] * config.num_hidden_layers))
        sliding = None
    return sliding, layers


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


ACTIVATION_NAMES = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_pytorch_tanh",
                    "gelu_new": "gelu_pytorch_tanh", "gelu_fast": "gelu_pytorch_tanh", "gelu": "gelu", "relu": "relu"}
"""Hugging Face ``hidden_act`` names the MLP serves, and what ``ModelSpec.mlp_activation``
calls them ("gelu_new" and "gelu_fast" are the tanh approximation transformers also calls
gelu_pytorch_tanh; "gelu" is the exact erf form)."""


def _activation(config: Any) -> str:
    """The gated MLP's activation from the config's ``hidden_act``, or a ModelLoadError."""
    name = getattr(config, "hidden_act", None) or "silu"
    if name not in ACTIVATION_NAMES:
        raise ModelLoadError(f"{getattr(config, 'model_type', None)} with hidden_act {name!r} is not supported; "
                             f"supported: {', '.join(ACTIVATION_NAMES)}")
    return ACTIVATION_NAMES[name]
