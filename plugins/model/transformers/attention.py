"""tessellm's attention as a transformers attention function.

transformers' model code computes attention through ``AttentionInterface``: each attention
module calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key,
value, attention_mask, scaling=..., **kwargs)`` with query [batch, Hq, T, Dq], key and value
[batch, Hkv, T, D], and the keyword arguments the model's forward was given. The plugin
registers ``tessellm`` there and builds its models with that implementation, then runs one
packed forward per engine step: input ids and positions [1, T] for all the step's
sequences, and the step's attention (``StepAttention``: backend, cache, plan) in the keyword
argument ``tessellm_step``, which the model hands down to every attention call. The call
reads the layer's index from the module (``layer_idx``) and returns the backend's result
over each sequence's cached context. Masks are not made: an implementation transformers'
mask interface does not know gets none (the backend applies causality and windows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tessellm.core.interfaces.batch import LayerPlans

ATTN_IMPLEMENTATION = "tessellm"
"""The name tessellm's attention is registered under in transformers' AttentionInterface."""
STEP_KWARG = "tessellm_step"
"""The keyword argument of the model's forward that carries the step's attention."""


def tessellm_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (output [1, T, Hq, Dv], no weights)."""
    step = kwargs.pop(STEP_KWARG, None)
    if step is None:
        raise RuntimeError(f"{type(module).__name__} called attention implementation {ATTN_IMPLEMENTATION!r} "
                           f"without {STEP_KWARG!r}: its model does not pass its forward's keyword arguments down "
                           f"to attention")
    return step.attend(module, query, key, value, kwargs), None


def install_attention() -> None:
    """Make ``tessellm`` an attention implementation transformers' models can be built with."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, tessellm_attention)


@dataclass(frozen=True)
class AttentionLayout:
    """How the model's attention calls meet the cache: ``head_dim`` the cache's head size (the
    larger of the query/key and value head sizes, ``qk_dim`` and ``value_dim``: the smaller
    are zero-padded, which changes neither scores nor values; the model gets ``value_dim``
    back), ``scale`` the backend's softmax scale and ``sink_kwarg`` the argument that carries
    per-head sink logits (None: none)."""

    head_dim: int
    qk_dim: int
    value_dim: int
    scale: float
    sink_kwarg: str | None = None


class StepAttention:
    """One engine step's attention, handed to every attention call of the forward."""

    def __init__(self, backend: Any, cache: Any, plan: Any, layout: AttentionLayout):
        self.backend, self.cache, self.plan, self.layout = backend, cache, plan, layout

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kwargs: dict[str, Any]) -> torch.Tensor:
        """The backend's attention for layer ``module.layer_idx``: query [1, Hq, T, Dq], key,
        value [1, Hkv, T, *] -> [1, T, Hq, Dv]."""
        layout, layer = self.layout, module.layer_idx
        if key.shape[2] != query.shape[2]:
            raise RuntimeError(f"layer {layer} of {type(module).__name__} attends to {key.shape[2]} keys for "
                               f"{query.shape[2]} queries: keys of its own besides its tokens', which the KV cache "
                               f"does not hold")
        q = _tokens_first(query, layout.head_dim)  # [T, Hq, D]
        k = _tokens_first(key, layout.head_dim)
        v = _tokens_first(value, layout.head_dim)
        scaling = kwargs.get("scaling") or layout.qk_dim ** -0.5  # transformers' default: the q/k head size's
        if scaling != layout.scale:  # a layer scaled unlike the spec's scale
            q = q * (scaling / layout.scale)
        extra = {}
        if layout.sink_kwarg is not None and kwargs.get(layout.sink_kwarg) is not None:
            sinks = kwargs[layout.sink_kwarg]
            extra["sinks"] = sinks.to(torch.promote_types(sinks.dtype, torch.float32))
        plan = self.plan.for_layer(layer) if type(self.plan) is LayerPlans else self.plan
        out = self.backend.forward(layer, q, k, v, self.cache.layer(layer), plan, **extra)  # [T, Hq, D]
        if layout.value_dim != layout.head_dim:
            out = out[..., :layout.value_dim]
        return out[None]


def _tokens_first(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[1, H, T, d] -> [T, H, head_dim] contiguous, zero-padded past d."""
    x = x[0].transpose(0, 1)
    if x.shape[-1] < head_dim:
        return F.pad(x, (0, head_dim - x.shape[-1]))
    return x.contiguous()
