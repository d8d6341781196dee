"""int8 activations times int4 / int8 weights on the CPU: the arithmetic, its float64
reference, and the calls the quantized linears make (int8_dot.cpp is the kernel).

The arithmetic (what the kernel computes and ``reference_*`` restate in float64). Each row
of activations x [M, K] is cut into blocks of 32 channels; a block's scale is d = max|x| /
127 and its first int8 digit q1 = round-half-even(x * (127 / max|x|)). With ``digits`` 2 a
second digit takes the first's rounding: q2 = round-half-even((x - q1 * d) * (128 * 127 /
max|x|)), within +-64, and the block's values are q = 128 q1 + q2 in steps of d / 128
(about 15 bits; with one digit q = q1 in steps of d, llama.cpp's Q8 activations). Every step
is one float32 operation, as the kernel does it, so the digits and d are bit-identical on
both sides. Then, for int4 weights ``w = qw * scale[g] + offset[g]`` (groups of
``group_size``, a multiple of 32), written with the nibbles centred, ``w = (qw - 8) * scale +
(offset + 8 scale)``, and step the block's step:

    y[m, n] = sum_b scale[n, g(b)] * step[m, b] * sum_j q[m, 32b + j] * (qw[n, 32b + j] - 8)
            + sum_g (offset[n, g] + 8 scale[n, g]) * sum_{k in g} x[m, k]

The offsets meet the float activations' own sums, so only the products with the centred
nibbles are quantized: what the int8 activations lose then multiplies weights of mean near
zero (a third of the error of uncentred 0..15 nibbles on random weights). For int8 weights
``w = qw * scale[g]`` the first line alone, with qw as it is. Each block's 32 integer
products sum exactly in int32; only the float scaling rounds.

Blocks of 32 rather than one scale a row: an outlier channel then coarsens its own block,
not the whole token (the reason llama.cpp's Q8 activations use blocks of 32 too).
"""

from __future__ import annotations

import torch

from tessellm.plugins.quant.cpu.build import kernels

BLOCK = 32
"""Activation channels sharing one int8 scale."""


def quantize_blocks(x: torch.Tensor, digits: int = 1) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """x [M, K] float32 (K a multiple of 32) -> (q1 [M, K] int8, q2 [M, K] int8 or None with
    one digit, d [M, K / 32] float32), in natural channel order: the kernel's quantization,
    in torch."""
    m, k = x.shape
    blocks = x.view(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    d = amax / 127.0
    q1 = torch.round(blocks * inv)
    q2 = None if digits == 1 else torch.round((blocks - q1 * d) * (inv * 128.0)).to(torch.int8).view(m, k)
    return q1.to(torch.int8).view(m, k), q2, d.view(m, -1)


def _block_products(x: torch.Tensor, qw: torch.Tensor, scale: torch.Tensor, group_size: int,
                    digits: int) -> torch.Tensor:
    """sum_b scale[n, g(b)] * step[m, b] * (the block's integer dot product), float64 [M, N],
    x quantized with ``digits``."""
    q1, q2, d = quantize_blocks(x, digits)
    m, k = x.shape
    q = q1.double() if q2 is None else 128 * q1.double() + q2.double()
    step = d.double() if q2 is None else d.double() / 128
    n, blocks = qw.shape[0], k // BLOCK
    ints = torch.einsum("mbj,nbj->mnb", q.view(m, blocks, BLOCK), qw.view(n, blocks, BLOCK).double())
    block_scale = scale.double()[:, torch.arange(blocks) * BLOCK // group_size]  # [N, B]
    return (ints * step[:, None, :] * block_scale[None]).sum(-1)


def reference_int4(x: torch.Tensor, qw: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                   group_size: int, digits: int = 1) -> torch.Tensor:
    """The int4 arithmetic above in float64: x [M, K] float32, qw [N, K] in 0..15 (unpacked),
    scale, offset [N, G] -> [M, N] float64."""
    m, k = x.shape
    groups = scale.shape[1]
    sums = torch.nn.functional.pad(x.double(), (0, groups * group_size - k)).view(m, groups, group_size).sum(-1)
    centred = qw.to(torch.int16) - 8
    return _block_products(x, centred, scale, group_size, digits) + sums @ (offset.double() + 8 * scale.double()).T


def reference_int8(x: torch.Tensor, qw: torch.Tensor, scale: torch.Tensor, digits: int = 1) -> torch.Tensor:
    """The int8 arithmetic above in float64: qw [N, K] int8, scale [N] or [N, G] -> [M, N]."""
    scale = scale if scale.dim() == 2 else scale[:, None]
    return _block_products(x, qw, scale, x.shape[1] // scale.shape[1], digits)


def int4_unfit(out_features: int, in_features: int, group_size: int) -> str | None:
    """Why the int8-dot kernel cannot run an int4 layer (None: it can, on this machine)."""
    if in_features % BLOCK or group_size % BLOCK:
        return f"in_features {in_features} and group_size {group_size} must be multiples of {BLOCK}"
    if kernels() is None:
        return "the CPU int8 dot-product kernels are not available here (see the log)"
    return None


def int8_unfit(in_features: int, groups: int) -> str | None:
    """Why the int8-dot kernel cannot run an int8 layer with ``groups`` scales a row."""
    if in_features % BLOCK or (in_features // BLOCK) % groups:
        return f"in_features {in_features} must be a multiple of 32 and of 32 x its {groups} scale groups"
    if kernels() is None:
        return "the CPU int8 dot-product kernels are not available here (see the log)"
    return None


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                group_size: int, digits: int = 1) -> torch.Tensor:
    """x [M, K] float32 @ the int4 weight (quantize.py's packing).T -> [M, N] float32."""
    return torch.ops.tessellm_cpu.int4_matmul(x, packed, scale, offset, group_size, digits)


def int8_matmul(x: torch.Tensor, qw: torch.Tensor, scale: torch.Tensor, digits: int = 1) -> torch.Tensor:
    """x [M, K] float32 @ (qw * scale).T -> [M, N] float32."""
    return torch.ops.tessellm_cpu.int8_matmul(x, qw, scale, digits)
