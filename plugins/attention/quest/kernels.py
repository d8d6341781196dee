"""QUEST's decode path in Triton: page scores from the key bounds, then (after torch's top-K)
per-KV-head page tables for `flash`'s split-K decode kernel, so a decode reads every page's
bounds and its chosen pages' K/V only.

- ``_score_kernel``: one program per (sequence, KV head, tile of BLOCK_N pages) finds each
  page through the sequence's block table (page id = block * pages_per_block + j), reads its
  bounds and the KV head's query heads, and writes the page's score, the largest over the
  query heads of relu(q) . max - relu(-q) . min; +inf for the first page (always kept), -inf
  for the newest (always appended after the selection) and past the sequence's pages.
- ``_table_kernel``: one program per (sequence, KV head) turns the top-K columns into page
  ids with the newest page last, and writes the head's token count; a sequence with no more
  pages than the table holds gets all of them in position order (dense).

Nothing about the context is a compile-time constant (the page count is a runtime argument,
never specialised), so a longer context never builds a new variant; nothing is read back on
the host; every launch's grid depends on the batch size and the table width alone: a decode
step can be captured in a CUDA graph. select.py holds the torch reference of both kernels
(``decode_page_scores``, ``decode_page_tables``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessellm.plugins.attention.flash.common import interpreting

SCORE_TILE = 64
"""Pages a score program handles."""
TABLE_TILE = 1024
"""Table columns a table program writes at a time (a large budget loops, never a larger tile)."""
MAX_SCORE_PROGRAMS = 65535
"""CUDA's limit on a grid's third dimension: score tiles per sequence and KV head."""


@triton.jit(do_not_specialize=["stride_tb", "stride_sb", "stride_sh", "num_cols"])
def _score_kernel(Q, Rows, Tables, SeqLens, KMin, KMax, Scores,
                  stride_qt, stride_qh, stride_tb, stride_bp, stride_bh, stride_sb, stride_sh, num_cols,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PER_BLOCK: tl.constexpr, FP32_DOT: tl.constexpr):
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
    num_pages = tl.cdiv(tl.load(SeqLens + seq), PAGE)
    col_ok = cols < num_pages  # a tile past the sequence's pages loads nothing
    block = tl.load(Tables + seq * stride_tb + cols // PER_BLOCK, mask=col_ok, other=0).to(tl.int64)
    page = block * PER_BLOCK + cols % PER_BLOCK
    ptr = page[:, None] * stride_bp + kv_head * stride_bh + offs_d[None, :]
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
    score = tl.where(cols == 0, float("inf"), score)
    score = tl.where(col_ok & (cols != num_pages - 1), score, float("-inf"))
    tl.store(Scores + seq * stride_sb + kv_head * stride_sh + cols, score, mask=cols < num_cols)


@triton.jit(do_not_specialize=["stride_tb"])
def _table_kernel(Picks, Tables, SeqLens, PagesOut, LensOut,
                  stride_pb, stride_ph, stride_tb, stride_ob, stride_oh, stride_lb,
                  NUM_PICKS: tl.constexpr, PAGE: tl.constexpr, PER_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(SeqLens + seq)
    num_pages = tl.cdiv(seq_len, PAGE)
    dense = num_pages <= NUM_PICKS + 1  # every page fits the table: all of them, in order
    for start in range(0, NUM_PICKS + 1, BLOCK_K):  # table columns: NUM_PICKS picks, then the newest page
        k = start + tl.arange(0, BLOCK_K)
        picked = tl.load(Picks + seq * stride_pb + kv_head * stride_ph + k, mask=k < NUM_PICKS, other=0)
        col = tl.where(dense, k, tl.where(k == NUM_PICKS, num_pages - 1, picked))
        ok = (k <= NUM_PICKS) & (col < num_pages)
        block = tl.load(Tables + seq * stride_tb + col // PER_BLOCK, mask=ok, other=0)
        page = tl.where(ok, block * PER_BLOCK + col % PER_BLOCK, 0)  # a column past the length is never read
        tl.store(PagesOut + seq * stride_ob + kv_head * stride_oh + k, page.to(tl.int32), mask=k <= NUM_PICKS)
    length = tl.where(dense, seq_len, NUM_PICKS * PAGE + seq_len - (num_pages - 1) * PAGE)
    tl.store(LensOut + seq * stride_lb + kv_head, length.to(tl.int32))


def score_pages(q: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                kmin: torch.Tensor, kmax: torch.Tensor, page: int, per_block: int, num_cols: int) -> torch.Tensor:
    """Scores [B, Hkv, num_cols] float32 of each sequence's pages for its one decoding query row.

    q [T, Hq, D] packed queries; rows [B] int32 the row of each sequence; tables [B, W] int32
    its cache blocks (``per_block`` pages of ``page`` tokens each); seq_lens [B] int32;
    kmin, kmax [num_pages_total, Hkv, D] the bounds. The first page scores +inf, the newest
    and any column past a sequence's pages -inf (``decode_page_scores`` in select.py)."""
    b, _ = tables.shape
    _, hq, d = q.shape
    hkv = kmin.shape[1]
    scores = torch.empty(b, hkv, num_cols, dtype=torch.float32, device=q.device)
    if b == 0 or num_cols == 0:
        return scores
    _score_kernel[(b, hkv, triton.cdiv(num_cols, SCORE_TILE))](
        q, rows, tables, seq_lens, kmin, kmax, scores, q.stride(0), q.stride(1), tables.stride(0),
        kmin.stride(0), kmin.stride(1), scores.stride(0), scores.stride(1), num_cols,
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_G=max(16, triton.next_power_of_2(hq // hkv)),
        BLOCK_D=triton.next_power_of_2(d), BLOCK_N=SCORE_TILE, PAGE=page, PER_BLOCK=per_block,
        FP32_DOT=interpreting() or q.dtype == torch.float32)
    return scores


def page_tables(picks: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor, page: int,
                per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-KV-head page tables for the split-K decode kernel: picks [B, Hkv, P] the columns
    top-K chose (any order) -> (pages [B, Hkv, P + 1] int32, the picks' page ids and the
    newest page last, lengths [B, Hkv] int32 the tokens they hold); a sequence of at most
    P + 1 pages gets all of them in order (``decode_page_tables`` in select.py)."""
    b, hkv, num_picks = picks.shape
    pages = torch.empty(b, hkv, num_picks + 1, dtype=torch.int32, device=picks.device)
    lengths = torch.empty(b, hkv, dtype=torch.int32, device=picks.device)
    if b == 0:
        return pages, lengths
    _table_kernel[(b, hkv)](
        picks, tables, seq_lens, pages, lengths, picks.stride(0), picks.stride(1), tables.stride(0),
        pages.stride(0), pages.stride(1), lengths.stride(0),
        NUM_PICKS=num_picks, PAGE=page, PER_BLOCK=per_block,
        BLOCK_K=min(triton.next_power_of_2(num_picks + 1), TABLE_TILE))
    return pages, lengths
