"""What the `flash` backend's prefill and decode kernels share: their launch shapes, the
online-softmax fold both run, and whether Triton interprets (on the CPU, for tests).

Both read an int8 cache too: each K/V tile is loaded as int8 with its per-token scales and
dequantized to the compute dtype in registers (``_dequantize``), as ``KVStorage.gather``
would have, so only int8 bytes and scales cross the memory bus.

Scores live in the base-2 domain (the softmax scale folded with log2(e)), so each exponential
is one ``exp2``; accumulation is float32 whatever the input dtype. A logit softcap carries
over to that domain as the cap times log2(e) (``softcap_log2``: log2(e) * cap * tanh(s / cap)
is cap' * tanh(s' / cap') for s' = log2(e) * s, cap' = log2(e) * cap); sink logits, natural
per query head, are converted where they are folded in (``_add_sink``).
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
def _softcap(s, CAP: tl.constexpr):
    """CAP * tanh(s / CAP) for base-2 scores ``s`` and a base-2 cap (``softcap_log2``), as
    CAP - 2 CAP / (exp(2 s / CAP) + 1), the exponent clamped at 60 (tanh(30) is 1 in float32)
    so that it never overflows: any finite score gives a finite capped one."""
    return CAP - (2.0 * CAP) / (tl.exp(tl.minimum(s * (2.0 / CAP), 60.0)) + 1.0)


@triton.jit
def _add_sink(acc, l_i, m_i, sink):
    """Fold a sink logit (natural log; a key with no value) into a finished online softmax of
    base-2 max ``m_i`` and sum ``l_i``: both rescaled to the larger of ``m_i`` and the sink,
    the sink's weight added to the sum once."""
    sink = sink.to(tl.float32) * 1.4426950408889634  # log2(e): to the scores' base-2 domain
    m = tl.maximum(m_i, sink)
    alpha = tl.math.exp2(m_i - m)  # 0 for a row that saw no key (m_i = -inf)
    return acc * alpha[:, None], l_i * alpha + tl.math.exp2(sink - m)


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


def softcap_log2(softcap: float | None) -> float:
    """The kernels' SOFTCAP constexpr: a layer's logit softcap in the base-2 score domain,
    0.0 for none (the kernels then compile exactly as without the feature)."""
    return float(softcap) * LOG2E if softcap else 0.0


def sink_args(sinks: torch.Tensor | None, num_heads: int, fallback: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The kernels' sink pointer and SINKS flag: ``sinks`` [num_heads] (any float dtype), or
    ``fallback`` and False where there are none (never read)."""
    if sinks is None:
        return fallback, False
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks must hold one logit per query head, shape ({num_heads},), got {tuple(sinks.shape)}")
    if sinks.device != fallback.device:
        raise ValueError(f"sinks must be on the queries' device {fallback.device}, not {sinks.device}")
    return sinks.contiguous(), True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
