"""Multi-head latent attention (MLA, DeepSeek-V2/V3) as a building block.

Attention goes through the backend's ``forward_latent``: the block computes each token's
compressed latent and rotary key and each head's query; the backend caches the latent and
chooses how to attend (decompressed or absorbed), so the cache holds ``kv_lora_rank +
qk_rope_head_dim`` values per token and layer. Parameter names follow DeepSeek's
checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessellm.core.interfaces.attention import AttentionBackend, LatentProjection
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.model.contract import checked_call
from tessellm.core.model.decoder import RMSNorm, rotate_half
from tessellm.core.model.spec import ModelSpec


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary dims paired as (0, 1), (2, 3), ... reordered so pairs are (i, i + d/2): the
    even dims, then the odd ones. Applied to queries and keys alike it leaves their dot
    products unchanged, and rotate_half RoPE then rotates each original pair."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentUpProjection(nn.Linear):
    """``kv_b_proj``: the latent's up-projection to every head's key (no rope part) and
    value. A subclass so weight quantizers, which replace plain ``nn.Linear`` layers only,
    leave it in the compute dtype: attention backends read its weight directly."""

    def __init__(self, spec: ModelSpec):
        m = spec.mla
        super().__init__(m.kv_lora_rank, spec.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.num_heads, self.nope, self.v = spec.num_heads, m.qk_nope_head_dim, m.v_head_dim
        self._views: LatentProjection | None = None

    def projection(self) -> LatentProjection:
        """w_uk and w_uv as views of the weight (made once; the weight is fixed after loading)."""
        if self._views is None or self._views.w_uk.data_ptr() != self.weight.data_ptr():
            w = self.weight.view(self.num_heads, self.nope + self.v, -1)
            self._views = LatentProjection(w_uk=w[:, :self.nope], w_uv=w[:, self.nope:])
        return self._views


class LatentAttention(nn.Module):
    """MLA: queries through an optional low-rank ``q_a_proj``/``q_b_proj`` pair (or
    ``q_proj``), one latent per token from ``kv_a_proj_with_mqa`` (normalised by
    ``kv_a_layernorm``) plus a rotary key shared by all heads, and ``kv_b_proj`` that
    up-projects the latent (``LatentUpProjection``)."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        m = spec.mla
        self.layer = layer
        self.mla = m
        self.num_heads = spec.num_heads
        h, heads, bias = spec.hidden_size, spec.num_heads, bool(getattr(spec.hf_config, "attention_bias", False))
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(m.q_lora_rank, heads * m.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, heads * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, m.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6)
        self.kv_b_proj = LatentUpProjection(spec)
        self.o_proj = nn.Linear(heads * m.v_head_dim, h, bias=bias)
        self.backend_checked = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                cache: CacheManager, plan: Any, fused: bool = False) -> torch.Tensor:
        t, m = x.shape[0], self.mla
        if m.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(t, self.num_heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        if m.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe = q_pe * cos[:, None, :] + rotate_half(q_pe) * sin[:, None, :]
        k_pe = k_pe * cos + rotate_half(k_pe) * sin
        latent = torch.cat((c, k_pe), dim=-1)  # [T, kv_lora_rank + rope]: what the cache keeps
        up = self.kv_b_proj.projection()

        def attend() -> torch.Tensor:
            return backend.forward_latent(self.layer, q_nope, q_pe, latent, up, cache.layer(self.layer), plan)

        if self.backend_checked:
            out = attend()
        else:  # the backend's first call: a broken plugin is named here, not deep in a step
            out = checked_call(backend, "forward_latent", q_nope, attend, (t, self.num_heads, m.v_head_dim))
            self.backend_checked = True
        return self.o_proj(out.reshape(t, self.num_heads * m.v_head_dim))
