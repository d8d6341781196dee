"""int8 activations times int4 / int8 weights on the CPU: the arithmetic, its float64
reference, and the calls the quantized linears make (int8_dot.cpp is the kernel).

The arithmetic (what the kernel computes and ``reference_*`` restate in float64). Each row
of activations x [M, K] is cut into blocks of 32 channels; a block's scale is d = max|x| /
127 and its values q = round-half-even(x * (127 / max|x|)), computed in float32 exactly as
the kernel does, so q and d are bit-identical on both sides. Then, for int4 weights ``w = qw
* scale[g] + offset[g]`` (groups of ``group_size``, a multiple of 32), written with the
nibbles centred, ``w = (qw - 8) * scale + (offset + 8 scale)``:

    y[m, n] = sum_b scale[n, g(b)] * d[m, b] * sum_j q[m, 32b + j] * (qw[n, 32b + j] - 8)
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


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 (K a multiple of 32) -> (q [M, K] int8, d [M, K / 32] float32), in
    natural channel order: the kernel's quantization, in torch."""
    m, k = x.shape
    blocks = x.view(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv[..., None]).to(torch.int8)
    return q.view(m, k), amax / 127.0


def _block_products(q: torch.Tensor, d: torch.Tensor, qw: torch.Tensor, scale: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """sum_b scale[n, g(b)] * d[m, b] * (the block's integer dot product), float64 [M, N]."""
    m, k = q.shape
    n = qw.shape[0]
    blocks = k // BLOCK
    ints = torch.einsum("mbj,nbj->mnb", q.view(m, blocks, BLOCK).double(), qw.view(n, blocks, BLOCK).double())
    block_scale = scale.double()[:, torch.arange(blocks) * BLOCK // group_size]  # [N, B]
    return (ints * d.double()[:, None, :] * block_scale[None]).sum(-1)


def reference_int4(x: torch.Tensor, qw: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """The int4 arithmetic above in float64: x [M, K] float32, qw [N, K] in 0..15 (unpacked),
    scale, offset [N, G] -> [M, N] float64."""
    q, d = quantize_blocks(x)
    m, k = x.shape
    groups = scale.shape[1]
    sums = torch.nn.functional.pad(x.double(), (0, groups * group_size - k)).view(m, groups, group_size).sum(-1)
    centred = qw.to(torch.int16) - 8
    return _block_products(q, d, centred, scale, group_size) + sums @ (offset.double() + 8 * scale.double()).T


def reference_int8(x: torch.Tensor, qw: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The int8 arithmetic above in float64: qw [N, K] int8, scale [N] or [N, G] -> [M, N]."""
    scale = scale if scale.dim() == 2 else scale[:, None]
    return _block_products(*quantize_blocks(x), qw, scale, x.shape[1] // scale.shape[1])


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
                group_size: int) -> torch.Tensor:
    """x [M, K] float32 @ the int4 weight (quantize.py's packing).T -> [M, N] float32."""
    return torch.ops.tessellm_cpu.int4_matmul(x, packed, scale, offset, group_size)


def int8_matmul(x: torch.Tensor, qw: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ (qw * scale).T -> [M, N] float32."""
    return torch.ops.tessellm_cpu.int8_matmul(x, qw, scale)
