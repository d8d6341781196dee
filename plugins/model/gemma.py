"""Gemma 1, 2 and 3 (its language model): Llama's decoder with Gemma's numerics.

What differs from Llama, as transformers computes it (models/gemma*/modeling_gemma*.py):

- every RMSNorm scales by ``1 + weight`` (the checkpoint stores the offset from one), in
  float32, and casts after the scaling (Llama casts before);
- the input embedding is multiplied by sqrt(hidden_size), rounded to the model's dtype;
- the MLP is GeGLU (tanh-approximated GELU);
- Gemma 2 and 3 norm both ends of each block ("sandwich": ``input_layernorm`` and
  ``post_attention_layernorm`` around attention, ``pre_feedforward_layernorm`` and
  ``post_feedforward_layernorm`` around the MLP), scale attention by
  ``query_pre_attn_scalar ** -0.5`` and interleave sliding-window and global layers
  (``layer_types``);
- Gemma 2 softcaps the attention logits and the final logits (``cap * tanh(x / cap)``);
- Gemma 3 normalises each query and key head (a Gemma RMSNorm over head_dim) before RoPE and
  rotates its sliding and global layers by two tables (``rope_parameters`` per layer type;
  the global one may be linearly scaled). Its final logits are softcapped when the config
  says so; transformers ignores a Gemma 3 ``attn_logit_softcapping``, and so does this plugin.

A multimodal Gemma 3 checkpoint (``gemma3``, Gemma3ForConditionalGeneration) takes images
and text: the spec is its ``text_config``'s with the vision parts of plugins/model/
gemma3_vision.py (SigLIP tower, projector, images attended bidirectionally within
themselves); option ``vision: false`` serves its language model alone, on text prompts,
without loading the tower.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

import tessellm
from tessellm.core.errors import ModelLoadError
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.model.decoder import Attention, DecoderForCausalLM, DecoderLayer
from tessellm.core.model.spec import LayerAttention, ModelSpec, decoder_spec, refuse_quantized
from tessellm.core.plugin import PluginOptions
from tessellm.plugins.model import gemma3_vision

LAYER_TYPES = ("sliding_attention", "full_attention")
"""The Gemma ``layer_types`` this plugin serves (and, for Gemma 3, its rotary table names)."""


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by ``1 + weight``, all in float32, cast to the input's dtype last (as
    transformers' GemmaRMSNorm: in a float64 model too)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(Attention):
    """The decoder's attention with Gemma RMSNorms as the per-head q/k norms (Gemma 3)."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__(spec, layer)
        if spec.qk_norm:
            self.q_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps)


class GemmaDecoderLayer(DecoderLayer):
    """Gemma 1: pre-norm attention and MLP (Llama's layer, Gemma norms). Gemma 2/3: each
    block's output normalised too before it joins the residual (four norms a layer)."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__(spec, layer)
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.sandwich = spec.model_type != "gemma"
        if self.sandwich:
            self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def make_attention(self, spec: ModelSpec, layer: int) -> nn.Module:
        return GemmaAttention(spec, layer)

    def forward(self, x, cos, sin, backend, cache, plan):
        if not self.sandwich:
            return super().forward(x, cos, sin, backend, cache, plan)
        # reduce (tensor parallel) before each output norm: the norm needs the whole sum
        h = self._reduce(self.self_attn(self.input_layernorm(x), cos, sin, backend, cache, plan))
        x = x + self.post_attention_layernorm(h)
        h = self._reduce(self.mlp(self.pre_feedforward_layernorm(x)))
        return x + self.post_feedforward_layernorm(h)


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma's layers, final norm and scaled embedding around the decoder's contract; the
    final logits softcapped where the config says so. The fused CUDA kernels (Llama's norms
    and SwiGLU) do not compute Gemma's, so they stay off."""

    layer_cls = GemmaDecoderLayer

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.model.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.final_softcap = getattr(spec.hf_config, "final_logit_softcapping", None)
        self.adjusts_logits = self.final_softcap is not None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding times sqrt(hidden_size) rounded to the embedding's dtype first (as
        transformers does: 55.4256 becomes 55.5 in bfloat16)."""
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.spec.hidden_size ** 0.5, dtype=x.dtype).item()

    def adjust_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``cap * tanh(logits / cap)`` with the config's final_logit_softcapping."""
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap


class Gemma3VisionForCausalLM(gemma3_vision.Gemma3Vision, GemmaForCausalLM):
    """A multimodal Gemma 3: the decoder, the vision tower and the projector."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        self.add_vision(spec)

    def reset_rotary(self, device: torch.device | None) -> None:
        super().reset_rotary(device)
        if device is not None and hasattr(self, "vision_tower"):  # the tower's own buffers
            self.vision_tower.to(device)
            self.multi_modal_projector.to(device)


class GemmaOptions(PluginOptions):
    """Options of the `gemma` model plugin."""

    vision: bool = True
    """For a multimodal Gemma 3 checkpoint: load its vision tower and take images; false
    serves its language model alone (text prompts, less memory)."""


class GemmaArchitecture(ModelArchitecture):
    """Gemma 1, Gemma 2 and Gemma 3 (Gemma3ForCausalLM, and Gemma3ForConditionalGeneration
    with its images)."""

    name = "gemma"
    api_version = "1.19"
    model_types = ("gemma", "gemma2", "gemma3_text", "gemma3")
    Options = GemmaOptions

    def spec(self, hf_config: Any) -> ModelSpec:
        refuse_quantized(hf_config)
        if hf_config.model_type == "gemma3":  # Gemma3ForConditionalGeneration
            vision = gemma3_vision.vision_spec(hf_config) if self.options.vision else None
            return dataclasses.replace(self.spec(_text_config(hf_config)), vision=vision)
        model_type = hf_config.model_type
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ModelLoadError(f"{model_type} with use_bidirectional_attention (an embedding model) is not "
                                 f"supported; supported: causal {model_type} checkpoints")
        # Gemma 1's MLP reads hidden_act (transformers maps its legacy "gelu" to the tanh GELU);
        # Gemma 2 and 3 read hidden_activation
        activation = getattr(hf_config, "hidden_act" if model_type == "gemma" else "hidden_activation", None)
        if activation != "gelu_pytorch_tanh":
            raise ModelLoadError(f"{model_type} hidden activation {activation!r} is not supported; supported: "
                                 f"gelu_pytorch_tanh")
        fields: dict[str, Any] = dict(mlp_activation="gelu_pytorch_tanh", qkv_bias=hf_config.attention_bias,
                                      o_bias=hf_config.attention_bias, mlp_bias=False)
        if model_type == "gemma":  # Gemma 1: Llama's block otherwise
            return decoder_spec(hf_config, **fields)
        gemma3 = model_type == "gemma3_text"
        # transformers applies no attention softcap in Gemma 3, whatever its config holds
        softcap = None if gemma3 else getattr(hf_config, "attn_logit_softcapping", None)
        layers = _layer_attention(hf_config, softcap, rope_per_type=gemma3)
        windows = {a.sliding_window for a in layers}
        fields.update(layer_attention=layers, scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
                      sliding_window=windows.pop() if len(windows) == 1 else None)
        if gemma3:
            fields.update(qk_norm=True, rope_tables=_rope_tables(hf_config))
        return decoder_spec(hf_config, **fields)

    def build(self, spec: ModelSpec) -> nn.Module:
        return Gemma3VisionForCausalLM(spec) if spec.vision is not None else GemmaForCausalLM(spec)

    def image_processor(self, model_dir: Any, hf_config: Any) -> Any:
        return gemma3_vision.image_processor(model_dir, hf_config)

    def checkpoint_name(self, name: str) -> str | None:
        """A multimodal Gemma 3's language-model tensors under the text model's names (both
        the hub's ``language_model.model.*`` and transformers 5's ``model.language_model.*``);
        its vision tower and projector under theirs, or skipped with ``vision: false``."""
        for prefix in VISION_PREFIXES:
            if name.startswith(prefix):
                if not self.options.vision:
                    return None
                for old, new in gemma3_vision.CHECKPOINT_PREFIXES:
                    if name.startswith(old):
                        return new + name[len(old):]
                return name
        for prefix, target in TEXT_PREFIXES:
            if name.startswith(prefix):
                return target + name[len(prefix):]
        return name


VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                 ("model.language_model.", "model."))


def _text_config(config: Any) -> Any:
    """The language model's config of a multimodal Gemma 3 (a copy of its ``text_config``),
    without a final softcap: Gemma3ForConditionalGeneration applies none, whatever its text
    config holds (the released configs hold none)."""
    import copy

    text = getattr(config, "text_config", None)
    if text is None or getattr(text, "model_type", None) != "gemma3_text":
        raise ModelLoadError(f"gemma3 config without a gemma3_text text_config (got "
                             f"{getattr(text, 'model_type', None)!r}); the gemma plugin serves a multimodal Gemma 3 "
                             f"as its language model")
    refuse_quantized(text)
    text = copy.copy(text)
    text.final_logit_softcapping = None
    root_tie = getattr(config, "tie_word_embeddings", None)
    if root_tie is not None:  # transformers 5 ties the whole model's head as the root config says
        text.tie_word_embeddings = root_tie
    return text


def _layer_attention(config: Any, softcap: float | None, rope_per_type: bool) -> tuple[LayerAttention, ...]:
    """One LayerAttention per layer from ``layer_types``: a window of ``sliding_window`` on
    the sliding layers, ``softcap`` on all; Gemma 3's layers name the rotary table of their
    type (else the config's one table)."""
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ModelLoadError(f"{config.model_type} layer_types {unknown} are not supported; supported: "
                             f"{', '.join(LAYER_TYPES)}")
    window = getattr(config, "sliding_window", None)
    return tuple(LayerAttention(sliding_window=window if t == "sliding_attention" else None,
                                softcap=float(softcap) if softcap is not None else None,
                                rope=t if rope_per_type else "default") for t in types)


def _rope_tables(config: Any) -> tuple[tuple[str, dict], ...]:
    """Gemma 3's rotary tables, one per layer type (``rope_parameters[type]``: the local base
    on sliding layers, the global base, possibly linearly scaled, on full ones)."""
    params = getattr(config, "rope_parameters", None) or {}
    tables = []
    for layer_type in LAYER_TYPES:
        table = params.get(layer_type)
        if not isinstance(table, dict) or "rope_theta" not in table:
            raise ModelLoadError(f"gemma3_text rope_parameters[{layer_type!r}] is {table!r}; expected a dict with "
                                 f"rope_theta (and rope_type)")
        rope_type = table.get("rope_type", table.get("type", "default"))
        if rope_type not in ("default", "linear"):
            raise ModelLoadError(f"gemma3_text rope_type {rope_type!r} on {layer_type} layers is not supported; "
                                 f"supported: default, linear")
        tables.append((layer_type, {**table, "rope_type": rope_type}))
    return tuple(tables)


@tessellm.hookimpl
def register_model(register):
    register(GemmaArchitecture)
