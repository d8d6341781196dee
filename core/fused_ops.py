"""Fused Triton kernels for the decoder's small element-wise steps.

In eager torch a decoder layer runs about thirty kernels that each touch a few megabytes
(RMSNorm alone is seven: upcast, square, mean, add, rsqrt, multiply, downcast); at a decode
step's batch sizes they cost more in launches than in bytes, even replayed from a CUDA graph.
These kernels do each step in one pass:

- ``add_rmsnorm``: the residual add and the RMSNorm after it (statistics in float32, the
  result rounded to the model dtype before the weight multiplies it, as transformers does);
- ``rotary``: RoPE applied in place to q and k, one program per token for all heads;
- ``rope_store``: RoPE on q and k and the paged-cache write of k and v in one pass, one
  program per token (four kernels and a copy fewer per layer than ``rotary`` twice, the two
  index copies of ``DenseKVStorage.store`` and making q contiguous);
- ``silu_mul``: SwiGLU's ``silu(gate) * up``.

Each has a plain-torch reference (``*_reference``), which is what the CPU path runs; the model
uses the kernels on CUDA (``LlamaForCausalLM.fused``). Under ``TRITON_INTERPRET=1`` they also
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


def rope_store_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rotate q and k [T, H, D] (k in place), write k and v into the caches' rows ``slots``
    and return the rotated q (contiguous)."""
    k.copy_(rotary_reference(k, cos, sin))
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
    return rotary_reference(q, cos, sin).contiguous()


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
def _rope_store_kernel(Q, K, V, Cos, Sin, QOut, KCache, VCache, Slots, stride_qt, stride_qh, stride_kt, stride_kh,
                       stride_vt, stride_vh, stride_c, stride_ot, stride_oh, stride_cs, stride_ch,
                       HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                       BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    # the same arithmetic as _rotary_kernel, so both paths round alike
    c1 = tl.load(Cos + t * stride_c + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(Cos + t * stride_c + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(Sin + t * stride_c + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(Sin + t * stride_c + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    ok = (hq < HQ) & d_ok[None, :]
    src = Q + t * stride_qt + hq * stride_qh + d[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    dst = QOut + t * stride_ot + hq * stride_oh + d[None, :]
    tl.store(dst, (x1 * c1 - x2 * s1).to(QOut.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, (x2 * c2 + x1 * s2).to(QOut.dtype.element_ty), mask=ok)
    slot = tl.load(Slots + t).to(tl.int64)
    hk = tl.arange(0, BLOCK_HKV)[:, None]
    ok = (hk < HKV) & d_ok[None, :]
    src = K + t * stride_kt + hk * stride_kh + d[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    r1 = (x1 * c1 - x2 * s1).to(K.dtype.element_ty)
    r2 = (x2 * c2 + x1 * s2).to(K.dtype.element_ty)
    tl.store(src, r1, mask=ok)  # rotated in place too: a prefill reads its new keys from these rows
    tl.store(src + HALF, r2, mask=ok)
    row = hk * stride_ch + d[None, :]
    tl.store(KCache + slot * stride_cs + row, r1.to(KCache.dtype.element_ty), mask=ok)
    tl.store(KCache + slot * stride_cs + row + HALF, r2.to(KCache.dtype.element_ty), mask=ok)
    src = V + t * stride_vt + hk * stride_vh + d[None, :]
    tl.store(VCache + slot * stride_cs + row, tl.load(src, mask=ok).to(VCache.dtype.element_ty), mask=ok)
    tl.store(VCache + slot * stride_cs + row + HALF, tl.load(src + HALF, mask=ok).to(VCache.dtype.element_ty), mask=ok)


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


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Fused ``rope_store_reference``: q [T, Hq, D], k, v [T, Hkv, D] (last dim contiguous;
    the rows may be strided views of one QKV output), cos, sin [T, D], caches [slots, Hkv, D]
    (contiguous, any float dtype), ``slots`` [T] distinct rows. Returns the rotated q."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"k and v caches must have one contiguous layout, got {tuple(k_cache.shape)} "
                         f"{k_cache.stride()} and {tuple(v_cache.shape)} {v_cache.stride()}")
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    if t:
        _rope_store_kernel[(t,)](q, k, v, cos, sin, out, k_cache, v_cache, slots, q.stride(0), q.stride(1),
                                 k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), out.stride(0),
                                 out.stride(1), k_cache.stride(0), k_cache.stride(1), HQ=hq, HKV=hkv, HALF=d // 2,
                                 BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HKV=triton.next_power_of_2(hkv),
                                 BLOCK_D=triton.next_power_of_2(d // 2))
    return out


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
