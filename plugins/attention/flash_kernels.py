"""Triton kernels of the `flash` backend: FlashAttention-2's forward over a packed (varlen)
batch whose keys and values live in a paged cache.

One program computes one tile of ``BLOCK_M`` query rows of one sequence for one query head.
It walks the sequence's context ``BLOCK_N`` keys at a time, mapping each key position to its
cache slot through the block table, and keeps FlashAttention's running max and sum so the
full score row never exists. The same kernel serves whole prompts, prefill chunks after
cached context (prefix hits) and decodes (a tile of one row): query i of a sequence with L
keys and Q queries sits at position L - Q + i.

Loads beyond a sequence's length are masked, so a slot that was never written (it may hold
NaN) is never read. Accumulation is float32 whatever the input dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_flash_fwd(
    Q, K, V, Out, BlockTables, QueryStart, SeqLens,
    scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, WINDOW: tl.constexpr, KV_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(QueryStart + seq)
    q_len = tl.load(QueryStart + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    kv_len = tl.load(SeqLens + seq)
    kv_head = head // GROUP

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = kv_len - q_len + offs_m  # absolute position of each query row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # causal: this tile's last row sees keys up to its own position
    hi = tl.minimum(kv_len, kv_len - q_len + (tile + 1) * BLOCK_M)
    lo = 0
    if WINDOW > 0:  # the first row sees only its last WINDOW keys
        lo = tl.maximum(kv_len - q_len + tile * BLOCK_M - WINDOW + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        key_ok = offs_n < kv_len
        block = tl.load(BlockTables + seq * stride_bt + offs_n // KV_BLOCK, mask=key_ok, other=0)
        slot = block.to(tl.int64) * KV_BLOCK + offs_n % KV_BLOCK
        k = tl.load(K + slot[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                    mask=key_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        if UPCAST:
            k = k.to(tl.float32)
        if FP32_DOT:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale
        visible = key_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (q_pos[:, None] - offs_n[None, :] < WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            v = v.to(tl.float32)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_flash_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                          max_query_len: int, scale: float, kv_block_size: int, window: int | None = None,
                          block_m: int = 16, block_n: int = 32) -> torch.Tensor:
    """Attention of packed queries ``q`` [T, Hq, D] over each sequence's cached context.

    ``k_cache``, ``v_cache``: [num_slots, Hkv, D] (slot = block * kv_block_size + offset);
    ``block_tables`` [B, max_blocks] int32; ``query_start`` [B+1] int32; ``seq_lens`` [B]
    int32 (context length after this step, the new tokens included and already stored).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    # Triton's interpreter multiplies bfloat16 dot operands as raw bits (triton-lang/triton
    # issue 11584) and does not round float32 -> bfloat16 to nearest: there, and only there,
    # bfloat16 tiles are widened to float32 and the output is rounded by torch
    upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"
    out = torch.empty_like(q, dtype=torch.float32 if upcast else q.dtype)
    if num_tokens == 0:
        return out.to(q.dtype)
    num_seqs = seq_lens.shape[0]
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _paged_flash_fwd[grid](
        q, k_cache, v_cache, out, block_tables, query_start, seq_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, WINDOW=window or 0, KV_BLOCK=kv_block_size,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
        FP32_DOT=q.dtype == torch.float32 or upcast, UPCAST=upcast,
    )
    return out.to(q.dtype)
