"""QUEST's decode path in Triton: block scoring and top-K selection, feeding `flash`'s split-K
decode kernel per-KV-head tables of the chosen blocks, so a decode reads the key bounds of
its blocks and the K/V of the chosen ones only.

- ``_score_kernel``: one program per (sequence, KV head, tile of blocks) reads the tile's
  key bounds through the block table and the KV head's query heads, and writes each block's
  score, the largest over the query heads of relu(q) . max - relu(-q) . min (+inf for the
  forced first and newest blocks, -inf past the sequence's blocks).
- ``_select_kernel``: one program per (sequence, KV head) sorts the scores (each packed with
  its column into one int64 key, so one sort carries both), keeps the best ``num_chosen``,
  sorts their columns back into position order and writes their block ids and the head's
  length in tokens (the newest, partly filled block last).

select.py holds the torch reference of both (``block_scores``, ``select_blocks``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessellm.plugins.attention.flash.common import interpreting

MAX_BLOCKS = 65536
"""Blocks a sequence may have for the select kernel (its sort keys hold a 16-bit column)."""


@triton.jit(do_not_specialize=["stride_tb", "num_cols"])
def _score_kernel(Q, Rows, Tables, NumBlocks, KMin, KMax, Scores,
                  stride_qt, stride_qh, stride_tb, stride_bb, stride_bh, stride_sb, stride_sh, num_cols,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    row = tl.load(Rows + seq)
    q = tl.load(Q + row * stride_qt + (kv_head * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    num_blocks = tl.load(NumBlocks + seq)
    col_ok = cols < num_blocks
    block = tl.load(Tables + seq * stride_tb + cols, mask=col_ok, other=0).to(tl.int64)
    ptr = block[:, None] * stride_bb + kv_head * stride_bh + offs_d[None, :]
    hi = tl.load(KMax + ptr, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    lo = tl.load(KMin + ptr, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_DOT:  # float32 models, and the interpreter (it cannot multiply bfloat16)
        q, hi, lo = q.to(tl.float32), hi.to(tl.float32), lo.to(tl.float32)
        s = (tl.dot(tl.maximum(q, 0.0), tl.trans(hi), input_precision="ieee")
             - tl.dot(tl.maximum(-q, 0.0), tl.trans(lo), input_precision="ieee"))
    else:  # 16-bit operands: exact products, float32 sums
        zero = tl.zeros_like(q)  # some Triton versions widen a 16-bit maximum to float32: cast back
        pos, neg = tl.maximum(q, zero).to(hi.dtype), tl.maximum(-q, zero).to(lo.dtype)
        s = tl.dot(pos, tl.trans(hi)) - tl.dot(neg, tl.trans(lo))
    score = tl.max(tl.where(g_ok[:, None], s, float("-inf")), 0)  # [BLOCK_N]
    forced = (cols == 0) | (cols == num_blocks - 1)
    score = tl.where(forced, float("inf"), score)
    score = tl.where(col_ok, score, float("-inf"))
    tl.store(Scores + seq * stride_sb + kv_head * stride_sh + cols, score, mask=cols < num_cols)


@triton.jit
def _select_kernel(Scores, Tables, NumBlocks, SeqLens, NumChosen, BlocksOut, LensOut,
                   stride_sb, stride_sh, stride_tb, stride_ob, stride_oh, stride_lb, num_cols,
                   KV_BLOCK: tl.constexpr, N_PAD: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    cols = tl.arange(0, N_PAD)
    score = tl.load(Scores + seq * stride_sb + kv_head * stride_sh + cols, mask=cols < num_cols,
                    other=float("-inf"))
    # float32 bits -> an unsigned order-preserving integer, then the column in the low 16 bits
    # (a lower column first among equal scores)
    bits = score.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    ordered = tl.where(bits >= 0x80000000, (~bits) & 0xFFFFFFFF, bits | 0x80000000)
    keys = tl.sort((ordered << 16) | (N_PAD - 1 - cols), descending=True)
    ranked = N_PAD - 1 - (keys & 0xFFFF)  # columns, best first
    num_blocks = tl.load(NumBlocks + seq)
    take = tl.minimum(tl.load(NumChosen + seq), num_blocks)
    chosen = tl.sort(tl.where(cols < take, ranked, N_PAD))  # the chosen columns in position order
    ok = cols < take
    block = tl.load(Tables + seq * stride_tb + chosen, mask=ok, other=0)
    tl.store(BlocksOut + seq * stride_ob + kv_head * stride_oh + cols, block.to(tl.int32), mask=ok)
    kv_len = tl.load(SeqLens + seq)
    tl.store(LensOut + seq * stride_lb + kv_head, (take - 1) * KV_BLOCK + kv_len - (num_blocks - 1) * KV_BLOCK)


def select_decode_blocks(q: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor, num_blocks: torch.Tensor,
                         seq_lens: torch.Tensor, num_chosen: torch.Tensor, max_chosen: int, kmin: torch.Tensor,
                         kmax: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Score and choose blocks for one decoding query row per sequence.

    q [T, Hq, D] packed queries; rows [B] the row of each sequence; tables [B, N] its block ids
    (N columns, ``num_blocks`` [B] of them real); seq_lens [B]; num_chosen [B] blocks to keep
    (forced first and newest included), at most ``max_chosen``; kmin, kmax [num_blocks_total,
    Hkv, D]. Returns (blocks [B, Hkv, K] int32, the chosen block ids in position order,
    lengths [B, Hkv] int32, each head's tokens in them), K = min(max_chosen, N), for
    ``paged_decode_attention``'s per-head tables. No host synchronisation.
    """
    b, n = tables.shape
    if n > MAX_BLOCKS:
        raise ValueError(f"QUEST's select kernel takes at most {MAX_BLOCKS} blocks per sequence, got {n}")
    _, hq, d = q.shape
    hkv = kmin.shape[1]
    n_pad = max(16, triton.next_power_of_2(n))
    scores = torch.empty(b, hkv, n_pad, dtype=torch.float32, device=q.device)
    block_n = 32
    upcast = interpreting() or q.dtype == torch.float32
    _score_kernel[(b, hkv, triton.cdiv(n_pad, block_n))](
        q, rows, tables, num_blocks, kmin, kmax, scores, q.stride(0), q.stride(1), tables.stride(0),
        kmin.stride(0), kmin.stride(1), scores.stride(0), scores.stride(1), n_pad,
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_G=max(16, triton.next_power_of_2(hq // hkv)),
        BLOCK_D=triton.next_power_of_2(d), BLOCK_N=block_n, FP32_DOT=upcast)
    blocks = torch.zeros(b, hkv, n_pad, dtype=torch.int32, device=q.device)
    lengths = torch.empty(b, hkv, dtype=torch.int32, device=q.device)
    _select_kernel[(b, hkv)](
        scores, tables, num_blocks, seq_lens, num_chosen, blocks, lengths, scores.stride(0), scores.stride(1),
        tables.stride(0), blocks.stride(0), blocks.stride(1), lengths.stride(0), n, KV_BLOCK=block_size, N_PAD=n_pad)
    return blocks[:, :, :min(max_chosen, n)].contiguous(), lengths
