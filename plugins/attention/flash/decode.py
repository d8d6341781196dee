"""The `flash` decode kernel: split-K flash-decoding for one query row per sequence over its
paged context. Each program attends one KV head's query heads over one split of the context;
a merge kernel combines the splits by their log-sum-exps (one split writes its result in place).
A layer's attention sinks join the softmax once, where the splits are combined (in the merge,
or in the single split's own normalisation).

Over an int8 cache the per-token scales never touch the K/V tiles: a token's K scale is
constant along head_dim, so it factors out of its score (s[g, n] = k_scale[n] * q[g] .
k_int8[n]), and its V scale folds into that token's softmax weight (sum_n p[g, n] v_scale[n]
v_int8[n]). The int8 tiles convert straight to the compute dtype (exact: |q| <= 127), one
conversion an element and no float32 tile, and the scales cost [BLOCK_N] loads and [G,
BLOCK_N] multiplies a tile instead of [BLOCK_N, D]. With half the bytes a token, the int8
path takes its own launch shape (``decode_config(quant=True)``): twice the keys a tile, so a
tile moves as many bytes as bfloat16's, and more warps to convert them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessellm.plugins.attention.flash.common import (LOG2E, TL_DTYPES, KernelConfig, _add_sink, _dot, _fold,
                                                     _softcap, interpreting, scale_args, sink_args, softcap_log2)


def decode_config(head_dim: int, device: torch.device, block_n: int | None = None, quant: bool = False
                  ) -> KernelConfig:
    """The split-K decode kernel's launch shape (block_m is unused: a program holds one KV
    head's query heads); ``quant``: over an int8 cache."""
    if device.type != "cuda":
        return KernelConfig(16, block_n or 32, 4, 1)
    if quant:
        # 128 int8 keys a tile move bfloat16's 64 keys' bytes; 4 warps convert them (no spills
        # and 4-5 programs an SM on sm_90, bench/compile_hopper.py; `bench/kernels.py
        # --sweep-int8` times the alternatives on a GPU)
        return KernelConfig(16, block_n or 128, 4, 3)
    # the best worst case over batch 16 at 4k and batch 64 at 16k of `python bench/kernels.py
    # --sweep` (head dim 64, GQA 4, bf16; docs/benchmarks.md, "Decode")
    return KernelConfig(16, block_n or 64, 2, 4)


@triton.jit
def _fold_scaled(acc, l_i, m_i, s, m_safe, v, v_scale, FP32_DOT: tl.constexpr):
    """``_fold`` over int8 values ``v`` (converted, unscaled) whose per-token scales
    ``v_scale`` [BLOCK_N] weigh each token's softmax weight instead: the sum ``l_i`` takes the
    plain weights, the output their scaled ones."""
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot((p * v_scale[None, :]).to(v.dtype), v, FP32_DOT)
    return acc, l_i


@triton.jit(do_not_specialize=["stride_bt", "stride_bh"])
def _paged_decode_split(
    Q, K, V, KScale, VScale, OutPart, LsePart, Out, BlockTables, Rows, SeqLens, Sinks,
    scale_log2,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_st, stride_sh, stride_bt, stride_bh, stride_ls, stride_lh,
    stride_pb, stride_ph, stride_ps, stride_ot, stride_oh,
    GROUP: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr, KV_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr, UPCAST: tl.constexpr, DIRECT: tl.constexpr, QUANT: tl.constexpr, COMPUTE: tl.constexpr,
):
    """One program: one decoding sequence, one KV head (all GROUP query heads that read it,
    so each K/V block is loaded once per KV head), one split of the context. ``DIRECT`` (a
    single split) writes the final output, with no partials to merge. ``QUANT``: K and V are
    int8, dequantized with their per-token scales (``KScale``, ``VScale``) to ``COMPUTE``.
    Block tables and lengths may differ per KV head (``stride_bh``, ``stride_lh`` nonzero:
    sparse attention, each head reading its own chosen blocks). ``SOFTCAP``: the base-2 logit
    cap (0.0: none); ``SINKS``: ``Sinks`` [Hq] holds sink logits, folded in here only when
    ``DIRECT`` (otherwise the merge adds them, once)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    row = tl.load(Rows + seq)
    kv_len = tl.load(SeqLens + seq * stride_ls + kv_head * stride_lh)
    table = BlockTables + seq * stride_bt + kv_head * stride_bh
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
        block = tl.load(table + offs_n // KV_BLOCK, mask=key_ok, other=0)
        slot = block.to(tl.int64) * KV_BLOCK + offs_n % KV_BLOCK
        kv_ptr = slot[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        k = tl.load(K + kv_ptr, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + kv_ptr, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif QUANT:  # exact: int8 values are integers up to 127
            k = k.to(COMPUTE)
            v = v.to(COMPUTE)
        if QUANT:  # the scales factor out of the scores and into the softmax weights
            scale_ptr = slot * stride_st + kv_head * stride_sh
            k_scale = tl.load(KScale + scale_ptr, mask=key_ok, other=0.0).to(tl.float32)
            v_scale = tl.load(VScale + scale_ptr, mask=key_ok, other=0.0).to(tl.float32)
            s = _dot(q, tl.trans(k), FP32_DOT) * (k_scale * scale_log2)[None, :]
        else:
            s = _dot(q, tl.trans(k), FP32_DOT) * scale_log2
        if SOFTCAP > 0:  # after the scale, before the mask
            s = _softcap(s, SOFTCAP)
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        if QUANT:
            acc, l_i = _fold_scaled(acc, l_i, m_i, s, m_safe, v, v_scale, FP32_DOT)
        else:
            acc, l_i = _fold(acc, l_i, m_i, s, m_safe, v, FP32_DOT)
        m_i = m_new
    if SINKS and DIRECT:
        acc, l_i = _add_sink(acc, l_i, m_i, tl.load(Sinks + heads, mask=g_ok, other=0.0))
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
    OutPart, LsePart, Out, Rows, Sinks,
    stride_pb, stride_ph, stride_ps, stride_ot, stride_oh, num_splits,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr,
):
    """Combine one (sequence, head)'s split results by their (base-2) log-sum-exps; ``SINKS``:
    the head's sink logit (``Sinks`` [Hq]) joins the denominator once, not once per split."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(LsePart + (seq * stride_pb + head * stride_ph) // BLOCK_D + offs_s, mask=s_ok,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    if SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634  # log2(e): base 2, as the lse
        m = tl.maximum(m, sink)
    w = tl.where(s_ok & (lse > float("-inf")), tl.math.exp2(lse - m), 0.0)
    parts = tl.load(OutPart + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w, 0)
    if SINKS:
        total += tl.math.exp2(sink - m)
    out = tl.sum(parts * w[:, None], 0) / total
    row = tl.load(Rows + seq)
    tl.store(Out + row * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)


DECODE_PROGRAMS = 512
"""Programs the split-K decode aims for: a few per SM of a large GPU, so enough loads are in
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
                           config: KernelConfig | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> None:
    """Flash-decoding: attention of one query row per sequence (packed rows ``rows`` [B] of
    ``q``) over its paged context, the context split ``num_splits`` ways and merged; the
    result is written into ``out`` at the same rows. An int8 cache comes with its scales
    ``k_scale``, ``v_scale`` [num_slots, Hkv, 1].

    ``block_tables`` [B, max_blocks] and ``seq_lens`` [B] serve every KV head; per-head ones,
    [B, Hkv, max_blocks] and [B, Hkv], give each KV head its own blocks and length (QUEST's
    chosen blocks, in position order, the newest last: only those are read).

    ``softcap``: the scaled scores s become softcap * tanh(s / softcap) before masking;
    ``sinks`` [Hq] (float32): each query head's sink logit joins its softmax denominator.

    The launch depends on the batch only through ``num_splits`` and the shapes, so a caller
    that fixes both (a CUDA graph) can replay it for any lengths up to ``max_kv_len``."""
    num_seqs = rows.shape[0]
    if num_seqs == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    cfg = config or decode_config(head_dim, q.device, block_n, quant=k_scale is not None)
    splits = num_splits or default_num_splits(num_seqs, num_kv_heads, max_kv_len, cfg.block_n)
    block_d = triton.next_power_of_2(head_dim)
    upcast = q.dtype == torch.bfloat16 and interpreting()
    target = out if not upcast else torch.empty_like(out, dtype=torch.float32)
    direct = splits == 1  # one split: its result is final, written in place (no merge launch)
    # partial outputs [B, Hq, S, BLOCK_D] and their lse [B, Hq, S] share strides / BLOCK_D
    part = target if direct else torch.empty(num_seqs, num_heads, splits, block_d, dtype=torch.float32, device=q.device)
    lse = target if direct else torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
    part_strides = (0, 0, 0) if direct else (part.stride(0), part.stride(1), part.stride(2))
    k_scales, v_scales, stride_st, stride_sh = scale_args(k_scale, v_scale, k_cache)
    sink_ptr, has_sinks = sink_args(sinks, num_heads, q)
    per_head = block_tables.dim() == 3
    table_strides = (block_tables.stride(0), block_tables.stride(1) if per_head else 0)
    len_strides = (seq_lens.stride(0), seq_lens.stride(1) if per_head else 0)
    _paged_decode_split[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, k_scales, v_scales, part, lse, target, block_tables, rows, seq_lens, sink_ptr,
        scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), stride_st, stride_sh, *table_strides,
        *len_strides, *part_strides, target.stride(0), target.stride(1),
        GROUP=group, WINDOW=window or 0, SOFTCAP=softcap_log2(softcap), SINKS=has_sinks, KV_BLOCK=kv_block_size,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg.block_n,
        FP32_DOT=q.dtype == torch.float32 or upcast, UPCAST=upcast, DIRECT=direct,
        QUANT=k_scale is not None, COMPUTE=TL_DTYPES[q.dtype],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not direct:
        _paged_decode_merge[(num_seqs, num_heads)](
            part, lse, target, rows, sink_ptr, part.stride(0), part.stride(1), part.stride(2), target.stride(0),
            target.stride(1), splits, BLOCK_S=max(MAX_AUTO_SPLITS, triton.next_power_of_2(splits)),
            HEAD_DIM=head_dim, BLOCK_D=block_d, SINKS=has_sinks,
        )
    if upcast:
        out[rows] = target[rows].to(out.dtype)
