"""`w8a8`'s int8 x int8 matmul in Triton: the activations quantized per token by one kernel,
their product with the int8 weight accumulated exactly in int32 by another, both scales
applied in its epilogue.

``quantize_rows`` computes what w8a8.py's ``quantize_per_token`` does, bit for bit: the
row's largest magnitude over 127 (float32), each value divided by it with IEEE rounding
(``div_rn``), rounded half to even (adding and removing 1.5 * 2^23, exact in float32 for
|v| <= 2^22) and clamped to +-127. ``triton_w8a8_matmul`` then accumulates ``tl.dot`` of
int8 tiles in int32 (tensor cores' integer MMA; exact, as ``torch._int_mm``) and writes
``acc * x_scale * w_scale`` in float32, rounded once to the output dtype: the same operations
in the same order as w8a8.py's ``w8a8_matmul``, in two launches instead of five.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROUND = tl.constexpr(12582912.0)
"""1.5 * 2^23: v + ROUND - ROUND rounds a float32 |v| <= 2^22 to an integer, half to even."""


@triton.jit
def _quantize_rows_kernel(X, Q, Scale, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0), 1e-12) / 127.0
    tl.store(Scale + row, scale)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs < K
        x = tl.load(X + row * stride_xm + k0 + offs, mask=k_ok, other=0.0).to(tl.float32)
        v = (tl.math.div_rn(x, scale) + ROUND) - ROUND
        q = tl.minimum(tl.maximum(v, -127.0), 127.0)
        tl.store(Q + row * stride_qm + k0 + offs, q.to(tl.int8), mask=k_ok)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], float32 scale [M, 1]) of x [M, K]: ``quantize_per_token``'s result."""
    m, k = x.shape
    x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0),
                                    BLOCK_K=min(2048, triton.next_power_of_2(max(k, 16))))
    return q, scale


@triton.jit
def _w8a8_kernel(XQ, XScale, Q, WScale, Y, M, N, K, stride_xm, stride_qn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        a = tl.load(XQ + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(Q + rn[None, :] * stride_qn + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0)
        acc += tl.dot(a, b)  # int8 x int8 -> int32, exact
    x_scale = tl.load(XScale + rm, mask=m_ok, other=0.0)
    w_scale = tl.load(WScale + rn, mask=n_ok, other=0.0)
    out = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], out.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def launch_shape(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for ``m`` rows: prefill-sized steps take
    128 x 128 tiles (8 warps), smaller ones 64-row tiles so more programs share the weight."""
    if m > 128:
        return 128, 128, 64, 8, 3
    return 64, 64, 64, 4, 4


def triton_w8a8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float @ (q [N, K] int8 * scale [N]).T with x quantized per token (``quantize_rows``);
    [M, N] in x's dtype: what ``w8a8_matmul`` computes, for any M, N and K."""
    m, k = x.shape
    n = q.shape[0]
    xq, x_scale = quantize_rows(x)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, block_k, warps, stages = launch_shape(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a8_kernel[grid](xq, x_scale, q, scale, y, m, n, k, xq.stride(0), q.stride(0), y.stride(0),
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y
