"""The `flash` prefill kernel: FlashAttention-2's forward over a packed (varlen) batch whose
keys and values live in a paged cache.

One program computes one tile of ``BLOCK_M`` query rows of one sequence for one query head.
It walks the sequence's context ``BLOCK_N`` keys at a time, mapping each key position to its
cache slot through the block table, and keeps FlashAttention's running max and sum so the
full score row never exists. The same kernel serves whole prompts, prefill chunks after cached
context (prefix hits) and decodes (a tile of one row): query i of a sequence with L keys and Q
queries sits at position L - Q + i.

Key tiles that every row of a query tile sees in full run without masks; only the tiles that
cross the causal diagonal (or a sliding window's edge) pay for them. Loads beyond a
sequence's length are masked, so a slot that was never written (it may hold NaN) is never read.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tessellm.plugins.attention.flash.common import (LOG2E, TL_DTYPES, KernelConfig, _add_sink, _dequantize, _dot,
                                                     _fold, _softcap, interpreting, scale_args, sink_args,
                                                     softcap_log2)


def prefill_config(head_dim: int, device: torch.device, block_m: int | None = None,
                   block_n: int | None = None, packed: bool = False) -> KernelConfig:
    """The prefill kernel's launch shape for ``head_dim`` on ``device``, reading the new tokens'
    keys from the packed rows (``packed``) or gathering every key from the cache; explicit tile
    sizes win.

    The CUDA defaults come from ``python bench/kernels.py --sweep`` (docs/benchmarks.md,
    "Prefill"); under the interpreter small tiles keep tests fast."""
    if device.type != "cuda":
        return KernelConfig(block_m or 16, block_n or 32, 4, 1)
    # each path's fastest tiles for 4k causal bf16 in `python bench/kernels.py --sweep`
    # (docs/benchmarks.md, "Prefill"): packed the same for head dims 64 and 128
    if packed:
        base = KernelConfig(64, 64, 4, 3)
    else:
        base = KernelConfig(128, 32, 8, 2) if head_dim > 64 else KernelConfig(64, 64, 4, 2)
    return KernelConfig(block_m or base.block_m, block_n or base.block_n, base.num_warps, base.num_stages)


@triton.jit
def _score_tile(acc, l_i, m_i, q, k, v, offs_n, kv_len, q_pos, scale_log2,
                MASKED: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FP32_DOT: tl.constexpr,
                UPCAST: tl.constexpr):
    """Fold one key tile (``k``, ``v`` at positions ``offs_n``) into the online softmax
    (scores in base 2, capped first where ``SOFTCAP``, the base-2 cap, is nonzero). Unmasked
    tiles lie wholly inside the context and below every row's diagonal."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = _dot(q, tl.trans(k), FP32_DOT) * scale_log2
    if SOFTCAP > 0:  # after the scale, before the mask
        s = _softcap(s, SOFTCAP)
    if MASKED:
        visible = (offs_n < kv_len)[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (q_pos[:, None] - offs_n[None, :] < WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
    acc, l_i = _fold(acc, l_i, m_i, s, m_safe, v, FP32_DOT)
    return acc, l_i, m_new


@triton.jit
def _attend_tile(acc, l_i, m_i, q, K, V, KScale, VScale, BlockTables, start, seq, kv_head, kv_len, q_pos,
                 scale_log2, stride_kt, stride_kh, stride_st, stride_sh, stride_bt, offs_d,
                 MASKED: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, KV_BLOCK: tl.constexpr,
                 PAD_D: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr,
                 UPCAST: tl.constexpr, QUANT: tl.constexpr, COMPUTE: tl.constexpr):
    """One key tile read from the paged cache through the block table (``QUANT``: int8,
    dequantized with its per-token scales to ``COMPUTE``)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        key_ok = offs_n < kv_len
        block = tl.load(BlockTables + seq * stride_bt + offs_n // KV_BLOCK, mask=key_ok, other=0)
    else:
        block = tl.load(BlockTables + seq * stride_bt + offs_n // KV_BLOCK)
    slot = block.to(tl.int64) * KV_BLOCK + offs_n % KV_BLOCK
    kv_ptr = slot[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
    if MASKED:
        kv_mask = key_ok[:, None]
        if PAD_D:
            kv_mask = kv_mask & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(K + kv_ptr, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_ptr, mask=kv_mask, other=0.0)
    elif PAD_D:
        k = tl.load(K + kv_ptr, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
        v = tl.load(V + kv_ptr, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        k = tl.load(K + kv_ptr)
        v = tl.load(V + kv_ptr)
    if QUANT:
        scale_ptr = slot * stride_st + kv_head * stride_sh
        if MASKED:
            k_scale = tl.load(KScale + scale_ptr, mask=key_ok, other=0.0)
            v_scale = tl.load(VScale + scale_ptr, mask=key_ok, other=0.0)
        else:
            k_scale = tl.load(KScale + scale_ptr)
            v_scale = tl.load(VScale + scale_ptr)
        k = _dequantize(k, k_scale, COMPUTE, UPCAST)
        v = _dequantize(v, v_scale, COMPUTE, UPCAST)
    return _score_tile(acc, l_i, m_i, q, k, v, offs_n, kv_len, q_pos, scale_log2, MASKED, WINDOW, SOFTCAP, FP32_DOT,
                       UPCAST)


@triton.jit
def _attend_packed_tile(acc, l_i, m_i, q, k_desc, v_desc, start, first_row, ctx0, kv_head, kv_len, q_pos,
                        scale_log2, MASKED: tl.constexpr, SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile of this step's own new tokens (positions ``ctx0`` on), read from the
    packed K/V rows through TMA descriptors: contiguous rows, no block table. Rows past the
    sequence's end belong to the next sequence (or lie past the tensor, read as zeros); the
    causal mask drops them."""
    offs_n = start + tl.arange(0, BLOCK_N)
    row = first_row + start - ctx0
    k = k_desc.load([row, kv_head * HEAD_DIM])
    v = v_desc.load([row, kv_head * HEAD_DIM])
    return _score_tile(acc, l_i, m_i, q, k, v, offs_n, kv_len, q_pos, scale_log2, MASKED, 0, SOFTCAP, FP32_DOT,
                       UPCAST)


# the block-table row stride is the widest table in the batch: left to specialise (on 1 and on
# multiples of 16), it would recompile the kernels mid-run as tables grow
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_flash_fwd(
    Q, K, V, KScale, VScale, Out, BlockTables, QueryStart, QueryLens, SeqLens, KNew, VNew, Sinks,
    scale_log2,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_st, stride_sh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr, KV_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr, UPCAST: tl.constexpr, PACKED: tl.constexpr, QUANT: tl.constexpr, COMPUTE: tl.constexpr,
    CAUSAL: tl.constexpr = True,
):
    """``PACKED``: key tiles wholly among the step's new tokens are read from ``KNew`` /
    ``VNew``, TMA descriptors over the packed K/V rows [tokens, KV heads x HEAD_DIM] (whole
    prompts: every tile), the rest through the block table; otherwise every tile through the
    block table (``KNew``, ``VNew`` unused). ``QUANT``: the cache is int8 with per-token
    scales ``KScale``, ``VScale`` (never with ``PACKED``: every key is read as stored).
    ``WINDOW`` (0: none), ``SOFTCAP`` (base 2; 0.0: none) and ``SINKS`` (``Sinks`` [Hq]
    holds each query head's sink logit; unused otherwise) are the layer's features.
    ``CAUSAL`` False (an encoder's layer; no ``WINDOW``): every row sees the whole context, as
    the sequence's last row does, so each row takes the last row's position."""
    # the longest tiles (last rows of the causal triangle) start first
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(QueryStart + seq)
    q_len = tl.load(QueryLens + seq)
    if tile * BLOCK_M >= q_len:
        return
    kv_len = tl.load(SeqLens + seq)
    kv_head = head // GROUP
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    q_mask = row_ok[:, None]
    if PAD_D:
        q_mask = q_mask & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = kv_len - q_len + offs_m  # absolute position of each query row
    if not CAUSAL:  # both ways: every row masks keys as the last one does (only those past the context)
        q_pos = q_pos * 0 + kv_len - 1

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    first_pos = kv_len - q_len + tile * BLOCK_M  # the tile's first row's position
    if not CAUSAL:
        first_pos = kv_len - 1
    # causal: the tile's last row sees keys up to its own position
    hi = tl.minimum(kv_len, first_pos + BLOCK_M)
    if WINDOW > 0:  # the first row sees only its last WINDOW keys: every tile is masked
        lo = tl.maximum(first_pos - WINDOW + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        for start in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, K, V, KScale, VScale, BlockTables, start, seq, kv_head,
                                         kv_len, q_pos, scale_log2, stride_kt, stride_kh, stride_st, stride_sh,
                                         stride_bt, offs_d, True, WINDOW, SOFTCAP, KV_BLOCK, PAD_D, HEAD_DIM, BLOCK_N,
                                         FP32_DOT, UPCAST, QUANT, COMPUTE)
    elif PACKED:
        full = ((first_pos + 1) // BLOCK_N) * BLOCK_N
        ctx0 = kv_len - q_len  # the step's first new position
        split = tl.cdiv(ctx0, BLOCK_N) * BLOCK_N  # the first key tile wholly among the new tokens
        for start in range(0, tl.minimum(full, split), BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, K, V, KScale, VScale, BlockTables, start, seq, kv_head,
                                         kv_len, q_pos, scale_log2, stride_kt, stride_kh, stride_st, stride_sh,
                                         stride_bt, offs_d, False, WINDOW, SOFTCAP, KV_BLOCK, PAD_D, HEAD_DIM, BLOCK_N,
                                         FP32_DOT, UPCAST, QUANT, COMPUTE)
        for start in range(split, full, BLOCK_N):
            acc, l_i, m_i = _attend_packed_tile(acc, l_i, m_i, q, KNew, VNew, start, q_start, ctx0, kv_head, kv_len,
                                                q_pos, scale_log2, False, SOFTCAP, HEAD_DIM, BLOCK_N, FP32_DOT, UPCAST)
        for start in range(full, tl.minimum(hi, tl.maximum(full, split)), BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, K, V, KScale, VScale, BlockTables, start, seq, kv_head,
                                         kv_len, q_pos, scale_log2, stride_kt, stride_kh, stride_st, stride_sh,
                                         stride_bt, offs_d, True, WINDOW, SOFTCAP, KV_BLOCK, PAD_D, HEAD_DIM, BLOCK_N,
                                         FP32_DOT, UPCAST, QUANT, COMPUTE)
        for start in range(tl.maximum(full, split), hi, BLOCK_N):
            acc, l_i, m_i = _attend_packed_tile(acc, l_i, m_i, q, KNew, VNew, start, q_start, ctx0, kv_head, kv_len,
                                                q_pos, scale_log2, True, SOFTCAP, HEAD_DIM, BLOCK_N, FP32_DOT, UPCAST)
    else:
        # key tiles wholly at or before the first row's position are seen in full by every row
        full = ((first_pos + 1) // BLOCK_N) * BLOCK_N
        for start in range(0, full, BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, K, V, KScale, VScale, BlockTables, start, seq, kv_head,
                                         kv_len, q_pos, scale_log2, stride_kt, stride_kh, stride_st, stride_sh,
                                         stride_bt, offs_d, False, WINDOW, SOFTCAP, KV_BLOCK, PAD_D, HEAD_DIM, BLOCK_N,
                                         FP32_DOT, UPCAST, QUANT, COMPUTE)
        for start in range(full, hi, BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, K, V, KScale, VScale, BlockTables, start, seq, kv_head,
                                         kv_len, q_pos, scale_log2, stride_kt, stride_kh, stride_st, stride_sh,
                                         stride_bt, offs_d, True, WINDOW, SOFTCAP, KV_BLOCK, PAD_D, HEAD_DIM, BLOCK_N,
                                         FP32_DOT, UPCAST, QUANT, COMPUTE)
    if SINKS:
        acc, l_i = _add_sink(acc, l_i, m_i, tl.load(Sinks + head))
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=q_mask)

def packed_source_ok(k_new: torch.Tensor, head_dim: int, window: int | None) -> bool:
    """Whether the prefill kernel can read the step's new keys/values from ``k_new`` [T, Hkv,
    D] through TMA descriptors: a power-of-two head dim (no padded columns), no sliding
    window, heads contiguous within a row, rows 16-byte aligned."""
    size = k_new.element_size()
    return (head_dim == triton.next_power_of_2(head_dim) and not window and k_new.stride(2) == 1
            and k_new.stride(1) == head_dim and (k_new.stride(0) * size) % 16 == 0
            and k_new.data_ptr() % 16 == 0 and head_dim * size >= 16)


def _row_descriptor(t: torch.Tensor, block_n: int) -> Any:
    """A TMA descriptor over ``t`` [T, H, D] as rows [T, H*D], one [block_n, D] box at a time."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, heads, dim = t.shape
    return TensorDescriptor(t, shape=[rows, heads * dim], strides=[t.stride(0), 1], block_shape=[block_n, dim])


def paged_flash_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                          block_tables: torch.Tensor, query_start: torch.Tensor, query_lens: torch.Tensor,
                          seq_lens: torch.Tensor, max_query_len: int, scale: float, kv_block_size: int,
                          window: int | None = None, block_m: int | None = None, block_n: int | None = None,
                          config: KernelConfig | None = None, k_new: torch.Tensor | None = None,
                          v_new: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None, softcap: float | None = None,
                          sinks: torch.Tensor | None = None, causal: bool = True) -> None:
    """Attention of packed queries ``q`` [T, Hq, D] over each sequence's cached context,
    written into ``out`` at the same rows (``causal`` False: every query sees the whole
    context, an encoder's layer; not with a ``window``).

    ``k_cache``, ``v_cache``: [num_slots, Hkv, D] (slot = block * kv_block_size + offset);
    per sequence (any subset of the batch, in any order): ``block_tables`` [B, max_blocks],
    ``query_start`` [B] (first packed row), ``query_lens`` [B], ``seq_lens`` [B] (context
    length after this step, the new tokens included and already stored); all int32.
    ``config`` (or else ``prefill_config``) sets the launch shape.

    ``k_new``, ``v_new`` (optional): the step's new keys and values [T, Hkv, D], packed row for
    row with ``q`` (views into a stacked projection are fine). Where ``packed_source_ok``,
    key tiles wholly among a sequence's new tokens are read from them, as contiguous rows
    through TMA descriptors, rather than gathered from the cache through the block table.

    ``k_scale``, ``v_scale`` [num_slots, Hkv, 1]: the caches are int8 with these per-token
    scales, dequantized in the kernel; every key then comes from the cache (``k_new`` and
    ``v_new`` are ignored), so new tokens are seen exactly as stored.

    ``softcap``: the scaled scores s become softcap * tanh(s / softcap) before masking;
    ``sinks`` [Hq] (float32): each query head's sink logit joins its softmax denominators.
    """
    if not causal and window:
        raise ValueError("the prefill kernel serves bidirectional layers without a window only")
    num_seqs = seq_lens.shape[0]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_tokens == 0 or num_seqs == 0:
        return
    quant = k_scale is not None
    packed = (not quant and k_new is not None and v_new is not None and packed_source_ok(k_new, head_dim, window)
              and packed_source_ok(v_new, head_dim, window))
    cfg = config or prefill_config(head_dim, q.device, block_m, block_n, packed)
    # Triton's interpreter multiplies bfloat16 dot operands as raw bits (triton-lang/triton
    # issue 11584) and does not round float32 -> bfloat16 to nearest: there, and only there,
    # bfloat16 tiles are widened to float32 and the output is rounded by torch
    upcast = q.dtype == torch.bfloat16 and interpreting()
    target = out if not upcast else torch.empty_like(out, dtype=torch.float32)
    k_src, v_src = (_row_descriptor(k_new, cfg.block_n), _row_descriptor(v_new, cfg.block_n)) if packed else (k_cache, v_cache)
    grid = (triton.cdiv(max_query_len, cfg.block_m), num_seqs, num_heads)
    k_scales, v_scales, stride_st, stride_sh = scale_args(k_scale, v_scale, k_cache)
    sink_ptr, has_sinks = sink_args(sinks, num_heads, q)
    _paged_flash_fwd[grid](
        q, k_cache, v_cache, k_scales, v_scales, target, block_tables, query_start, query_lens, seq_lens, k_src, v_src,
        sink_ptr, scale * LOG2E, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), stride_st, stride_sh,
        target.stride(0), target.stride(1), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, WINDOW=window or 0, SOFTCAP=softcap_log2(softcap), SINKS=has_sinks,
        KV_BLOCK=kv_block_size,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        FP32_DOT=q.dtype == torch.float32 or upcast, UPCAST=upcast, PACKED=packed, QUANT=quant,
        COMPUTE=TL_DTYPES[q.dtype], CAUSAL=causal,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if upcast:  # only this call's rows: others may belong to the decode kernel
        rows = torch.cat([torch.arange(int(a), int(a) + int(n)) for a, n in zip(query_start.tolist(), query_lens.tolist())])
        out[rows] = target[rows].to(out.dtype)
