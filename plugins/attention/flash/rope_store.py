"""`flash`'s fused RoPE and KV store: q and k rotated and k, v written into the paged cache in
one pass, one program per token. Per layer that is four kernels and a copy fewer than rotating
q and k apart (``tessellm.core.model.fused_ops.rotary_`` twice), the two index copies of
``DenseKVStorage.store`` and making q contiguous. The rotation is the same formula as
``rotary_``'s: the same results under the interpreter, within a rounding compiled (the
compiler may fuse it into FMAs differently in the two kernels). An int8 cache is written as
``Int8KVStorage.store`` writes it: per token and head, int8 values and a float16 scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tessellm.core.model.fused_ops import rotary_reference
from tessellm.plugins.attention.flash.common import scale_args


def rope_store_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rotate q and k [T, H, D] (k in place), write k and v into the caches' rows ``slots``
    and return the rotated q (contiguous)."""
    k.copy_(rotary_reference(k, cos, sin))
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
    return rotary_reference(q, cos, sin).contiguous()


@triton.jit
def _round_half_even(x):
    """x rounded to the nearest integer, ties to even (torch.round's rule), in float32."""
    down = tl.floor(x)
    frac = x - down
    odd = down - 2.0 * tl.floor(down * 0.5)
    return tl.where((frac > 0.5) | ((frac == 0.5) & (odd == 1.0)), down + 1.0, down)


@triton.jit
def _store_heads(Cache, Scale, slot, hk, d, x1, x2, ok, head_ok, stride_cs, stride_ch, stride_ss, stride_sh,
                 HALF: tl.constexpr, QUANT: tl.constexpr):
    """Write one token's heads (halves ``x1``, ``x2`` [BLOCK_HKV, BLOCK_D]) into the cache row
    ``slot``; ``QUANT``: as int8 with one float16 scale per head, the cache's formula (scale =
    largest |value| / 127, values rounded half to even)."""
    dst = Cache + slot * stride_cs + hk * stride_ch + d[None, :]
    if QUANT:
        a1 = x1.to(tl.float32)
        a2 = x2.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(a1), 1), tl.max(tl.abs(a2), 1))
        scale = (amax / 127.0).to(tl.float16)
        safe = tl.maximum(scale.to(tl.float32), 6.103515625e-05)[:, None]  # float16's smallest normal
        q1 = tl.minimum(tl.maximum(_round_half_even(a1 / safe), -127.0), 127.0)
        q2 = tl.minimum(tl.maximum(_round_half_even(a2 / safe), -127.0), 127.0)
        tl.store(dst, q1.to(tl.int8), mask=ok)
        tl.store(dst + HALF, q2.to(tl.int8), mask=ok)
        tl.store(Scale + slot * stride_ss + hk * stride_sh, scale[:, None], mask=head_ok)
    else:
        tl.store(dst, x1.to(Cache.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, x2.to(Cache.dtype.element_ty), mask=ok)


@triton.jit
def _rope_store_kernel(Q, K, V, Cos, Sin, QOut, KCache, VCache, KScale, VScale, Slots, stride_qt, stride_qh,
                       stride_kt, stride_kh, stride_vt, stride_vh, stride_c, stride_ot, stride_oh, stride_cs,
                       stride_ch, stride_ss, stride_sh,
                       HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                       BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
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
    _store_heads(KCache, KScale, slot, hk, d, r1, r2, ok, hk < HKV, stride_cs, stride_ch, stride_ss, stride_sh, HALF,
                 QUANT)
    src = V + t * stride_vt + hk * stride_vh + d[None, :]
    _store_heads(VCache, VScale, slot, hk, d, tl.load(src, mask=ok, other=0.0), tl.load(src + HALF, mask=ok, other=0.0),
                 ok, hk < HKV, stride_cs, stride_ch, stride_ss, stride_sh, HALF, QUANT)


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Fused ``rope_store_reference``: q [T, Hq, D], k, v [T, Hkv, D] (last dim contiguous;
    the rows may be strided views of one QKV output), cos, sin [T, D], caches [slots, Hkv, D]
    (contiguous, any float dtype, or int8 with float16 scales ``k_scale``, ``v_scale``
    [slots, Hkv, 1]), ``slots`` [T] distinct rows. Returns the rotated q."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"k and v caches must have one contiguous layout, got {tuple(k_cache.shape)} "
                         f"{k_cache.stride()} and {tuple(v_cache.shape)} {v_cache.stride()}")
    quant = k_cache.dtype == torch.int8
    if quant != (k_scale is not None and v_scale is not None):
        raise ValueError(f"an int8 cache needs its k and v scales and only an int8 cache takes them "
                         f"(cache dtype {k_cache.dtype}, scales given: {k_scale is not None and v_scale is not None})")
    k_scales, v_scales, stride_ss, stride_sh = scale_args(k_scale, v_scale, k_cache)
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    if t:
        _rope_store_kernel[(t,)](q, k, v, cos, sin, out, k_cache, v_cache, k_scales, v_scales, slots, q.stride(0),
                                 q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
                                 out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), stride_ss,
                                 stride_sh, HQ=hq, HKV=hkv, HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(hq),
                                 BLOCK_HKV=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d // 2),
                                 QUANT=quant)
    return out
