"""What the `flash` backend's prefill and decode kernels share: their launch shapes, the
online-softmax fold both run, and whether Triton interprets (on the CPU, for tests).

Both read an int8 cache too: each K/V tile is loaded as int8 with its per-token scales and
dequantized to the compute dtype in registers (``_dequantize``), as ``KVStorage.gather``
would have, so only int8 bytes and scales cross the memory bus.

Scores live in the base-2 domain (the softmax scale folded with log2(e)), so each exponential
is one ``exp2``; accumulation is float32 whatever the input dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape of one kernel: tile sizes (powers of two, at least 16), warps per program
    and software-pipelining depth."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    """a @ b: exact float32 products ("ieee") for float32 inputs, tensor-core rate otherwise."""
    if FP32_DOT:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out

@triton.jit
def _fold(acc, l_i, m_i, s, m_safe, v, FP32_DOT: tl.constexpr):
    """Fold one key tile's scores ``s`` (base 2) and values ``v`` into the running output and
    sum, rescaled from the old max ``m_i`` to ``m_safe``."""
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32_DOT)
    return acc, l_i


@triton.jit
def _dequantize(x, scale, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """int8 rows ``x`` [N, D] times their scales [N], in DTYPE: the same float32 product and
    rounding as ``dequantize_heads`` in the int8 cache. ``UPCAST`` (bfloat16 under the
    interpreter, whose float32 -> bfloat16 cast truncates): the bfloat16 values, rounded to
    nearest even by hand, held in float32 as the upcast kernels hold every tile."""
    y = x.to(tl.float32) * scale.to(tl.float32)[:, None]
    if UPCAST:
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = bits.to(tl.float32, bitcast=True)
    else:
        out = y.to(DTYPE)
    return out


TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
"""The Triton dtype of each compute dtype the kernels take."""


def scale_args(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
               k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The kernels' scale pointers and (slot, head) strides: an int8 cache's scales, or the
    cache itself and zero strides where there are none (never read: QUANT is off)."""
    if k_scale is None or v_scale is None:
        return k_cache, k_cache, 0, 0
    if k_scale.stride() != v_scale.stride():
        raise ValueError(f"k and v scales must share one layout, got {k_scale.stride()} and {v_scale.stride()}")
    return k_scale, v_scale, k_scale.stride(0), k_scale.stride(1)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
