"""QUEST's page scoring, top-K selection and sparse attention over the chosen blocks, in
plain torch (the CPU path, and the reference the GPU kernels are held to).

A page is a cache block. Its score for a query q is the sum over channels of
max(q_i * max_i, q_i * min_i), with the block's elementwise key minimum and maximum: an upper
bound of q . k for every key k in the block. It splits into two matmuls, since the larger
product takes the maximum where q_i > 0 and the minimum where q_i < 0:
score = relu(q) . max - relu(-q) . min.
"""

from __future__ import annotations

import torch

from tessellm.core.interfaces.kv import KVStorage


def block_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bounds of q . k per block and query head: q [B, R, Hkv, G, D] (R query
    positions, G query heads per KV head), kmin, kmax [B, N, Hkv, D] (the bounds of each
    sequence's N blocks) -> [B, R, Hkv, G, N], in float32 or wider."""
    acc = torch.promote_types(q.dtype, torch.float32)
    qh = q.to(acc).permute(0, 2, 1, 3, 4)  # [B, Hkv, R, G, D]
    b, hkv, r, g, d = qh.shape
    qh = qh.reshape(b, hkv, r * g, d)
    hi = kmax.to(acc).permute(0, 2, 3, 1)  # [B, Hkv, D, N]
    lo = kmin.to(acc).permute(0, 2, 3, 1)
    scores = torch.matmul(qh.clamp(min=0), hi) - torch.matmul((-qh).clamp(min=0), lo)  # [B, Hkv, R*G, N]
    return scores.view(b, hkv, r, g, -1).permute(0, 2, 1, 3, 4)


def select_blocks(scores: torch.Tensor, block_ok: torch.Tensor, forced: torch.Tensor,
                  num_chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks each (sequence, KV head) attends: ``forced`` ones always, then the best
    scored, ``num_chosen[b]`` in all for sequence b (never more than it has).

    scores [B, R, Hkv, G, N]; block_ok, forced [B, N] bool; num_chosen [B] int. A KV head's
    block score is the largest over its query positions and query heads (a block any of them
    may need is kept). Returns (index [B, Hkv, K] block columns in ascending order, chosen_ok
    [B, Hkv, K]) with K = min(max(num_chosen), N); a column past what a sequence chose or
    has comes back with chosen_ok False.
    """
    per_head = scores.amax(dim=(1, 3))  # [B, Hkv, N]
    per_head = per_head.masked_fill(forced[:, None, :], float("inf"))
    per_head = per_head.masked_fill(~block_ok[:, None, :], float("-inf"))
    k = min(int(num_chosen.max()), per_head.shape[-1])
    ranked = per_head.topk(k, dim=-1).indices  # best first: the forced (+inf) lead
    ok = block_ok[:, None, :].expand_as(per_head).gather(-1, ranked)
    ok &= torch.arange(k, device=ranked.device) < num_chosen[:, None, None]
    index, order = ranked.sort(dim=-1)
    return index, ok.gather(-1, order)


def gather_heads(kv: KVStorage, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of each KV head at its own slots: slots [B, Hkv, S] -> [B, Hkv, S, D] each, in
    ``dtype`` (the compute dtype), read in place through ``kv_tensors`` (and ``kv_scales``
    for int8, dequantized as ``gather`` does)."""
    k_all, v_all = kv.kv_tensors()
    heads = torch.arange(slots.shape[1], device=slots.device)[None, :, None]
    k, v = k_all[slots, heads], v_all[slots, heads]
    if k_all.dtype == torch.int8:
        k_scale, v_scale = kv.kv_scales()
        k = (k.float() * k_scale[slots, heads].float()).to(dtype)
        v = (v.float() * v_scale[slots, heads].float()).to(dtype)
    return k.to(dtype), v.to(dtype)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_pos: torch.Tensor,
                     key_ok: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q [B, R, Hkv, G, D] over each KV head's own keys k, v [B, Hkv, S, D]
    at positions key_pos [B, Hkv, S] (``key_ok`` [B, Hkv, S] marks real ones); query r sits at
    q_pos [B, R] and sees keys at or before it. -> [B, R, Hkv, G, D]."""
    acc = torch.promote_types(q.dtype, torch.float32)
    b, r, hkv, g, d = q.shape
    qh = q.to(acc).permute(0, 2, 1, 3, 4).reshape(b, hkv, r * g, d)
    s = torch.matmul(qh, k.to(acc).transpose(-1, -2)) * scale  # [B, Hkv, R*G, S]
    seen = key_ok[:, :, None, :] & (key_pos[:, :, None, :] <= q_pos[:, None, :, None])  # [B, Hkv, R, S]
    seen = seen[:, :, :, None, :].expand(b, hkv, r, g, seen.shape[-1]).reshape(b, hkv, r * g, -1)
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
    o = torch.matmul(p, v.to(acc))  # [B, Hkv, R*G, D]
    return o.view(b, hkv, r, g, d).permute(0, 2, 1, 3, 4)
