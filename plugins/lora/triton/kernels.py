"""The `triton` LoRA kernels: Punica's segmented gather matrix products (SGMV), in two launches.

A packed batch is a list of segments, one per sequence (rows ``query_start_loc[i] ..
query_start_loc[i + 1] - 1``), each under one adapter slot (``seq_slots[i]``, -1: none)::

    shrink:  h[t, :R] = A[s] @ x[t]        accumulated and kept in float32
    expand:  out[t] += B[s] @ h[t]         in place, one rounding to out's dtype per row

h is never rounded to the model dtype (the torch reference rounds it there). A 16-bit
model's expand runs a tf32 tensor-core dot: B exactly, h to tf32's 10-bit mantissa (finer
than bfloat16's 7 bits); a float32 model's dots use exact float32 products.

- ``_shrink_kernel``: one program per (row-tile program, split of K x tile of R, segment).
  A program walks its segment's row tiles (``row_programs`` apart) and, for each, the K
  columns of its split; with ``split > 1`` each split writes its own float32 partial of h
  (no atomics: the sum is deterministic), which is how a decode batch of a few rows still
  reads A with many programs at once.
- ``_expand_kernel``: one program per (tile of N, row-tile program, segment). It sums the
  split partials of h as it loads them and adds B[s] @ h into ``out``.

A program whose segment has slot -1, or none of whose row tiles fall inside its segment,
exits at once: its rows are never read or written. The kernels read the segments from the
device tensors only, and a segment of any length is covered by the row-tile loop, so one
launch shape (grid from the shapes, ``row_programs`` and ``split``) serves every batch of those
shapes: what a CUDA graph needs.

Under Triton's interpreter (CPU tests) bfloat16 tiles are computed in float32 (``UPCAST``:
the interpreter's bfloat16 dot is wrong and its float32 -> bfloat16 cast truncates), the
products exact and the result rounded to nearest even by hand, as compiled code rounds.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_SPLIT = 16
"""The most ways the shrink splits K (each split's partial of h is summed by the expand)."""


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes (powers of two, at least 16: ``tl.dot``'s smallest) and the K split."""

    block_m: int  # rows per tile (both kernels)
    block_k: int  # shrink: columns of x per step
    block_n: int  # expand: output columns per program
    block_r: int  # ranks per tile (shrink: per program; expand: per step of its rank loop)
    split: int  # shrink: ways K is split (partials summed by the expand)
    num_warps: int = 4


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int | None) -> int:
    device = torch.cuda.current_device() if index is None else index
    return torch.cuda.get_device_properties(device).multi_processor_count


def block_m_for(max_rows: int, device: torch.device) -> int:
    """Row tile for segments of at most ``max_rows`` rows: 16 for decodes (a wider tile
    would be mostly masked), wider for prefills."""
    if max_rows <= 16:
        return 16
    return 64 if device.type == "cuda" else 32


def launch_config(k: int, n: int, rank: int, block_m: int, row_tiles: int, device: torch.device,
                  block_n: int | None = None, block_k: int | None = None, split: int | None = None) -> LaunchConfig:
    """The launch shape of one apply (x [T, k], out [T, n], ``rank`` slot ranks), for
    ``row_tiles`` row-tile programs in all (segments x programs per segment). Unless given, the
    split fills the GPU with two shrink programs per SM where the batch alone leaves it idle
    (decodes): a power of two, at most ``MAX_SPLIT`` and at most K's column tiles. It
    depends on the shapes only, so a captured graph keeps it."""
    cuda = device.type == "cuda"
    # compiled for sm_90 (tessellm.testing.triton_variants): these shapes keep every rank up to
    # 64 free of register spills; a decode's row tile needs fewer warps than a prefill's
    widest_n = (128 if block_m >= 64 else 64) if cuda else 32
    block_r = max(16, min(64, triton.next_power_of_2(rank)))
    block_k = block_k or max(16, min(128 if cuda else 32, triton.next_power_of_2(k)))
    block_n = block_n or max(16, min(widest_n, triton.next_power_of_2(n)))
    num_warps = 8 if cuda and block_m >= 64 else 4
    if split is None:
        programs = row_tiles * triton.cdiv(rank, block_r)
        target = 2 * _sm_count(device.index) if cuda else 4
        split = 1
        while programs * split < target and split < MAX_SPLIT and 2 * split <= triton.cdiv(k, block_k):
            split *= 2
    return LaunchConfig(block_m, block_k, block_n, block_r, split, num_warps)


@triton.jit
def _rounded(x, UPCAST: tl.constexpr):
    """float32 ``x``, ready for the cast to the output dtype; ``UPCAST`` (bfloat16 under the
    interpreter, whose cast truncates): rounded by hand to nearest even bfloat16, which the
    cast then keeps exactly."""
    if UPCAST:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    """a @ b with float32 accumulation: exact float32 products ("ieee") where FP32_DOT."""
    if FP32_DOT:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit(do_not_specialize=["stride_ht", "split"])
def _shrink_kernel(
    X,  # [T, K] the layer's input rows
    A,  # [S, R, K] shrink matrices, one per slot
    H,  # [T, SPLIT, R] float32: each split's partial of A[s] @ x[t]
    SeqSlots,  # [B] int32 each segment's slot, -1: none
    QueryStart,  # [B + 1] int32 each segment's first row, then its end
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ht, stride_hs,
    K, R, split, r_tiles,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    FP32_DOT: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(2)
    slot = tl.load(SeqSlots + seq)
    if slot < 0:
        return
    start = tl.load(QueryStart + seq)
    end = tl.load(QueryStart + seq + 1)
    part = tl.program_id(1) // r_tiles  # this program's split of K
    r = (tl.program_id(1) % r_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    a_rows = A + slot.to(tl.int64) * stride_as + r[None, :] * stride_ar  # [1, BLOCK_R]
    offs_k = tl.arange(0, BLOCK_K)
    for m0 in range(start + tl.program_id(0) * BLOCK_M, end, tl.num_programs(0) * BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        x_rows = X + rows.to(tl.int64)[:, None] * stride_xt  # [BLOCK_M, 1]
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(part * BLOCK_K, K, split * BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            x = tl.load(x_rows + k[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_rows + k[:, None] * stride_ak, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            if UPCAST:
                x = x.to(tl.float32)
                a = a.to(tl.float32)
            acc += _dot(x, a, FP32_DOT)
        dst = H + rows.to(tl.int64)[:, None] * stride_ht + part * stride_hs + r[None, :]
        tl.store(dst, acc, mask=row_ok[:, None] & r_ok[None, :])


@triton.jit(do_not_specialize=["stride_ht", "split"])
def _expand_kernel(
    H,  # [T, SPLIT, R] float32 partials of the shrink
    B,  # [S, N, R] expand matrices, one per slot (scaling folded in)
    Out,  # [T, N] the base layer's output, added to in place
    SeqSlots,  # [B] int32 each segment's slot, -1: none
    QueryStart,  # [B + 1] int32 each segment's first row, then its end
    stride_ht, stride_hs, stride_bs, stride_bn, stride_br, stride_ot, stride_on,
    N, R, split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    FP32_DOT: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(2)
    slot = tl.load(SeqSlots + seq)
    if slot < 0:
        return
    start = tl.load(QueryStart + seq)
    end = tl.load(QueryStart + seq + 1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    b_cols = B + slot.to(tl.int64) * stride_bs + n[None, :] * stride_bn  # [1, BLOCK_N]
    offs_r = tl.arange(0, BLOCK_R)
    for m0 in range(start + tl.program_id(1) * BLOCK_M, end, tl.num_programs(1) * BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        h_rows = H + rows.to(tl.int64)[:, None] * stride_ht  # [BLOCK_M, 1]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + offs_r
            r_ok = r < R
            h_ok = row_ok[:, None] & r_ok[None, :]
            h = tl.load(h_rows + r[None, :], mask=h_ok, other=0.0)
            for part in range(1, split):
                h += tl.load(h_rows + part * stride_hs + r[None, :], mask=h_ok, other=0.0)
            b = tl.load(b_cols + r[:, None] * stride_br, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            acc += _dot(h, b.to(tl.float32), FP32_DOT)
        dst = Out + rows.to(tl.int64)[:, None] * stride_ot + n[None, :] * stride_on
        ok = row_ok[:, None] & n_ok[None, :]
        total = tl.load(dst, mask=ok, other=0.0).to(tl.float32) + acc
        tl.store(dst, _rounded(total, UPCAST).to(Out.dtype.element_ty), mask=ok)


def sgmv_shrink_expand(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       seq_slots: torch.Tensor, query_start_loc: torch.Tensor, row_programs: int,
                       config: LaunchConfig) -> None:
    """``out[t] += b[s] @ (a[s] @ x[t])`` for every row t of each segment i (rows
    ``query_start_loc[i] .. query_start_loc[i + 1] - 1``) whose slot ``s = seq_slots[i]`` is
    >= 0; other rows are neither read nor written.

    x [T, K], out [T, N] (any strides; same dtype), a [S, R, K], b [S, N, R] (any strides),
    seq_slots [B] and query_start_loc [B + 1] int32 on the same device. ``row_programs``
    programs share each segment's row tiles (at least one; more only speed up long
    segments). The shrink's result stays float32 (``config.split`` partials)."""
    num_tokens, k = x.shape
    n = out.shape[1]
    num_slots, rank = a.shape[0], a.shape[1]
    if out.shape[0] != num_tokens or a.shape[2] != k or b.shape != (num_slots, n, rank):
        raise ValueError(f"LoRA shapes disagree: x {tuple(x.shape)}, out {tuple(out.shape)}, a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)} (want x [T, K], out [T, N], a [S, R, K], b [S, N, R])")
    if not (out.dtype == x.dtype == a.dtype == b.dtype):
        raise ValueError(f"LoRA dtypes disagree: out {out.dtype}, x {x.dtype}, a {a.dtype}, b {b.dtype}")
    num_seqs = seq_slots.shape[0]
    if num_tokens == 0 or num_seqs == 0 or row_programs == 0:
        return
    c = config
    fp32_dot = x.dtype == torch.float32
    upcast = x.dtype == torch.bfloat16 and interpreting()
    r_tiles = triton.cdiv(rank, c.block_r)
    h = torch.empty(num_tokens, c.split, rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(row_programs, c.split * r_tiles, num_seqs)](
        x, a, h, seq_slots, query_start_loc, x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        h.stride(0), h.stride(1), k, rank, c.split, r_tiles,
        BLOCK_M=c.block_m, BLOCK_K=c.block_k, BLOCK_R=c.block_r, FP32_DOT=fp32_dot, UPCAST=upcast,
        num_warps=c.num_warps)
    _expand_kernel[(triton.cdiv(n, c.block_n), row_programs, num_seqs)](
        h, b, out, seq_slots, query_start_loc, h.stride(0), h.stride(1), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), n, rank, c.split,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_R=c.block_r, FP32_DOT=fp32_dot, UPCAST=upcast,
        num_warps=c.num_warps)
