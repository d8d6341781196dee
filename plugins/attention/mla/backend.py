"""Attention `mla`: multi-head latent attention (DeepSeek-V2/V3) over a latent cache.

The cache holds one vector per token and layer, its compressed latent ``c`` followed by its
rotated rope key. Two equivalent forms attend over it:

- naive (decompressed): up-project the context's latents to every head's keys and values
  (``w_uk c``, ``w_uv c``) and run ordinary attention. Cheapest for prefill, where the
  queries outnumber nothing and the per-head keys are computed once per token anyway.
- absorbed: fold ``w_uk`` into the query (``q_nope w_uk``, one kv_lora_rank vector per
  head), attend as multi-query attention over the latents themselves (keys: the whole
  latent, values: its first kv_lora_rank dims) and apply ``w_uv`` to the result. Decode
  reads only the cache, never a per-head key: the memory-bound case MLA was made for.

``form: auto`` runs decode groups (one query token per sequence) absorbed and the rest
(prompts, prefill chunks over a cached prefix, speculative verification) naive; ``naive``
and ``absorbed`` force one form everywhere so the two can be A/B-tested. On CUDA the
absorbed decode runs the Triton split-K kernel of decode_kernel.py over the paged cache in
place; elsewhere it runs in torch over latents gathered by the reference plan (sdpa's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from tessellm.core.interfaces.attention import LatentProjection
from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.interfaces.kv import KVStorage
from tessellm.core.plugin import SelectionContext
from tessellm.plugins.attention.sdpa import SdpaAttention, SdpaOptions, SdpaPlan, _Group


class MlaOptions(SdpaOptions):
    """Options of the `mla` attention backend."""

    form: Literal["auto", "naive", "absorbed"] = "auto"
    """auto: decode tokens absorbed, everything else decompressed (naive); naive or
    absorbed: that form for every token (for A/B tests of the two)."""
    decode_kernel: Literal["auto", "triton", "torch"] = Field("auto")
    """How absorbed decode runs: auto is the Triton kernel on CUDA and torch elsewhere;
    triton off CUDA needs TRITON_INTERPRET=1 (slow; for tests)."""


@dataclass
class _KernelDecodes:
    """The step's decodes for the Triton kernel: packed query rows [B], block tables
    [B, max_blocks] int32, context lengths [B] int32."""

    rows: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


@dataclass
class MlaPlan(SdpaPlan):
    """sdpa's plan (slot mapping, torch groups) plus the decodes the kernel takes, if any."""

    kernel: _KernelDecodes | None = None


class MlaAttention(SdpaAttention):
    """Multi-head latent attention for DeepSeek-V2/V3 models over a "latent" cache (any
    cache that stores one; the paged one with prefix caching, copy-on-write, preemption and
    rollback unchanged). ``forward_latent`` stores the step's latents and attends, in the
    form the options choose; both forms give the same result to rounding."""

    name = "mla"
    api_version = "1.19"
    description = "multi-head latent attention (DeepSeek-V2/V3): naive prefill, absorbed decode (Triton on CUDA)"
    Options = MlaOptions
    auto_priority = 40
    cache_formats = frozenset({"latent"})
    layer_features = frozenset()  # MLA models have no windows, softcaps or sinks
    cache_dtypes = None
    supports_cuda_graphs = False

    @classmethod
    def unsupported_reasons(cls, ctx: SelectionContext) -> list[str]:
        reasons = super().unsupported_reasons(ctx)
        if ctx.model.mla is None:
            reasons.append(f"serves multi-head latent attention models (deepseek_v2, deepseek_v3); "
                           f"{ctx.model.model_type!r} has plain multi-head attention: use sdpa, flash or cascade")
        if cls._uses_kernel(ctx.options, ctx.device) and ctx.device.type != "cuda" and \
                os.environ.get("TRITON_INTERPRET") != "1":
            reasons.append("decode_kernel 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for tests); "
                           "use decode_kernel 'auto' or 'torch'")
        return reasons

    @staticmethod
    def _uses_kernel(options: MlaOptions, device: torch.device) -> bool:
        if options.form == "naive" or options.decode_kernel == "torch":
            return False
        return options.decode_kernel == "triton" or device.type == "cuda"

    # ---------------------------------------------------------------- per step

    def plan(self, batch: BatchMetadata, cache: CacheManager) -> MlaPlan:
        qsl = batch.query_starts_cpu
        members = list(range(batch.num_seqs))
        decodes: list[int] = []
        if self._uses_kernel(self.options, self.device):
            decodes = [i for i in members if batch.query_lens_cpu[i] == 1]
            members = [i for i in members if batch.query_lens_cpu[i] != 1]
        kernel = None
        if decodes:
            idx = torch.tensor(decodes, device=batch.block_tables.device)
            rows = torch.tensor([qsl[i] for i in decodes], device=batch.input_ids.device)
            kernel = _KernelDecodes(rows, batch.block_tables.index_select(0, idx).to(torch.int32),
                                    batch.seq_lens.index_select(0, idx).to(torch.int32))
        return MlaPlan(batch.slot_mapping, self._groups(batch, members, qsl), kernel)

    # ---------------------------------------------------------------- per layer

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: KVStorage, plan: SdpaPlan) -> torch.Tensor:
        raise TypeError("attention 'mla' serves MLA models, which call forward_latent; a model with plain "
                        "K/V heads needs sdpa, flash or cascade")

    def forward_latent(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                       up: LatentProjection, kv: KVStorage, plan: MlaPlan) -> torch.Tensor:
        kv.store(latent[:, None, :], None, plan.slot_mapping)
        t, heads = q_nope.shape[:2]
        out = q_nope.new_empty(t, heads, up.w_uv.shape[1])
        if plan.kernel is not None:
            self._kernel_decode(q_nope, q_pe, up, kv, plan.kernel, out)
        for g in plan.groups:
            absorbed = self.options.form == "absorbed" or (self.options.form == "auto" and g.rows.shape[1] == 1)
            latents = kv.gather(g.slots)[0][:, :, 0].to(q_nope.dtype)  # [B, L, latent_dim]
            attend = absorbed_attention if absorbed else naive_attention
            o = attend(q_nope[g.rows], q_pe[g.rows], latents, up, g, self.scale)  # [B, Q, H, v]
            if g.valid_rows is None:
                out[g.rows.reshape(-1)] = o.reshape(-1, *o.shape[2:])
            else:
                out[g.rows[g.valid_rows]] = o[g.valid_rows]
        return out

    def _kernel_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, up: LatentProjection, kv: KVStorage,
                       d: _KernelDecodes, out: torch.Tensor) -> None:
        from tessellm.plugins.attention.mla.decode_kernel import mla_decode  # late: Triton only on this path

        q_lat = torch.einsum("bhn,hnr->bhr", q_nope[d.rows], up.w_uk)
        q = torch.cat((q_lat, q_pe[d.rows]), dim=-1).contiguous()  # [B, H, kv_lora_rank + rope]
        o_lat = mla_decode(q, kv.latent_tensor(), d.block_tables, d.seq_lens, kv.layout.block_size,
                           up.kv_lora_rank, self.scale)  # [B, H, kv_lora_rank]
        out[d.rows] = torch.einsum("bhr,hvr->bhv", o_lat, up.w_uv)


def naive_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, up: LatentProjection,
                    g: _Group, scale: float) -> torch.Tensor:
    """The decompressed form: q_nope, q_pe [B, Q, H, *], latents [B, L, latent_dim] ->
    [B, Q, H, v_head_dim], with g's mask (or causal flag)."""
    c, k_pe = latents.split([up.kv_lora_rank, latents.shape[-1] - up.kv_lora_rank], dim=-1)
    heads = q_nope.shape[2]
    k_nope = torch.einsum("blr,hnr->bhln", c, up.w_uk)  # [B, H, L, nope]
    values = torch.einsum("blr,hvr->bhlv", c, up.w_uv)  # [B, H, L, v]
    keys = torch.cat((k_nope, k_pe[:, None].expand(-1, heads, -1, -1)), dim=-1)
    query = torch.cat((q_nope, q_pe), dim=-1).transpose(1, 2)  # [B, H, Q, nope + rope]
    o = F.scaled_dot_product_attention(query, keys, values, attn_mask=g.mask, is_causal=g.causal, scale=scale)
    return o.transpose(1, 2)


def absorbed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, up: LatentProjection,
                       g: _Group, scale: float) -> torch.Tensor:
    """The absorbed form: multi-query attention of (q_nope w_uk, q_pe) over the latents
    themselves, then w_uv; same arguments and result as ``naive_attention``. All heads share
    the one latent "head", so they run as extra query rows of a single head: one
    [Q * H, latent] x [latent, L] product per sequence, no per-head copy of the keys."""
    b, q, heads = q_nope.shape[:3]
    q_lat = torch.einsum("bqhn,hnr->bqhr", q_nope, up.w_uk)  # [B, Q, H, kv_lora_rank]
    query = torch.cat((q_lat, q_pe), dim=-1).reshape(b, 1, q * heads, -1)  # rows in (query, head) order
    mask = g.mask
    if mask is None and g.causal:  # a whole prompt alone: query i sees keys 0..i
        mask = torch.ones(q, latents.shape[1], dtype=torch.bool, device=query.device).tril()[None, None]
    if mask is not None:
        mask = mask.repeat_interleave(heads, dim=2)  # [B, 1, Q * H, L]
    keys = latents[:, None]  # [B, 1, L, latent_dim]
    o = F.scaled_dot_product_attention(query, keys, keys[..., :up.kv_lora_rank], attn_mask=mask, scale=scale)
    return torch.einsum("bqhr,hvr->bqhv", o.view(b, q, heads, -1), up.w_uv)
