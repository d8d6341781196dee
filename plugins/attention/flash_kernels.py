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
    Q, K, V, Out, BlockTables, QueryStart, QueryLens, SeqLens,
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
    q_len = tl.load(QueryLens + seq)
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


def paged_flash_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                          block_tables: torch.Tensor, query_start: torch.Tensor, query_lens: torch.Tensor,
                          seq_lens: torch.Tensor, max_query_len: int, scale: float, kv_block_size: int,
                          window: int | None = None, block_m: int = 16, block_n: int = 32) -> None:
    """Attention of packed queries ``q`` [T, Hq, D] over each sequence's cached context,
    written into ``out`` at the same rows.

    ``k_cache``, ``v_cache``: [num_slots, Hkv, D] (slot = block * kv_block_size + offset);
    per sequence (any subset of the batch, in any order): ``block_tables`` [B, max_blocks],
    ``query_start`` [B] (first packed row), ``query_lens`` [B], ``seq_lens`` [B] (context
    length after this step, the new tokens included and already stored); all int32.
    """
    num_seqs = seq_lens.shape[0]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    # Triton's interpreter multiplies bfloat16 dot operands as raw bits (triton-lang/triton
    # issue 11584) and does not round float32 -> bfloat16 to nearest: there, and only there,
    # bfloat16 tiles are widened to float32 and the output is rounded by torch
    upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"
    if num_tokens == 0 or num_seqs == 0:
        return
    target = out if not upcast else torch.empty_like(out, dtype=torch.float32)
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _paged_flash_fwd[grid](
        q, k_cache, v_cache, target, block_tables, query_start, query_lens, seq_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), target.stride(0), target.stride(1),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, WINDOW=window or 0, KV_BLOCK=kv_block_size,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
        FP32_DOT=q.dtype == torch.float32 or upcast, UPCAST=upcast,
    )
    if upcast:  # only this call's rows: others may belong to the decode kernel
        rows = torch.cat([torch.arange(int(a), int(a) + int(n)) for a, n in zip(query_start.tolist(), query_lens.tolist())])
        out[rows] = target[rows].to(out.dtype)


# ----------------------------------------------------------------------------- split-K decode


@triton.jit
def _paged_decode_split(
    Q, K, V, OutPart, LsePart, BlockTables, Rows, SeqLens,
    scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_bt, stride_pb, stride_ph, stride_ps,
    GROUP: tl.constexpr, WINDOW: tl.constexpr, KV_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program: one decoding sequence, one KV head (all GROUP query heads that read it,
    so each K/V block is loaded once per KV head), one split of the context."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(Rows + seq)
    kv_len = tl.load(SeqLens + seq)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(kv_len - WINDOW, 0)
    per_split = tl.cdiv(tl.cdiv(kv_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, kv_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        key_ok = offs_n < end
        block = tl.load(BlockTables + seq * stride_bt + offs_n // KV_BLOCK, mask=key_ok, other=0)
        slot = block.to(tl.int64) * KV_BLOCK + offs_n % KV_BLOCK
        k = tl.load(K + slot[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                    mask=key_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(V + slot[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if FP32_DOT:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = tl.where(key_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    empty = l_i == 0.0  # a split past the end of a short context
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    base = seq * stride_pb + heads * stride_ph + split * stride_ps
    tl.store(OutPart + base[:, None] + offs_d[None, :], out, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(LsePart + (seq * stride_pb + heads * stride_ph) // BLOCK_D + split, lse, mask=g_ok)


@triton.jit
def _paged_decode_merge(
    OutPart, LsePart, Out, Rows,
    stride_pb, stride_ph, stride_ps, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Combine one (sequence, head)'s split results by their log-sum-exps."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(LsePart + (seq * stride_pb + head * stride_ph) // BLOCK_D + offs_s, mask=s_ok,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(s_ok & (lse > float("-inf")), tl.exp(lse - m), 0.0)
    parts = tl.load(OutPart + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    row = tl.load(Rows + seq)
    tl.store(Out + row * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_kv_len: int, block_n: int) -> int:
    """Split the context only when the batch alone leaves the GPU idle: about 256 programs fill
    an H100's 132 SMs twice; each split keeps at least a few key tiles of work."""
    want = max(1, -(-256 // max(num_seqs * num_kv_heads, 1)))
    return max(1, min(want, 16, -(-max_kv_len // (4 * block_n))))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                           rows: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           max_kv_len: int, scale: float, kv_block_size: int, window: int | None = None,
                           num_splits: int | None = None, block_n: int = 32) -> None:
    """Flash-decoding: attention of one query row per sequence (packed rows ``rows`` [B] of
    ``q``) over its paged context, the context split ``num_splits`` ways and merged; the
    result is written into ``out`` at the same rows."""
    num_seqs = rows.shape[0]
    if num_seqs == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    splits = num_splits or default_num_splits(num_seqs, num_kv_heads, max_kv_len, block_n)
    block_d = triton.next_power_of_2(head_dim)
    upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"
    # partial outputs [B, Hq, S, BLOCK_D] and their lse [B, Hq, S] share strides / BLOCK_D
    part = torch.empty(num_seqs, num_heads, splits, block_d, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
    _paged_decode_split[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, part, lse, block_tables, rows, seq_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2),
        GROUP=group, WINDOW=window or 0, KV_BLOCK=kv_block_size, NUM_SPLITS=splits, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        FP32_DOT=q.dtype == torch.float32 or upcast, UPCAST=upcast,
    )
    target = out if not upcast else torch.empty_like(out, dtype=torch.float32)
    _paged_decode_merge[(num_seqs, num_heads)](
        part, lse, target, rows, part.stride(0), part.stride(1), part.stride(2), target.stride(0), target.stride(1),
        NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), HEAD_DIM=head_dim, BLOCK_D=block_d,
    )
    if upcast:
        out[rows] = target[rows].to(out.dtype)
