"""int8 weight-only matmul on the GPU: a Triton kernel that reads the weights as one byte
each and converts them in registers, inside the K loop.

Each program computes a BLOCK_M x BLOCK_N tile of y = x @ (q * scale).T over one split of K
(split_k.py: few rows split K so a decode step keeps the GPU's SMs busy). It loads a BLOCK_K
slice of x and of the int8 weight, converts the weight to x's dtype (exact: |q| <= 127) and
accumulates a float32 ``tl.dot``. Scales never touch the weight tile: a group's scale
multiplies that tile's product ([BLOCK_M, BLOCK_N] multiplies, not [BLOCK_K, BLOCK_N]),
per-channel scales the finished tile once. Decode (M = 1) pads to BLOCK_M rows under a mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessellm.plugins.quant import split_k


@triton.jit
def _int8_weight_kernel(X, Q, Scale, Part, M, N, K, k_per_split, stride_xm, stride_qn, stride_sn, stride_ps,
                        stride_pm, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr, FLOAT_WEIGHTS: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + rk
        k_ok = k < k_end
        x = tl.load(X + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = n_ok[None, :] & k_ok[:, None]
        if FLOAT_WEIGHTS:  # e4m3: a masked lane's bits could be NaN, so zero it after the cast
            w = tl.where(w_ok, tl.load(Q + rn[None, :] * stride_qn + k[:, None], mask=w_ok).to(x.dtype), 0.0)
        else:
            w = tl.load(Q + rn[None, :] * stride_qn + k[:, None], mask=w_ok, other=0).to(x.dtype)
        # w: [BLOCK_K, BLOCK_N], exact (|q| <= 127; e4m3 in bfloat16, float16 and float32)
        if FP32_DOT:  # float32 activations: float32 products, as torch's matmul (not TF32)
            part = tl.dot(x, w, input_precision="ieee")
        else:
            part = tl.dot(x, w)
        if GROUP > 0:  # BLOCK_K divides GROUP: one scale per output channel for this slice
            acc += part * tl.load(Scale + rn * stride_sn + k0 // GROUP, mask=n_ok, other=0.0)[None, :]
        else:
            acc += part
    if GROUP == 0:
        acc *= tl.load(Scale + rn, mask=n_ok, other=0.0)[None, :]
    tl.store(Part + split * stride_ps + rm[:, None] * stride_pm + rn[None, :], acc.to(Part.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def launch_shape(m: int, group: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for ``m`` rows: 16-row tiles for decode-sized steps."""
    block_k = 64 if group == 0 else min(64, group)
    return (16 if m <= 16 else 64), 64, block_k


def triton_int8_weight_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                              splits: int | None = None) -> torch.Tensor:
    """x [M, K] @ (q [N, K] int8 * scale).T -> [M, N] in x's dtype; scale [N] per channel or
    [N, K // group] per group (a group of at least 16 input channels). ``q`` may be e4m3
    (`fp8`'s weights) as well. ``splits``: ways to split K (default: as
    split_k.choose_splits finds for the device)."""
    m, k = x.shape
    n = q.shape[0]
    x = x.contiguous()
    group = 0 if scale.dim() == 1 else k // scale.shape[1]
    block_m, block_n, block_k = launch_shape(m, group)
    if group and group % block_k:
        raise ValueError(f"int8 kernel: group size {group} is not a multiple of its K tile {block_k}")
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    splits = split_k.choose_splits(tiles, k, block_k, x.device, splits)
    part = split_k.partials(splits, m, n, x.dtype, x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
    _int8_weight_kernel[grid](x, q, scale, part, m, n, k, split_k.k_per_split(k, block_k, splits), x.stride(0),
                              q.stride(0), scale.stride(0), part.stride(0), part.stride(1), GROUP=group,
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP32_DOT=x.dtype == torch.float32,
                              FLOAT_WEIGHTS=q.dtype.is_floating_point)
    return split_k.finish(part, x.dtype)
