"""int4 weight-only matmul on the GPU: a Triton kernel that reads the packed nibbles as half a
byte a weight and unpacks them in registers, inside its K loop.

Each program computes a BLOCK_M x BLOCK_N tile of y = x @ W.T over one split of K
(split_k.py), W[n, k] = q * scale + offset with q the nibble of ``packed[n, k // 2]`` (low for
even k) and scale and offset those of k's group. A K tile of BLOCK_K columns lies inside one
group (BLOCK_K divides the group size), so the group's scale and offset factor out of it:

    x . W[n] over the tile = scale[n] * (x_even . lo[n] + x_odd . hi[n]) + offset[n] * sum(x)

with lo and hi the tile's low and high nibbles (integers 0..15, exact in x's dtype) and
x_even, x_odd the activations' even and odd columns. Each byte is loaded once, the nibbles
go straight into two ``tl.dot``s, and scale and offset are one vector each per tile (no
per-weight multiply-add, no per-weight scale loads). Accumulation is float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessellm.plugins.quant import split_k


@triton.jit
def _int4_weight_kernel(X, P, Scale, Offset, Part, M, N, K, k_per_split, stride_xm, stride_pn, stride_sn,
                        stride_ps, stride_pm, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, BLOCK_K // 2)  # byte (column pair) within the tile
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_start = split * k_per_split  # even: a whole number of K tiles
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kb = k0 // 2 + rb
        byte = tl.load(P + rn[None, :] * stride_pn + kb[:, None], mask=n_ok[None, :] & (2 * kb < k_end)[:, None],
                       other=0)
        k = k0 + rk
        x = tl.load(X + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & (k < k_end)[None, :], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))  # columns 2j and 2j + 1
        lo = (byte & 15).to(x.dtype)  # [BLOCK_K / 2, BLOCK_N], exact
        hi = (byte >> 4).to(x.dtype)
        if FP32_DOT:  # float32 activations: float32 products, as torch's matmul (not TF32)
            part = tl.dot(x_even, lo, input_precision="ieee") + tl.dot(x_odd, hi, input_precision="ieee")
        else:
            part = tl.dot(x_even, lo) + tl.dot(x_odd, hi)
        group = k0 // GROUP
        scale = tl.load(Scale + rn * stride_sn + group, mask=n_ok, other=0.0)
        offset = tl.load(Offset + rn * stride_sn + group, mask=n_ok, other=0.0)
        x_sum = tl.sum(x.to(tl.float32), axis=1)
        acc += part * scale[None, :] + x_sum[:, None] * offset[None, :]
    tl.store(Part + split * stride_ps + rm[:, None] * stride_pm + rn[None, :], acc.to(Part.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def launch_shape(m: int, group_size: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for ``m`` rows: 16-row tiles for decode-sized steps, K
    tiles of at most 64 columns that divide the group. 64-row tiles run 8 warps (4 need 238
    registers a thread on sm_90, 8 about half)."""
    return (16 if m <= 16 else 64), 64, min(64, group_size)


def triton_int4_weight_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                              group_size: int, splits: int | None = None) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in x's dtype; packed [N, K / 2] uint8, scale and offset [N, G]
    float32 (quantize.py's layout; groups of at least 32). ``splits``: ways to split K
    (default: split_k.choose_splits for the device)."""
    m, k = x.shape
    n = packed.shape[0]
    x = x.contiguous()
    scale, offset = scale.contiguous(), offset.contiguous()
    block_m, block_n, block_k = launch_shape(m, group_size)
    if group_size % block_k:
        raise ValueError(f"int4 kernel: group size {group_size} is not a multiple of its K tile {block_k}")
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    splits = split_k.choose_splits(tiles, k, block_k, x.device, splits)
    part = split_k.partials(splits, m, n, x.dtype, x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
    _int4_weight_kernel[grid](x, packed, scale, offset, part, m, n, k, split_k.k_per_split(k, block_k, splits),
                              x.stride(0), packed.stride(0), scale.stride(0), part.stride(0), part.stride(1),
                              GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                              FP32_DOT=x.dtype == torch.float32, num_warps=4 if block_m == 16 else 8)
    return split_k.finish(part, x.dtype)
