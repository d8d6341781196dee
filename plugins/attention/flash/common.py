"""What the `flash` backend's prefill and decode kernels share: their launch shapes, the
online-softmax fold both run, and whether Triton interprets (on the CPU, for tests).

Scores live in the base-2 domain (the softmax scale folded with log2(e)), so each exponential
is one ``exp2``; accumulation is float32 whatever the input dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
