"""int8 weight-only matmul on the GPU: a Triton kernel that dequantizes weight tiles in
registers, inside the K loop, so the weights cross memory as one byte each.

Each program computes a BLOCK_M x BLOCK_N tile of y = x @ (q * scale).T: it loads a
BLOCK_K slice of x and of the int8 weight, converts the weight to x's dtype (times its
group's scale, with groups) and accumulates a float32 ``tl.dot``; per-channel scales
multiply the finished tile once. Decode (M = 1) pads to BLOCK_M rows under a mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int8_weight_kernel(X, Q, Scale, Y, M, N, K, stride_xm, stride_qn, stride_ym, stride_sn,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        FP32_DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        x = tl.load(X + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(Q + rn[None, :] * stride_qn + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0)
        w = w.to(x.dtype)  # [BLOCK_K, BLOCK_N]
        if GROUP > 0:  # BLOCK_K divides GROUP: one scale per output channel in this slice
            s = tl.load(Scale + rn * stride_sn + k0 // GROUP, mask=n_ok, other=0.0)
            w = (w.to(tl.float32) * s[None, :]).to(x.dtype)
        if FP32_DOT:  # float32 activations: float32 products, as torch's matmul (not TF32)
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if GROUP == 0:
        acc *= tl.load(Scale + rn, mask=n_ok, other=0.0)[None, :]
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def triton_int8_weight_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (q [N, K] int8 * scale).T -> [M, N] in x's dtype; scale [N] per channel or
    [N, K // group] per group (a group of at least 16 input channels)."""
    m, k = x.shape
    n = q.shape[0]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    group = 0 if scale.dim() == 1 else k // scale.shape[1]
    block_k = 64 if group == 0 else min(64, group)
    if group and group % block_k:
        raise ValueError(f"int8 kernel: group size {group} is not a multiple of its K tile {block_k}")
    block_m = 16 if m <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_weight_kernel[grid](x, q, scale, y, m, n, k, x.stride(0), q.stride(0), y.stride(0),
                              scale.stride(0), GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                              FP32_DOT=x.dtype == torch.float32)
    return y
