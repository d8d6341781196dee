"""The attention backend interface: plan once per step, run once per layer."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.interfaces.kv import KVStorage
from tessellm.core.interfaces.spec import LayerAttention, ModelSpec
from tessellm.core.plugin import Plugin, PluginOptions, SelectionContext


FEATURE_WORDS = {
    "sliding_window": "a sliding window",
    "per_layer_window": "sliding windows on some layers only",
    "softcap": "attention logit softcapping",
    "sinks": "attention sinks",
    "bidirectional": "bidirectional (encoder) attention",
    "bidirectional_window": "a symmetric window on bidirectional layers",
    "bidirectional_images": "attention that is bidirectional within each image",
}


FEATURE_SERVERS = {"bidirectional": "sdpa, cascade and flash serve it",
                   "bidirectional_window": "sdpa and cascade serve it",
                   "bidirectional_images": "sdpa serves it"}
"""Which built-in backends serve a feature, where not all of them do (for the reason's hint)."""


@dataclass(frozen=True)
class LatentProjection:
    """How one MLA layer turns a cached latent into its heads' keys and values (plugin API
    1.4): with ``c`` a token's first ``kv_lora_rank`` latent values, head h's key is
    ``cat(w_uk[h] @ c, rope key)`` and its value ``w_uv[h] @ c``.

    w_uk [num_heads, qk_nope_head_dim, kv_lora_rank] and w_uv [num_heads, v_head_dim,
    kv_lora_rank] are views of the layer's ``kv_b_proj`` weight, in the compute dtype. Both
    forms of MLA use them: the naive one up-projects the context, the absorbed one folds
    w_uk into the query and w_uv into the output."""

    w_uk: torch.Tensor
    w_uv: torch.Tensor

    @property
    def kv_lora_rank(self) -> int:
        return self.w_uk.shape[-1]


class AttentionBackend(Plugin):
    """Computes causal attention for a packed batch against the KV cache.

    Contract:
    - ``cache_formats`` / ``cache_dtypes`` name the ``KVLayout`` formats and storage dtypes
      it can read (checked by the default ``unsupported_reasons``); ``head_dims`` the head
      sizes it supports (None: any); ``kv_extras`` the side data it needs the cache to keep
      (plugin API 1.3; e.g. "key_bounds"): the pipeline asks the cache for them and declines
      the backend over a layout without them.
    - ``plan(batch, cache)`` runs once per engine step and returns whatever per-step state
      every layer shares (gather indices, split-K partitions, page selections); it must not
      depend on layer weights.
    - ``forward(layer, q, k, v, kv, plan)`` stores the step's new k, v into ``kv`` (through
      ``kv.store`` or a fused kernel) and returns softmax(q K^T * scale + causal mask) V over
      each sequence's whole context: q [T, num_heads, head_dim], k, v [T, num_kv_heads,
      head_dim] -> [T, num_heads, head_dim]. Query token i of a sequence with context length L
      and query length Q sits at position L - Q + i and sees keys 0..L-Q+i (and, with a
      sliding window W, only the last W of those).
    - ``forward_rotary(layer, q, k, v, cos, sin, kv, plan)`` is ``forward`` for q and k not
      yet rotated by RoPE (the model's fused path on CUDA calls it); by default it rotates
      them with the fused RoPE kernel and calls ``forward``, a backend may fold the rotation
      into its KV store.
    - ``supports_cuda_graphs`` backends also implement ``graph_plan``; their decode steps can
      then be captured and replayed as CUDA graphs (core/model/cuda_graphs.py).
    - ``warm_up_shapes(max_step_tokens, max_model_len)`` names the step shapes, beyond a full
      prefill step and a one-token decode, that the runner must run at start-up on a GPU so
      every kernel variant the backend launches is built then, not inside a request's step.
    - A KV storage is read through ``gather`` or, for a kernel that reads it in place, its
      ``kv_tensors()`` (and ``kv_scales()``), ``latent_tensor()`` for a latent cache, and
      ``key_bounds()`` where the backend asked for them; nothing else of a storage is part
      of the contract.
    - A backend whose ``cache_formats`` include "latent" serves multi-head latent attention
      models (DeepSeek-V2/V3) and implements ``forward_latent`` (plugin API 1.4), which such
      models call instead of ``forward``.
    - Layers differ (plugin API 1.8): ``self.layer_attention(layer)`` is what a layer computes (a
      ``LayerAttention``: its sliding window, logit softcap, whether it has sinks), and
      ``layer_features`` names the ``LAYER_FEATURES`` the backend serves; resolution declines
      it for a model whose layers need another, naming the feature and the layers. A layer
      with sinks calls ``forward(..., sinks=tensor)`` (and ``forward_rotary``): [num_heads]
      sink logits of this rank's query heads, float32. Before 1.8 a backend served the
      model-wide ``sliding_window`` only, and is still taken to.
    """

    kind: ClassVar[str] = "attention"
    cache_formats: ClassVar[frozenset[str]] = frozenset({"kv"})
    cache_dtypes: ClassVar[frozenset[torch.dtype] | None] = None
    head_dims: ClassVar[frozenset[int] | None] = None
    kv_extras: ClassVar[frozenset[str]] = frozenset()
    supports_cuda_graphs: ClassVar[bool] = False
    layer_features: ClassVar[frozenset[str]] = frozenset({"sliding_window"})
    """The ``LAYER_FEATURES`` (tessellm.core.interfaces.spec) this backend serves (plugin API 1.8)."""

    def __init__(self, options: PluginOptions, model: ModelSpec, device: torch.device, dtype: torch.dtype):
        self.options = options
        self.model = model
        self.device = device
        self.dtype = dtype
        self.scale = model.attention_scale
        self.sliding_window = model.sliding_window

    @classmethod
    def unsupported_reasons(cls, ctx: SelectionContext) -> list[str]:
        reasons = super().unsupported_reasons(ctx)
        layout = ctx.kv_layout
        if layout is not None and layout.format not in cls.cache_formats:
            reasons.append(f"reads cache formats {sorted(cls.cache_formats)}, but the cache stores {layout.format!r}")
        if layout is not None and cls.cache_dtypes is not None and layout.dtype not in cls.cache_dtypes:
            reasons.append(f"reads cache dtypes {sorted(str(d) for d in cls.cache_dtypes)}, not {layout.dtype}")
        missing = cls.kv_extras - (layout.extras if layout is not None else frozenset())
        if layout is not None and missing:
            cache = ctx.chosen.get("cache")
            which = f"cache {cache[0].name!r}" if cache else "the cache"
            reasons.append(f"needs the cache to keep {', '.join(sorted(missing))}, which {which} does not "
                           f"(its layout keeps {', '.join(sorted(layout.extras)) or 'no extras'}); choose a cache "
                           f"that keeps {', '.join(sorted(missing))}")
        if cls.head_dims is not None and ctx.model.head_dim not in cls.head_dims:
            reasons.append(f"supports head dims {sorted(cls.head_dims)}, the model has {ctx.model.head_dim}")
        reasons += cls.layer_feature_reasons(ctx.model)
        return reasons

    @classmethod
    def layer_feature_reasons(cls, model: ModelSpec) -> list[str]:
        """One reason per layer feature the model needs and this backend does not serve."""
        reasons = []
        if hasattr(model, "attention_features"):
            needs = model.attention_features()
        else:  # a stand-in for a spec (tests' namespaces): its model-wide window alone
            window = getattr(model, "sliding_window", None)
            needs = {"sliding_window": list(range(getattr(model, "num_layers", 1)))} if window else {}
        for feature, layers in needs.items():
            if feature not in cls.layer_features:
                shown = ", ".join(map(str, layers[:8])) + (", ..." if len(layers) > 8 else "")
                reasons.append(f"does not serve {FEATURE_WORDS[feature]} (layer feature {feature!r}), which "
                               f"{model.model_type!r} needs on layers {shown}; it serves "
                               f"{', '.join(sorted(cls.layer_features)) or 'no layer features'} "
                               f"({FEATURE_SERVERS.get(feature, 'sdpa, cascade and flash serve them all')})")
        return reasons

    def layer_attention(self, layer: int) -> LayerAttention:
        """What ``layer``'s attention computes (window, softcap, sinks)."""
        layers = self.__dict__.get("_layer_attention")
        if layers is None:  # once: every layer of every step asks
            layers = self._layer_attention = tuple(self.model.attention_of(i) for i in range(self.model.num_layers))
        return layers[layer] if layer < len(layers) else self.model.attention_of(layer)

    def plan(self, batch: BatchMetadata, cache: CacheManager) -> Any:
        """Per-step planning shared by all layers; the default plan is the batch itself."""
        return batch

    def graph_plan(self, batch: BatchMetadata, cache: CacheManager, max_seq_len: int) -> Any:
        """A plan for decode batches (one query token per sequence) whose device tensors are
        fixed buffers refilled before each CUDA-graph replay: it must read only ``batch``'s
        tensors, never its host lists, and hold for any context lengths up to ``max_seq_len``."""
        raise NotImplementedError(f"attention backend {self.name!r} does not support CUDA graphs")

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVStorage, plan: Any, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store k, v and attend q to the cached context; see the class contract."""

    def forward_latent(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                       up: LatentProjection, kv: KVStorage, plan: Any) -> torch.Tensor:
        """Multi-head latent attention (plugin API 1.4): store the step's latents and attend.

        q_nope [T, H, qk_nope_head_dim] and q_pe [T, H, rope_dim] (already rotated) are the
        two parts of each head's query; latent [T, kv_lora_rank + rope_dim] is each new
        token's compressed latent followed by its rotated rope key, which ``kv.store(latent
        [:, None], None, slots)`` caches. Head h's keys are cat(up.w_uk[h] @ c, rope key)
        and its values up.w_uv[h] @ c over the context's latents c; the result is causal
        softmax(q K^T * scale) V, [T, H, v_head_dim], with the same positions and masking as
        ``forward``. Backends that do not read latent caches need not implement it."""
        raise NotImplementedError(f"attention backend {self.name!r} does not read latent (MLA) caches")

    def warm_up_shapes(self, max_step_tokens: int, max_model_len: int) -> list[list[tuple[int, int]]]:
        """Dummy batches the start-up warm-up runs besides the runner's own (a full prefill
        step, a one-token decode): each a list of (query tokens, context length after the
        step) per sequence, every context at most ``max_model_len``. None by default."""
        return []

    def forward_rotary(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, kv: KVStorage, plan: Any,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` for q, k not yet rotated: cos, sin [T, head_dim] (the two halves of the
        head dim pair up, as in Llama). q and k may be strided views (of the QKV GEMM's
        output) and may be overwritten."""
        from tessellm.core.model.fused_ops import rotary_  # late: Triton is needed only on this path

        q, k = rotary_(q, cos, sin), rotary_(k, cos, sin)
        if sinks is None:  # a backend before plugin API 1.8 takes no sinks argument
            return self.forward(layer, q, k, v, kv, plan)
        return self.forward(layer, q, k, v, kv, plan, sinks=sinks)
