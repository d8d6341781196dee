"""Triton kernels of the `flash` backend: FlashAttention-2's forward over a packed (varlen)
batch whose keys and values live in a paged cache, and a split-K (flash-decoding) kernel for
single-token decodes.

One prefill program computes one tile of ``BLOCK_M`` query rows of one sequence for one query
head. It walks the sequence's context ``BLOCK_N`` keys at a time, mapping each key position to
its cache slot through the block table, and keeps FlashAttention's running max and sum so the
full score row never exists. The same kernel serves whole prompts, prefill chunks after cached
context (prefix hits) and decodes (a tile of one row): query i of a sequence with L keys and Q
queries sits at position L - Q + i.

Key tiles that every row of a query tile sees in full run without masks; only the tiles that
cross the causal diagonal (or a sliding window's edge) pay for them. Scores live in the base-2
domain (the softmax scale folded with log2(e)), so each exponential is one ``exp2``.

Loads beyond a sequence's length are masked, so a slot that was never written (it may hold
NaN) is never read. Accumulation is float32 whatever the input dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of one kernel: tile sizes (powers of two, at least 16), warps per program
    and software-pipelining depth."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def prefill_config(head_dim: int, device: torch.device, block_m: int | None = None,
                   block_n: int | None = None, packed: bool = False) -> KernelConfig:
    """The prefill kernel's launch shape for ``head_dim`` on ``device``, reading the new tokens'
    keys from the packed rows (``packed``) or gathering every key from the cache; explicit tile
    sizes win.

    The CUDA defaults come from ``python bench/kernels.py --sweep`` on an H100 (see
    docs/benchmarks.md); under the interpreter small tiles keep tests fast."""
    if device.type != "cuda":
        return KernelConfig(block_m or 16, block_n or 32, 4, 1)
    # H100, bf16, 4k causal (2026-11-23). Packed: 64x64, 4 warps, 3 stages best for both head
    # dims (D 128: 474 TFLOP/s, D 64: 387; the runners-up 10% and 0.4% behind). Gathered: D 128
    # at 128x32, 8 warps, 2 stages (346); D 64 at 64x64, 4 warps, 2 stages (332)
    if packed:
        base = KernelConfig(64, 64, 4, 3)
    else:
        base = KernelConfig(128, 32, 8, 2) if head_dim > 64 else KernelConfig(64, 64, 4, 2)
    return KernelConfig(block_m or base.block_m, block_n or base.block_n, base.num_warps, base.num_stages)


def decode_config(head_dim: int, device: torch.device, block_n: int | None = None) -> KernelConfig:
    """The split-K decode kernel's launch shape (block_m is unused: a program holds one KV
    head's query heads)."""
    if device.type != "cuda":
        return KernelConfig(16, block_n or 32, 4, 1)
    # H100, bf16, D 64, GQA 4 (2026-11-23): 64 keys per step, 2 warps, 4 stages was the best
    # worst case over batch 16 at 4k and batch 64 at 16k (2027 and 2917 GB/s)
    return KernelConfig(16, block_n or 64, 2, 4)


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    """a @ b: exact float32 products ("ieee") for float32 inputs, tensor-core rate otherwise."""
    if FP32_DOT:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _fold(acc, l_i, m_i, s, m_safe, v, FP32_DOT: tl.constexpr):
    """Fold one key tile's scores ``s`` (base 2) and values ``v`` into the running output and
    sum, rescaled from the old max ``m_i`` to ``m_safe``."""
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32_DOT)
    return acc, l_i


@triton.jit
def _score_tile(acc, l_i, m_i, q, k, v, offs_n, kv_len, q_pos, scale_log2,
                MASKED: tl.constexpr, WINDOW: tl.constexpr, FP32_DOT: tl.constexpr, UPCAST: tl.constexpr):
    """Fold one key tile (``k``, ``v`` at positions ``offs_n``) into the online softmax
    (scores in base 2). Unmasked tiles lie wholly inside the context and below every row's
    diagonal."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = _dot(q, tl.trans(k), FP32_DOT) * scale_log2
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
def _attend_tile(acc, l_i, m_i, q, K, V, BlockTables, start, seq, kv_head, kv_len, q_pos, scale_log2,
                 stride_kt, stride_kh, stride_bt, offs_d,
                 MASKED: tl.constexpr, WINDOW: tl.constexpr, KV_BLOCK: tl.constexpr, PAD_D: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile read from the paged cache through the block table."""
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
    return _score_tile(acc, l_i, m_i, q, k, v, offs_n, kv_len, q_pos, scale_log2, MASKED, WINDOW, FP32_DOT, UPCAST)


@triton.jit
def _attend_packed_tile(acc, l_i, m_i, q, k_desc, v_desc, start, first_row, ctx0, kv_head, kv_len, q_pos,
                        scale_log2, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                        FP32_DOT: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile of this step's own new tokens (positions ``ctx0`` on), read from the
    packed K/V rows through TMA descriptors: contiguous rows, no block table. Rows past the
    sequence's end belong to the next sequence (or lie past the tensor, read as zeros); the
    causal mask drops them."""
    offs_n = start + tl.arange(0, BLOCK_N)
    row = first_row + start - ctx0
    k = k_desc.load([row, kv_head * HEAD_DIM])
    v = v_desc.load([row, kv_head * HEAD_DIM])
    return _score_tile(acc, l_i, m_i, q, k, v, offs_n, kv_len, q_pos, scale_log2, MASKED, 0, FP32_DOT, UPCAST)


# the block-table row stride is the widest table in the batch: left to specialise (on 1 and on
# multiples of 16), it would recompile the kernels mid-run as tables grow
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_flash_fwd(
    Q, K, V, Out, BlockTables, QueryStart, QueryLens, SeqLens, KNew, VNew,
    scale_log2,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, WINDOW: tl.constexpr, KV_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr, UPCAST: tl.constexpr, PACKED: tl.constexpr,
):
    """``PACKED``: key tiles wholly among the step's new tokens are read from ``KNew`` /
    ``VNew``, TMA descriptors over the packed K/V rows [tokens, KV heads x HEAD_DIM] (whole
    prompts: every tile), the rest through the block table; otherwise every tile through the
    block table (``KNew``, ``VNew`` unused)."""
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

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    first_pos = kv_len - q_len + tile * BLOCK_M  # the tile's first row's position
    # causal: the tile's last row sees keys up to its own position
    hi = tl.minimum(kv_len, first_pos + BLOCK_M)
    if WINDOW > 0:  # the first row sees only its last WINDOW keys: every tile is masked
        lo = tl.maximum(first_pos - WINDOW + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        for start in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, K, V, BlockTables, start, seq, kv_head, kv_len, q_pos, scale_log2,
                                         stride_kt, stride_kh, stride_bt, offs_d, True, WINDOW, KV_BLOCK, PAD_D,
                                         HEAD_DIM, BLOCK_N, FP32_DOT, UPCAST)
    elif PACKED:
        full = ((first_pos + 1) // BLOCK_N) * BLOCK_N
        ctx0 = kv_len - q_len  # the step's first new position
        split = tl.cdiv(ctx0, BLOCK_N) * BLOCK_N  # the first key tile wholly among the new tokens
        for start in range(0, tl.minimum(full, split), BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, K, V, BlockTables, start, seq, kv_head, kv_len, q_pos, scale_log2,
                                         stride_kt, stride_kh, stride_bt, offs_d, False, WINDOW, KV_BLOCK, PAD_D,
                                         HEAD_DIM, BLOCK_N, FP32_DOT, UPCAST)
        for start in range(split, full, BLOCK_N):
            acc, l_i, m_i = _attend_packed_tile(acc, l_i, m_i, q, KNew, VNew, start, q_start, ctx0, kv_head, kv_len,
                                                q_pos, scale_log2, False, HEAD_DIM, BLOCK_N, FP32_DOT, UPCAST)
        for start in range(full, tl.minimum(hi, tl.maximum(full, split)), BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, K, V, BlockTables, start, seq, kv_head, kv_len, q_pos, scale_log2,
                                         stride_kt, stride_kh, stride_bt, offs_d, True, WINDOW, KV_BLOCK, PAD_D,
                                         HEAD_DIM, BLOCK_N, FP32_DOT, UPCAST)
        for start in range(tl.maximum(full, split), hi, BLOCK_N):
            acc, l_i, m_i = _attend_packed_tile(acc, l_i, m_i, q, KNew, VNew, start, q_start, ctx0, kv_head, kv_len,
                                                q_pos, scale_log2, True, HEAD_DIM, BLOCK_N, FP32_DOT, UPCAST)
    else:
        # key tiles wholly at or before the first row's position are seen in full by every row
        full = ((first_pos + 1) // BLOCK_N) * BLOCK_N
        for start in range(0, full, BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, K, V, BlockTables, start, seq, kv_head, kv_len, q_pos, scale_log2,
                                         stride_kt, stride_kh, stride_bt, offs_d, False, WINDOW, KV_BLOCK, PAD_D,
                                         HEAD_DIM, BLOCK_N, FP32_DOT, UPCAST)
        for start in range(full, hi, BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, K, V, BlockTables, start, seq, kv_head, kv_len, q_pos, scale_log2,
                                         stride_kt, stride_kh, stride_bt, offs_d, True, WINDOW, KV_BLOCK, PAD_D,
                                         HEAD_DIM, BLOCK_N, FP32_DOT, UPCAST)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=q_mask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
                          v_new: torch.Tensor | None = None) -> None:
    """Attention of packed queries ``q`` [T, Hq, D] over each sequence's cached context,
    written into ``out`` at the same rows.

    ``k_cache``, ``v_cache``: [num_slots, Hkv, D] (slot = block * kv_block_size + offset);
    per sequence (any subset of the batch, in any order): ``block_tables`` [B, max_blocks],
    ``query_start`` [B] (first packed row), ``query_lens`` [B], ``seq_lens`` [B] (context
    length after this step, the new tokens included and already stored); all int32.
    ``config`` (or else ``prefill_config``) sets the launch shape.

    ``k_new``, ``v_new`` (optional): the step's new keys and values [T, Hkv, D], packed row for
    row with ``q`` (views into a stacked projection are fine). Where ``packed_source_ok``,
    key tiles wholly among a sequence's new tokens are read from them, as contiguous rows
    through TMA descriptors, rather than gathered from the cache through the block table.
    """
    num_seqs = seq_lens.shape[0]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_tokens == 0 or num_seqs == 0:
        return
    packed = (k_new is not None and v_new is not None and packed_source_ok(k_new, head_dim, window)
              and packed_source_ok(v_new, head_dim, window))
    cfg = config or prefill_config(head_dim, q.device, block_m, block_n, packed)
    # Triton's interpreter multiplies bfloat16 dot operands as raw bits (triton-lang/triton
    # issue 11584) and does not round float32 -> bfloat16 to nearest: there, and only there,
    # bfloat16 tiles are widened to float32 and the output is rounded by torch
    upcast = q.dtype == torch.bfloat16 and _interpreting()
    target = out if not upcast else torch.empty_like(out, dtype=torch.float32)
    k_src, v_src = (_row_descriptor(k_new, cfg.block_n), _row_descriptor(v_new, cfg.block_n)) if packed else (k_cache, v_cache)
    grid = (triton.cdiv(max_query_len, cfg.block_m), num_seqs, num_heads)
    _paged_flash_fwd[grid](
        q, k_cache, v_cache, target, block_tables, query_start, query_lens, seq_lens, k_src, v_src, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), target.stride(0), target.stride(1),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, WINDOW=window or 0, KV_BLOCK=kv_block_size,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        FP32_DOT=q.dtype == torch.float32 or upcast, UPCAST=upcast, PACKED=packed,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if upcast:  # only this call's rows: others may belong to the decode kernel
        rows = torch.cat([torch.arange(int(a), int(a) + int(n)) for a, n in zip(query_start.tolist(), query_lens.tolist())])
        out[rows] = target[rows].to(out.dtype)


# ----------------------------------------------------------------------------- split-K decode


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_decode_split(
    Q, K, V, OutPart, LsePart, Out, BlockTables, Rows, SeqLens,
    scale_log2,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_bt, stride_pb, stride_ph, stride_ps, stride_ot, stride_oh,
    GROUP: tl.constexpr, WINDOW: tl.constexpr, KV_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr, UPCAST: tl.constexpr, DIRECT: tl.constexpr,
):
    """One program: one decoding sequence, one KV head (all GROUP query heads that read it,
    so each K/V block is loaded once per KV head), one split of the context. ``DIRECT`` (a
    single split) writes the final output, with no partials to merge."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    row = tl.load(Rows + seq)
    kv_len = tl.load(SeqLens + seq)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(kv_len - WINDOW, 0)
    per_split = tl.cdiv(tl.cdiv(kv_len - lo, num_splits), BLOCK_N) * BLOCK_N
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
        kv_ptr = slot[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        k = tl.load(K + kv_ptr, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + kv_ptr, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.where(key_ok[None, :], _dot(q, tl.trans(k), FP32_DOT) * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        acc, l_i = _fold(acc, l_i, m_i, s, tl.where(m_new == float("-inf"), 0.0, m_new), v, FP32_DOT)
        m_i = m_new
    empty = l_i == 0.0  # a split past the end of a short context
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if DIRECT:
        tl.store(Out + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))  # base 2
        base = seq * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(OutPart + base[:, None] + offs_d[None, :], out, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(LsePart + (seq * stride_pb + heads * stride_ph) // BLOCK_D + split, lse, mask=g_ok)


# the split count changes from step to step (batch size, longest context): one compiled
# variant serves every count up to BLOCK_S (masked lanes load nothing)
@triton.jit(do_not_specialize=["num_splits"])
def _paged_decode_merge(
    OutPart, LsePart, Out, Rows,
    stride_pb, stride_ph, stride_ps, stride_ot, stride_oh, num_splits,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Combine one (sequence, head)'s split results by their (base-2) log-sum-exps."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(LsePart + (seq * stride_pb + head * stride_ph) // BLOCK_D + offs_s, mask=s_ok,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(s_ok & (lse > float("-inf")), tl.math.exp2(lse - m), 0.0)
    parts = tl.load(OutPart + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    row = tl.load(Rows + seq)
    tl.store(Out + row * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)


DECODE_PROGRAMS = 512
"""Programs the split-K decode aims for: a few per SM on a 132-SM H100, so enough loads are in
flight to approach memory bandwidth (bench/kernels.py --sweep picks it)."""


MAX_AUTO_SPLITS = 32
"""The most splits ``default_num_splits`` chooses; the merge kernel is compiled for this many
(or for 64, the most ``FlashOptions.decode_splits`` allows), whatever the step's count."""


def default_num_splits(num_seqs: int, num_kv_heads: int, max_kv_len: int, block_n: int,
                       target_programs: int = DECODE_PROGRAMS) -> int:
    """Split the context only when the batch alone leaves the GPU idle; each split keeps at
    least a few key tiles of work."""
    want = max(1, -(-target_programs // max(num_seqs * num_kv_heads, 1)))
    return max(1, min(want, MAX_AUTO_SPLITS, -(-max_kv_len // (4 * block_n))))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                           rows: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           max_kv_len: int, scale: float, kv_block_size: int, window: int | None = None,
                           num_splits: int | None = None, block_n: int | None = None,
                           config: KernelConfig | None = None) -> None:
    """Flash-decoding: attention of one query row per sequence (packed rows ``rows`` [B] of
    ``q``) over its paged context, the context split ``num_splits`` ways and merged; the
    result is written into ``out`` at the same rows.

    The launch depends on the batch only through ``num_splits`` and the shapes, so a caller
    that fixes both (a CUDA graph) can replay it for any lengths up to ``max_kv_len``."""
    num_seqs = rows.shape[0]
    if num_seqs == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    cfg = config or decode_config(head_dim, q.device, block_n)
    splits = num_splits or default_num_splits(num_seqs, num_kv_heads, max_kv_len, cfg.block_n)
    block_d = triton.next_power_of_2(head_dim)
    upcast = q.dtype == torch.bfloat16 and _interpreting()
    target = out if not upcast else torch.empty_like(out, dtype=torch.float32)
    direct = splits == 1  # one split: its result is final, written in place (no merge launch)
    # partial outputs [B, Hq, S, BLOCK_D] and their lse [B, Hq, S] share strides / BLOCK_D
    part = target if direct else torch.empty(num_seqs, num_heads, splits, block_d, dtype=torch.float32, device=q.device)
    lse = target if direct else torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
    part_strides = (0, 0, 0) if direct else (part.stride(0), part.stride(1), part.stride(2))
    _paged_decode_split[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, part, lse, target, block_tables, rows, seq_lens, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        *part_strides, target.stride(0), target.stride(1),
        GROUP=group, WINDOW=window or 0, KV_BLOCK=kv_block_size, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg.block_n,
        FP32_DOT=q.dtype == torch.float32 or upcast, UPCAST=upcast, DIRECT=direct,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not direct:
        _paged_decode_merge[(num_seqs, num_heads)](
            part, lse, target, rows, part.stride(0), part.stride(1), part.stride(2), target.stride(0),
            target.stride(1), splits, BLOCK_S=max(MAX_AUTO_SPLITS, triton.next_power_of_2(splits)),
            HEAD_DIM=head_dim, BLOCK_D=block_d,
        )
    if upcast:
        out[rows] = target[rows].to(out.dtype)
