"""Split-K decode kernel for Multi-head Latent Attention (MLA, DeepSeek-V2/V3) in absorbed form
over a paged latent cache.

In absorbed form every query head attends one shared latent "head": each cached token is one
vector of ``D = kv_lora_rank + rope_dim`` numbers (the compressed KV ``c_kv`` followed by the
rotated positional key ``k_pe``). The whole vector is the key; its first ``kv_lora_rank``
numbers are the value. The query is ``q_nope @ W_UK`` concatenated with the rotated ``q_pe``,
so for sequence b and head h::

    out[b, h] = softmax(scale * q[b, h] . K_b^T) @ V_b        (out: [B, H, kv_lora_rank])

and the caller applies ``W_UV`` to ``out`` afterwards.

Layout: ``cache`` [num_slots, D] holds one layer; slot ``s`` is row ``s % block_size`` of block
``s // block_size``, and token ``t`` of sequence ``b`` lives in block ``block_tables[b, t //
block_size]``. Only the tokens below ``seq_lens[b]`` are ever read: unwritten slots may hold
anything, NaN included.

Flash-decoding, as FlashMLA does it: a program takes one sequence, one block of ``BLOCK_H``
query heads and one split of the context. Because all heads share the latent vectors, each
``BLOCK_N``-token tile is loaded once per head block and serves both products: ``q . K^T``
(nope and rope parts, two dots) and ``P @ V`` (V is the tile's nope part, the same registers).
Scores live in the base-2 domain (the softmax scale folded with log2(e)), the softmax runs
online in float32, and each split writes its normalized partial output with its log-sum-exp;
a small merge kernel combines the splits (a single split writes the output directly).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from tessellm.plugins.attention.flash.common import LOG2E, _dot, _fold, interpreting

BLOCK_H = 16
"""Query heads per program: the smallest M a ``tl.dot`` takes. Fewer heads are masked."""

MIN_TILES_PER_SPLIT = 4
"""Key tiles a split keeps at least, under the automatic choice: a split's partial output
(``BLOCK_H x kv_lora_rank`` float32 numbers, written and read back by the merge) should cost
little next to the latent tiles it reads."""

MAX_AUTO_SPLITS = 32
"""The most splits the automatic choice makes."""

PROGRAMS_PER_SM = 2
"""Split programs of the CUDA launch shape one SM runs at once (registers: 104 a thread at
8 warps, 56 KB of shared memory, on sm_90; bench/compile_hopper.py)."""

WAVES = 1
"""Whole waves of programs the automatic split count aims for. Rounding the program count up
past a wave leaves a tail: 288 programs on the 264 an H200 runs at once take two program
times, at 55% of the work's share of the machine (the H200's 40-50% of copy bandwidth at
batch 32-64)."""


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """The split kernel's launch shape: keys a tile, warps, software-pipeline stages."""

    block_n: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_config(dtype: torch.dtype, device: torch.device) -> LaunchConfig:
    """On CUDA, 32-token tiles of 16-bit latents (36 KiB per 576-wide tile, two in flight) over
    8 warps (104 registers a thread, against 192 at 4: the same two programs an SM, twice the
    warps to hide the loads' latency); float32 tiles are twice as wide in bytes, so 16 tokens.
    Interpreted on the CPU, 16-token tiles, so short test contexts still span several tiles.
    ``bench/mla.py --sweep`` times the alternatives on a GPU."""
    if device.type != "cuda":
        return LaunchConfig(16, 4, 1)
    return LaunchConfig(16 if dtype == torch.float32 else 32, 8, 2)


def default_num_splits(num_seqs: int, num_heads: int, max_context: int, block_n: int,
                       device: torch.device) -> int:
    """How many ways to split the context when the caller does not say.

    Split only as far as fills the machine in whole waves: on CUDA ``WAVES`` times the
    programs it runs at once (``PROGRAMS_PER_SM`` an SM), rounded down, so no wave runs a
    handful of programs alone (``num_seqs * head_blocks * splits`` programs); on the CPU (the
    interpreter runs programs one after another) about four programs in all. Each split
    keeps at least ``MIN_TILES_PER_SPLIT`` tiles of ``block_n`` tokens, at most
    ``MAX_AUTO_SPLITS``; the count is then clamped so that a context of ``max_context``
    tokens leaves no split empty (each split covers a whole number of tiles)."""
    head_blocks = triton.cdiv(num_heads, BLOCK_H)
    slots = WAVES * PROGRAMS_PER_SM * _sm_count(device.index if device.index is not None
                                                else torch.cuda.current_device()) if device.type == "cuda" else 4
    want = slots // max(num_seqs * head_blocks, 1)
    splits = max(1, min(want, MAX_AUTO_SPLITS, max_context // (MIN_TILES_PER_SPLIT * block_n)))
    per_split = triton.cdiv(triton.cdiv(max_context, splits), block_n) * block_n
    return max(1, triton.cdiv(max_context, per_split))


@triton.jit(do_not_specialize=["stride_bt"])
def _mla_decode_split(
    Q, Cache, BlockTables, SeqLens, OutPart, LsePart, Out,
    scale_log2,
    stride_qb, stride_qh, stride_ct, stride_bt, stride_sl,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, KV_LORA: tl.constexpr, ROPE: tl.constexpr, KV_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr, UPCAST: tl.constexpr, DIRECT: tl.constexpr,
):
    """One program: one sequence, ``BLOCK_H`` query heads, one split of the context (whole
    tiles of ``BLOCK_N`` tokens; a split past the end of a short context does nothing and
    reports an empty result). ``DIRECT`` (one split): the final output, no partials.
    ``UPCAST`` (bfloat16 under the interpreter, which cannot multiply bfloat16): tiles are
    widened to float32 after loading and the output is float32."""
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    kv_len = tl.load(SeqLens + seq * stride_sl)
    per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, kv_len)
    table = BlockTables + seq * stride_bt

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)  # the latent (nope) dims, which are also the value
    offs_r = tl.arange(0, BLOCK_R)  # the rope dims, after them
    h_ok = offs_h < NUM_HEADS
    c_ok = offs_c < KV_LORA
    r_ok = offs_r < ROPE
    q_rows = Q + seq * stride_qb + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_rows + offs_c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    if ROPE > 0:
        q_pe = tl.load(q_rows + KV_LORA + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    if UPCAST:
        q_nope = q_nope.to(tl.float32)
        if ROPE > 0:
            q_pe = q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        key_ok = offs_n < end
        block = tl.load(table + offs_n // KV_BLOCK, mask=key_ok, other=0)
        slot = block.to(tl.int64) * KV_BLOCK + offs_n % KV_BLOCK
        rows = Cache + slot[:, None] * stride_ct
        # the masks keep rows at or past the sequence's end (possibly NaN) out of the tile
        kv = tl.load(rows + offs_c[None, :], mask=key_ok[:, None] & c_ok[None, :], other=0.0)
        if UPCAST:
            kv = kv.to(tl.float32)
        s = _dot(q_nope, tl.trans(kv), FP32_DOT)
        if ROPE > 0:
            k_pe = tl.load(rows + KV_LORA + offs_r[None, :], mask=key_ok[:, None] & r_ok[None, :], other=0.0)
            if UPCAST:
                k_pe = k_pe.to(tl.float32)
            s += _dot(q_pe, tl.trans(k_pe), FP32_DOT)
        s = tl.where(key_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        acc, l_i = _fold(acc, l_i, m_i, s, tl.where(m_new == float("-inf"), 0.0, m_new), kv, FP32_DOT)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if DIRECT:
        tl.store(Out + seq * stride_ob + offs_h[:, None] * stride_oh + offs_c[None, :],
                 out.to(Out.dtype.element_ty), mask=h_ok[:, None] & c_ok[None, :])
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))  # base 2
        part = OutPart + seq * stride_pb + offs_h[:, None] * stride_ph + split * stride_ps + offs_c[None, :]
        tl.store(part, out, mask=h_ok[:, None] & c_ok[None, :])
        tl.store(LsePart + seq * stride_lb + offs_h * stride_lh + split, lse, mask=h_ok)


# the split count is a runtime loop bound: one compiled variant serves every count
@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_merge(
    OutPart, LsePart, Out,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh, num_splits,
    KV_LORA: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Combine one (sequence, head)'s split results by their base-2 log-sum-exps, online:
    an empty split (log-sum-exp -inf) weighs nothing."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < KV_LORA
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_C], tl.float32)
    for split in range(0, num_splits):
        lse = tl.load(LsePart + seq * stride_lb + head * stride_lh + split)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_safe)
        w = tl.math.exp2(lse - m_safe)
        part = tl.load(OutPart + seq * stride_pb + head * stride_ph + split * stride_ps + offs_c, mask=c_ok,
                       other=0.0)
        acc = acc * alpha + w * part
        total = total * alpha + w
        m = m_new
    out = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + seq * stride_ob + head * stride_oh + offs_c, out.to(Out.dtype.element_ty), mask=c_ok)


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               block_size: int, kv_lora_rank: int, scale: float, num_splits: int | None = None,
               config: LaunchConfig | None = None) -> torch.Tensor:
    """Absorbed-MLA decode attention of one query row per sequence over its paged latent cache.

    ``q`` [B, H, D]: the absorbed queries (``q_nope @ W_UK`` then the rotated ``q_pe``), with
    ``D = kv_lora_rank + rope_dim``, in float32, bfloat16 or float16. ``cache`` [num_slots, D],
    same dtype, rows contiguous: one layer's latent vectors. ``block_tables`` [B, max_blocks]
    (integer; entries past a sequence's blocks are never read, -1 is fine) and ``seq_lens`` [B]
    (each at least 1) place sequence b's tokens 0..seq_lens[b]-1.

    Returns ``out`` [B, H, kv_lora_rank] in ``q``'s dtype: ``softmax(scale * q[b, h] . K_b^T)
    @ V_b``, K_b the sequence's cached rows, V_b their first ``kv_lora_rank`` numbers; float32
    accumulation throughout. No slot at or past a sequence's length is read.

    ``num_splits``: how many ways each sequence's context is split (whole tiles per split; a
    split past the end of a short context is empty and costs only its launch). ``None`` picks
    it with ``default_num_splits`` from the batch, the head count and the context bound
    ``max_blocks * block_size`` (the table's width, not ``seq_lens``: nothing is read back to
    the host, so the launch depends only on shapes and a CUDA graph can replay it).
    ``config``: the launch shape (default ``launch_config``; benchmarks sweep it)."""
    if q.dim() != 3 or cache.dim() != 2:
        raise ValueError(f"q must be [B, H, D] and cache [num_slots, D], got {tuple(q.shape)} and {tuple(cache.shape)}")
    num_seqs, num_heads, dim = q.shape
    if cache.shape[1] != dim:
        raise ValueError(f"q's last dim {dim} differs from the cache's {cache.shape[1]}")
    if not 0 < kv_lora_rank <= dim:
        raise ValueError(f"kv_lora_rank must be in 1..{dim}, got {kv_lora_rank}")
    if cache.dtype != q.dtype or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q and cache must share one of float32, bfloat16, float16, got {q.dtype} and {cache.dtype}")
    if cache.stride(1) != 1:
        raise ValueError("the cache's rows must be contiguous")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(f"block_tables must be [B, max_blocks] and seq_lens [B] for B = {num_seqs}")
    out = torch.empty(num_seqs, num_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if num_seqs == 0 or num_heads == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    rope_dim = dim - kv_lora_rank
    cfg = config or launch_config(q.dtype, q.device)
    block_n = cfg.block_n
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_heads, block_tables.shape[1] * block_size, block_n, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")

    upcast = q.dtype == torch.bfloat16 and interpreting()
    # the interpreter's float32 -> bfloat16 cast truncates: write float32, round with torch
    target = torch.empty_like(out, dtype=torch.float32) if upcast else out
    direct = num_splits == 1
    block_c = max(16, triton.next_power_of_2(kv_lora_rank))
    if direct:
        part, lse = target, target  # never touched
        part_strides, lse_strides = (0, 0, 0), (0, 0)
    else:
        part = torch.empty(num_seqs, num_heads, num_splits, kv_lora_rank, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_strides, lse_strides = (part.stride(0), part.stride(1), part.stride(2)), (lse.stride(0), lse.stride(1))
    _mla_decode_split[(num_seqs, triton.cdiv(num_heads, BLOCK_H), num_splits)](
        q, cache, block_tables, seq_lens, part, lse, target, scale * LOG2E,
        q.stride(0), q.stride(1), cache.stride(0), block_tables.stride(0), seq_lens.stride(0),
        *part_strides, *lse_strides, target.stride(0), target.stride(1),
        NUM_HEADS=num_heads, KV_LORA=kv_lora_rank, ROPE=rope_dim, KV_BLOCK=block_size,
        BLOCK_H=BLOCK_H, BLOCK_C=block_c, BLOCK_R=max(16, triton.next_power_of_2(max(rope_dim, 1))),
        BLOCK_N=block_n, FP32_DOT=q.dtype == torch.float32 or upcast, UPCAST=upcast, DIRECT=direct,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not direct:
        _mla_decode_merge[(num_seqs, num_heads)](
            part, lse, target, *part_strides, *lse_strides, target.stride(0), target.stride(1), num_splits,
            KV_LORA=kv_lora_rank, BLOCK_C=block_c,
        )
    if upcast:
        out.copy_(target)
    return out
