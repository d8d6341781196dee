"""Fused Triton kernels for the decoder's small element-wise steps.

In eager torch a decoder layer runs about thirty kernels that each touch a few megabytes
(RMSNorm alone is seven: upcast, square, mean, add, rsqrt, multiply, downcast); at a decode
step's batch sizes they cost more in launches than in bytes, even replayed from a CUDA graph.
These kernels do each step in one pass:

- ``add_rmsnorm``: the residual add and the RMSNorm after it (statistics in float32, the
  result rounded to the model dtype before the weight multiplies it, as transformers does);
- ``rotary``: RoPE applied in place to q and k, one program per token for all heads;
- ``silu_mul``: SwiGLU's ``silu(gate) * up``.

Each has a plain-torch reference (``*_reference``), which is what the CPU path runs; the model
uses the kernels on CUDA (``DecoderForCausalLM.fused``). Under ``TRITON_INTERPRET=1`` they also
run on CPU tensors, which is how they are tested without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# ----------------------------------------------------------------------------- references


def add_rmsnorm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); without ``residual``, x itself."""
    total = x if residual is None else x + residual
    h = total.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), total


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos, sin [T, D] (the two halves of D pair up, as in Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def silu_mul_packed_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return silu_mul_reference(gate, up)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _add_rmsnorm_kernel(X, R, Out, W, eps, stride_x, stride_r, stride_o, N: tl.constexpr,
                        BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)).to(
            X.dtype.element_ty)
        tl.store(R + row * stride_r + cols, x, mask=ok)  # the sum is the next residual
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / N + eps)
    normed = (h * rstd).to(X.dtype.element_ty).to(tl.float32)  # rounded as the eager path rounds
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (normed * w).to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _rotary_kernel(X, Cos, Sin, stride_xt, stride_xh, stride_c, H: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    ok = (heads[:, None] < H) & (d[None, :] < HALF)
    base = X + t * stride_xt + heads[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(Cos + t * stride_c + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(Cos + t * stride_c + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(Sin + t * stride_c + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(Sin + t * stride_c + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    tl.store(base, (x1 * c1 - x2 * s1).to(X.dtype.element_ty), mask=ok)
    tl.store(base + HALF, (x2 * c2 + x1 * s2).to(X.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(G, U, Out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(G.dtype.element_ty).to(tl.float32)  # eager rounds silu first
    tl.store(Out + offs, (silu * u).to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_packed_kernel(GU, Out, inter, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(GU + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + inter + cols, mask=ok, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(GU.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (silu * u).to(Out.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- wrappers


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``add_rmsnorm_reference`` for 2-D ``x``; ``residual`` (if given) is updated in
    place to x + residual and returned as the second value."""
    rows, n = x.shape
    out = torch.empty_like(x)
    if rows:
        _add_rmsnorm_kernel[(rows,)](x, residual if residual is not None else x, out, weight, eps, x.stride(0),
                                     residual.stride(0) if residual is not None else 0, out.stride(0), N=n,
                                     BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None,
                                     num_warps=4 if n <= 4096 else 8)
    return out, (residual if residual is not None else x)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rotary_reference`` written into ``x`` [T, H, D] (last dim contiguous) in place."""
    t, h, d = x.shape
    if t:
        _rotary_kernel[(t,)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), H=h, HALF=d // 2,
                             BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d // 2))
    return x


def silu_mul_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a [T, 2 I] tensor holding gate then up (a stacked gate/up GEMM's
    output; its rows may be strided), as [T, I]."""
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _silu_mul_packed_kernel[(rows, triton.cdiv(inter, 1024))](gate_up, out, inter, gate_up.stride(0),
                                                                  out.stride(0), BLOCK=1024)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Fused ``silu_mul_reference`` for contiguous tensors of one shape."""
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _silu_mul_kernel[(triton.cdiv(n, 1024),)](gate, up, out, n, BLOCK=1024)
    return out
