"""The key-bounds upkeep of a store in one Triton kernel (the CUDA path of
``KeyBoundsMixin.update_bounds``; key_bounds.py holds its torch reference).

One program per (written token, KV head): a token that ends its page's run of writes (the
step's last token, or the next one is in another page or does not follow it) recomputes the
page's bounds over offsets 0 up to its own from the keys as stored (int8 dequantized with
their scales, as ``gather`` reads them) and writes them; every other program returns at
once. Work and memory are O(new tokens * page); nothing is read back on the host, so a
prefill's upkeep adds one launch a layer and a decode step stays capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_tokens"])
def _page_bounds_kernel(K, KScale, Slots, KMin, KMax, num_tokens,
                        stride_kt, stride_kh, stride_st, stride_sh, stride_bp, stride_bh,
                        PAGE: tl.constexpr, BLOCK_P: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
    t = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(Slots + t)
    nxt = tl.load(Slots + t + 1, mask=t + 1 < num_tokens, other=-1)
    page = slot // PAGE
    offset = slot % PAGE
    # a run of writes fills its page in order: the token that ends it covers the run's others
    if (t + 1 == num_tokens) | (nxt // PAGE != page) | (nxt % PAGE <= offset):
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        lo = tl.full([BLOCK_D], float("inf"), tl.float32)
        hi = tl.full([BLOCK_D], float("-inf"), tl.float32)
        for start in range(0, offset + 1, BLOCK_P):  # the page's offsets 0..offset, BLOCK_P at a time
            offs = start + tl.arange(0, BLOCK_P)
            ok = (offs[:, None] <= offset) & d_ok[None, :]
            slots = page * PAGE + offs
            keys = tl.load(K + slots[:, None] * stride_kt + head * stride_kh + offs_d[None, :], mask=ok, other=0.0)
            keys = keys.to(tl.float32)
            if QUANT:  # as ``dequantize_heads``: the float32 product (rounded to the bounds' dtype below)
                keys = keys * tl.load(KScale + slots * stride_st + head * stride_sh, mask=offs <= offset,
                                      other=0.0).to(tl.float32)[:, None]
            lo = tl.minimum(lo, tl.min(tl.where(ok, keys, float("inf")), 0))
            hi = tl.maximum(hi, tl.max(tl.where(ok, keys, float("-inf")), 0))
        # rounding to the bounds' dtype is monotonic: the bound of the rounded keys is the
        # rounded bound, as the torch path computes it
        out = page * stride_bp + head * stride_bh + offs_d
        tl.store(KMin + out, lo.to(KMin.dtype.element_ty), mask=d_ok)
        tl.store(KMax + out, hi.to(KMax.dtype.element_ty), mask=d_ok)


def update_page_bounds(k: torch.Tensor, k_scale: torch.Tensor | None, slots: torch.Tensor, kmin: torch.Tensor,
                       kmax: torch.Tensor, page: int) -> None:
    """Recompute, in place, the bounds ``kmin``, ``kmax`` [num_pages, Hkv, D] of every page
    ``slots`` [T] wrote, over its offsets 0 .. the largest written, from the stored keys ``k``
    [num_slots, Hkv, D] (int8 with ``k_scale`` [num_slots, Hkv, 1], or floating point)."""
    num_tokens = slots.shape[0]
    if num_tokens == 0:
        return
    hkv, d = k.shape[1], k.shape[2]
    scale = k_scale if k_scale is not None else k
    _page_bounds_kernel[(num_tokens, hkv)](
        k, scale, slots, kmin, kmax, num_tokens, k.stride(0), k.stride(1),
        scale.stride(0) if k_scale is not None else 0, scale.stride(1) if k_scale is not None else 0,
        kmin.stride(0), kmin.stride(1),
        PAGE=page, BLOCK_P=min(max(2, page), 16), HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), QUANT=k_scale is not None)
