"""DeepSeek-V2 and V3 decoders: multi-head latent attention (MLA) and DeepSeek's mixture of
experts, over packed batches like the Llama decoder they extend.

Module and parameter names follow Hugging Face's checkpoints (one module per routed expert,
``mlp.experts.{e}.gate_proj``), so a checkpoint's state dict loads as is. Attention goes
through the backend's ``forward_latent``: the model computes each token's compressed latent
and rotary key and each head's query; the backend caches the latent and chooses how to
attend (decompressed or absorbed), so the cache holds ``kv_lora_rank + qk_rope_head_dim``
values per token and layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessellm.core.interfaces.attention import AttentionBackend, LatentProjection
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.model.contract import checked_call
from tessellm.core.model.llama import MLP, DecoderLayer, LlamaForCausalLM, RMSNorm, rotate_half
from tessellm.core.model.spec import ModelSpec, MoESpec


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


class Router(nn.Module):
    """Chooses each token's experts and their weights (``MoESpec`` says how), in float32
    as DeepSeek does. ``weight`` [num_experts, hidden]; V3 adds ``e_score_correction_bias``."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        moe = spec.moe
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, spec.hidden_size))
        if moe.score_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, top_k] int64, weights [T, top_k] float32)."""
        moe = self.moe
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1) if moe.scoring == "softmax" else logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float() if moe.score_bias else scores
        if moe.topk_method != "greedy":
            grouped = choice.view(x.shape[0], moe.num_groups, -1)
            if moe.topk_method == "noaux_tc":  # a group's strength: the sum of its two best experts
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:  # group_limited_greedy: its best expert
                group_scores = grouped.max(dim=-1).values
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(moe.topk_group, dim=-1, sorted=False).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        ids = choice.topk(moe.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * moe.routed_scaling_factor


class MoE(nn.Module):
    """Shared experts (always on) plus the router's top-k routed experts, each a SwiGLU MLP.

    ``forward`` is the plain-torch reference: each expert runs once over the tokens routed to
    it, its output scaled by their routing weights and added in expert order. With
    ``grouped`` set, the routed experts run as one batched product over their stacked
    weights (tokens sorted by expert and padded to the busiest expert's count); its result
    matches the reference to rounding."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        moe: MoESpec = spec.moe
        self.gate = Router(spec)
        self.experts = nn.ModuleList(MLP(spec, moe.intermediate_size) for _ in range(moe.num_experts))
        self.shared_experts = (MLP(spec, moe.intermediate_size * moe.num_shared_experts)
                               if moe.num_shared_experts else None)
        self.grouped = False
        self._stacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        ids, weights = self.gate(x)
        # a quantizer applied after stacking replaces the expert linears: then the stacks are stale
        grouped = self.grouped and type(self.experts[0].down_proj) is nn.Linear
        routed = self._grouped(x, ids, weights) if grouped else self._reference(x, ids, weights)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)

    def _reference(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, pick = torch.where(ids == e)
            y = self.experts[e](x[token]) * weights[token, pick, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def stack_experts(self) -> None:
        """Stack the routed experts' weights for the grouped path (after loading). The
        per-expert modules stay, as the reference, their weights re-pointed at views of the
        stacks so nothing is held twice."""
        linears = [getattr(e, name) for e in self.experts for name in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not nn.Linear or m.bias is not None for m in linears):
            return  # quantized or biased experts keep the reference path
        stacks = []
        for name in ("gate_proj", "up_proj", "down_proj"):
            stack = torch.stack([getattr(e, name).weight for e in self.experts])
            for e, expert in enumerate(self.experts):
                getattr(expert, name).weight = nn.Parameter(stack[e], requires_grad=False)
            stacks.append(stack)
        self._stacked = tuple(stacks)
        self.grouped = True

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate_w, up_w, down_w = self._stacked  # [E, I, H], [E, I, H], [E, H, I]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        expert = flat[order]
        token = order // ids.shape[1]
        counts = torch.bincount(flat, minlength=gate_w.shape[0])
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(flat.numel(), device=x.device) - starts[expert]  # position within its expert
        used = counts.nonzero().squeeze(1)  # only experts with tokens enter the batched product
        slot = torch.full((gate_w.shape[0],), -1, dtype=torch.long, device=x.device)
        slot[used] = torch.arange(used.numel(), device=x.device)
        width = int(counts.max())
        h = x.new_zeros(used.numel(), width, x.shape[1])
        h[slot[expert], rank] = x[token]
        a = torch.bmm(h, gate_w[used].transpose(1, 2))
        b = torch.bmm(h, up_w[used].transpose(1, 2))
        y = torch.bmm(F.silu(a) * b, down_w[used].transpose(1, 2))[slot[expert], rank]  # [T*k, H]
        y = (y * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)


class DeepseekDecoderLayer(DecoderLayer):
    """MLA, then a dense SwiGLU MLP (the first ``first_dense_layers`` layers) or the MoE."""

    def make_attention(self, spec: ModelSpec, layer: int) -> nn.Module:
        return LatentAttention(spec, layer)

    def make_mlp(self, spec: ModelSpec, layer: int) -> nn.Module:
        if spec.moe is not None and layer >= spec.moe.first_dense_layers:
            return MoE(spec)
        return MLP(spec)


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepseekV2ForCausalLM / DeepseekV3ForCausalLM: the Llama decoder's embedding, final
    norm and LM head around MLA + MoE layers; ``forward`` is the same contract. The fused
    CUDA kernels of the Llama path (QKV stacking, fused RoPE) do not apply to MLA."""

    layer_cls = DeepseekDecoderLayer
    supports_fused = False

    def fuse_projections(self) -> None:
        """Nothing to stack: MLA's projections feed different ranks."""

    def stack_experts(self) -> None:
        """Switch every MoE layer to the grouped path (stacked expert weights)."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.stack_experts()
