"""The shape facts of a decoder-only model that every interface reads: ``ModelSpec`` (layers,
heads, KV shape, RoPE, windows, MoE, MLA), each layer's ``LayerAttention`` and the ``KVShape``
a cache allocates. Model plugins build them (core/model/spec.py ``decoder_spec`` reads the
fields most Hugging Face configs share); they sit below the interfaces, importing none."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


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
    """A mixture of experts (core/model/moe.py): on the layers in ``sparse_layers`` the MLP
    is replaced by ``top_k`` of ``num_experts`` routed SwiGLU experts of width
    ``intermediate_size``, plus shared experts (one MLP ``shared_intermediate_size`` wide,
    always on; 0: none), behind a sigmoid gate when ``shared_gate`` (Qwen2-MoE).

    Routing: ``scoring`` "softmax" or "sigmoid" of the router logits; ``score_bias`` adds a
    learned correction (e_score_correction_bias) for choosing, not for weighting.
    ``topk_method`` "greedy" takes the top k; "group_limited_greedy" first keeps the
    ``topk_group`` of ``num_groups`` expert groups with the highest best score; "noaux_tc"
    the groups with the highest sum of their two best biased scores. The chosen scores are
    renormalised to sum to one when ``norm_topk_prob``, then multiplied by
    ``routed_scaling_factor``. ``softmax_after_topk`` instead takes the k largest logits and
    a softmax over those alone."""

    num_experts: int
    top_k: int
    intermediate_size: int
    sparse_layers: frozenset[int]
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    scoring: str = "softmax"
    topk_method: str = "greedy"
    num_groups: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    score_bias: bool = False
    softmax_after_topk: bool = False

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer`` has the mixture of experts (else a dense MLP)."""
        return layer in self.sparse_layers

    @property
    def num_shared_experts(self) -> int:
        """How many experts' width the shared MLP has (DeepSeek's n_shared_experts)."""
        return self.shared_intermediate_size // self.intermediate_size

    @property
    def first_dense_layers(self) -> int:
        """How many leading layers are dense (DeepSeek's first_k_dense_replace)."""
        return min(self.sparse_layers, default=0)


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


LAYER_FEATURES = ("sliding_window", "per_layer_window", "softcap", "sinks", "bidirectional", "bidirectional_window",
                  "bidirectional_images")
"""What a model's layers may ask of an attention backend beyond causal attention at the
model's scale (``LayerAttention``; a backend's ``layer_features`` names those it serves):
"sliding_window", a window on every layer alike (the model-wide ``sliding_window`` that
backends before plugin API 1.8 read); "per_layer_window", windows on some layers only or of
different sizes; "softcap", attention logits capped as ``cap * tanh(s / cap)`` before the
softmax; "sinks", a learned logit per query head in every softmax's denominator;
"bidirectional" (plugin API 1.18), layers whose queries see every key of their sequence, later
ones too (encoders: BERT, ModernBERT); "bidirectional_window", such layers with a symmetric
window (ModernBERT's local layers); "bidirectional_images" (plugin API 1.19), a query inside an image's placeholder span sees
every key of that span too, not only those before it (Gemma 3's images:
``MultimodalBatch.spans``)."""


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention computes (plugin API 1.8): the spec lists one per layer.

    Backend side: ``sliding_window`` (query at position p sees keys at p - W + 1 .. p; None:
    the whole context), ``softcap`` (scores s become cap * tanh(s / cap) after scaling and
    before masking; None: none) and ``sinks`` (the layer's forward passes a [num_heads]
    tensor of sink logits: each head's softmax denominator gains exp(sink); no value).
    ``causal`` False (plugin API 1.18): the query at position p sees every key of its sequence,
    later ones too (an encoder's layer; its sequences run whole, in one step, and keep no
    K/V after it); a window then bounds the distance both ways (keys k with |p - k| < W).
    Model side, for reference: ``rope`` names the rotary table the layer's q and k are
    rotated by (a key of ``ModelSpec.rope_tables``; None: no RoPE on this layer). The
    softmax scale is the model's ``attention_scale`` on every layer."""

    sliding_window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    rope: str | None = "default"
    causal: bool = True


@dataclass(frozen=True)
class VisionSpec:
    """A model that takes images (plugin API 1.19): ``image_token_id``, the placeholder token
    whose input embeddings the image's replace; ``whole_images``, whether an image's tokens
    attend to each other in both directions (Gemma 3), so a prefill chunk never ends inside
    one and the attention backend must serve "bidirectional_images"; ``mrope_section``, for
    3-D rotary positions (Qwen2-VL's M-RoPE), how many of a head's rotary frequencies follow
    the temporal, height and width position (None: 1-D RoPE); ``hf_config``, the whole
    multimodal config (``ModelSpec.hf_config`` is the language model's)."""

    image_token_id: int
    whole_images: bool = False
    mrope_section: tuple[int, ...] | None = None
    hf_config: Any = None


@dataclass(frozen=True)
class ModelSpec:
    """A transformer's shapes and numerics, independent of weights: a decoder's, or an
    encoder's (layers with ``causal`` False; ``rms_norm_eps`` then holds its LayerNorm's eps)."""

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
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3)
    architecture: str = ""  # the model plugin that built this spec
    layer_attention: tuple[LayerAttention, ...] = ()
    """One per layer (``attention_of``); empty: every layer ``sliding_window``, RoPE "default"."""
    rope_tables: tuple[tuple[str, Any], ...] = ()
    """Rotary tables besides "default" (the config's own): (name, config fields overriding
    the rope parameters, e.g. ``{"rope_theta": 10000.0}``), for layers whose RoPE differs."""
    rotary_dim: int | None = None
    """Leading dims of each query/key head RoPE rotates (partial rotary); None: all."""
    scale: float | None = None
    """The softmax scale where it is not head_dim ** -0.5 (Gemma's query_pre_attn_scalar,
    Granite's attention_multiplier); None: the default."""
    mlp_activation: str = "silu"
    """The MLP's activation (``ACTIVATION_NAMES``' values): "silu" (SwiGLU when gated),
    "gelu_pytorch_tanh" (GeGLU, Gemma; also Hugging Face's "gelu_new" and "gelu_fast"),
    "gelu" (the exact erf GELU: GPT-NeoX, Pythia) or "relu"."""
    gated_mlp: bool = True
    """True: the MLP is down(act(gate(x)) * up(x)) (Llama's SwiGLU); False: down(act(up(x)))
    with no gate projection (GPT-2, GPT-NeoX, Phi-2)."""
    norm: str = "rms_norm"
    """The layers' and the final norm: "rms_norm" (weight only) or "layer_norm" (mean
    removed, weight and bias: GPT-NeoX, Phi-2, Falcon). ``rms_norm_eps`` is its epsilon."""
    parallel_residual: bool = False
    """True: each layer adds attention and the MLP computed side by side,
    x + attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX's use_parallel_residual, GPT-J, Falcon);
    False: one after the other, Llama's pre-norm layer."""
    vision: VisionSpec | None = None
    """Set for a model that takes images (its module implements ``VisionModule``); None:
    text only."""

    def attention_of(self, layer: int) -> LayerAttention:
        """What ``layer``'s attention computes (its window, softcap, sinks, RoPE table)."""
        if self.layer_attention:
            return self.layer_attention[layer]
        return LayerAttention(sliding_window=self.sliding_window)

    def attention_features(self) -> dict[str, list[int]]:
        """The ``LAYER_FEATURES`` this model's layers need, each with the layers needing it."""
        layers = [self.attention_of(i) for i in range(self.num_layers)]
        windows = {a.sliding_window for a in layers}
        needs: dict[str, list[int]] = {}
        windowed = [i for i, a in enumerate(layers) if a.sliding_window is not None]
        if windowed:
            needs["per_layer_window" if len(windows) > 1 else "sliding_window"] = windowed
        softcapped = [i for i, a in enumerate(layers) if a.softcap is not None]
        if softcapped:
            needs["softcap"] = softcapped
        sinks = [i for i, a in enumerate(layers) if a.sinks]
        if sinks:
            needs["sinks"] = sinks
        both_ways = [i for i, a in enumerate(layers) if not a.causal]
        if both_ways:
            needs["bidirectional"] = both_ways
            windowed_both_ways = [i for i in both_ways if layers[i].sliding_window is not None]
            if windowed_both_ways:
                needs["bidirectional_window"] = windowed_both_ways
        if self.vision is not None and self.vision.whole_images:
            needs["bidirectional_images"] = list(range(self.num_layers))
        return needs

    @property
    def bidirectional(self) -> bool:
        """Whether some layer attends both ways (an encoder): such a model embeds or scores
        whole sequences, each in one step; it cannot generate."""
        return any(not self.attention_of(i).causal for i in range(self.num_layers))

    @property
    def attention_scale(self) -> float:
        """The softmax scale; YaRN-scaled MLA models multiply it by the square of the
        YaRN attention factor of ``mscale_all_dim``, as DeepSeek does."""
        if self.scale is not None:
            return self.scale
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
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.rotary_dim or self.head_dim

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

    def inv_freq(self, table: str = "default") -> tuple[torch.Tensor, float]:
        """RoPE inverse frequencies [rope_dim / 2] float32 and the cos/sin scaling factor of
        rotary table ``table`` ("default", or a name in ``rope_tables``), computed as
        transformers does so outputs match it exactly."""
        params = dict(_rope_params(self.hf_config))
        if table != "default":
            params.update(dict(self.rope_tables)[table])
        rope_type = params.get("rope_type", params.get("type", self.rope_type)) or "default"
        if rope_type == "default":
            base = params.get("rope_theta", getattr(self.hf_config, "rope_theta", 10000.0))
            dim = self.rope_dim
            return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        config = self.hf_config
        if table != "default":  # a copy whose rope parameters are the table's
            import copy

            config = copy.copy(config)
            config.rope_parameters = params
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        return inv_freq.float(), float(scaling)

    def rope_table_names(self) -> list[str]:
        """The rotary tables some layer uses, in first-use order."""
        names: list[str] = []
        for i in range(self.num_layers):
            rope = self.attention_of(i).rope
            if rope is not None and rope not in names:
                names.append(rope)
        return names


def _rope_params(config: Any) -> dict:
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
