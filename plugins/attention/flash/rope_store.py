"""`flash`'s fused RoPE and KV store: q and k rotated and k, v written into the paged cache in
one pass, one program per token. Per layer that is four kernels and a copy fewer than rotating
q and k apart (``tessellm.core.model.fused_ops.rotary_`` twice), the two index copies of
``DenseKVStorage.store`` and making q contiguous. The rotation is the same formula as
``rotary_``'s: the same results under the interpreter, within a rounding compiled (the
compiler may fuse it into FMAs differently in the two kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessellm.core.model.fused_ops import rotary_reference


def rope_store_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rotate q and k [T, H, D] (k in place), write k and v into the caches' rows ``slots``
    and return the rotated q (contiguous)."""
    k.copy_(rotary_reference(k, cos, sin))
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
    return rotary_reference(q, cos, sin).contiguous()


@triton.jit
def _rope_store_kernel(Q, K, V, Cos, Sin, QOut, KCache, VCache, Slots, stride_qt, stride_qh, stride_kt, stride_kh,
                       stride_vt, stride_vh, stride_c, stride_ot, stride_oh, stride_cs, stride_ch,
                       HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                       BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    # the same formula as _rotary_kernel
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
