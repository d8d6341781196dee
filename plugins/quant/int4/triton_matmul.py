"""int4 weight-only matmul on the GPU: a Triton kernel that unpacks and dequantizes weight
tiles in registers inside its K loop, so the weights cross memory as half a byte each.

Each program computes a BLOCK_M x BLOCK_N tile of y = x @ W.T, W[n, k] = q * scale + offset
with q the nibble of ``packed[n, k // 2]`` (low for even k), and scale and offset those of
k's group. The dequantized tile is in x's dtype and the dot accumulates in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_weight_kernel(X, P, Scale, Offset, Y, M, N, K, stride_xm, stride_pn, stride_sn, stride_ym,
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
        wk_ok = n_ok[None, :] & k_ok[:, None]
        x = tl.load(X + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        byte = tl.load(P + rn[None, :] * stride_pn + (k // 2)[:, None], mask=wk_ok, other=0).to(tl.int32)
        q = (byte >> ((k % 2) * 4)[:, None]) & 15  # [BLOCK_K, BLOCK_N]
        group = (k // GROUP)[:, None]
        scale = tl.load(Scale + rn[None, :] * stride_sn + group, mask=wk_ok, other=0.0)
        offset = tl.load(Offset + rn[None, :] * stride_sn + group, mask=wk_ok, other=0.0)
        w = (q.to(tl.float32) * scale + offset).to(x.dtype)
        if FP32_DOT:  # float32 activations: float32 products, as torch's matmul (not TF32)
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def triton_int4_weight_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                              group_size: int) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in x's dtype; packed [N, K / 2] uint8, scale and offset [N, G]
    float32, both contiguous (quantize.py's layout)."""
    m, k = x.shape
    n = packed.shape[0]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _int4_weight_kernel[grid](x, packed, scale.contiguous(), offset.contiguous(), y, m, n, k, x.stride(0), packed.stride(0), scale.stride(0),
                              y.stride(0), GROUP=group_size, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64,
                              FP32_DOT=x.dtype == torch.float32)
    return y
