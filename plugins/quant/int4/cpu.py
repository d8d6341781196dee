"""int4 weight-only matmul on the CPU, two paths chosen by the number of rows:

- few rows (decode): torch's own int4 kernel (``aten._weight_int4pack_mm_for_cpu``), which
  reads the packed nibbles and dequantizes them inside its reduction. It runs in bfloat16
  (float32 inputs take a path tens of times slower), so float32 activations are rounded to
  bfloat16 on the way in and the output widened back. It needs N a multiple of 16 and groups
  of 32, 64, 128 or 256; where the group does not divide K, the weight is padded with zero
  columns to a whole last group and the rows with zeros to match. Other layers take the
  tiled path.
- many rows (prefill): the weight is dequantized one tile of ``TILE_ROWS`` output channels
  at a time into a small buffer in the activations' dtype and multiplied by the BLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessellm.plugins.quant.int4.quantize import Int4Weight, group_columns, unpack_nibbles

INT4PACK_GROUPS = (32, 64, 128, 256)
TILE_ROWS = 256
"""Output channels dequantized at once on the many-rows path."""


def int4pack_unfit(n: int, k: int, group_size: int) -> str | None:
    """Why torch's CPU int4 kernel cannot take an [n, k] weight with ``group_size`` (None: it
    can; ``k`` is any, padded to whole groups)."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "this torch has no aten._weight_int4pack_mm_for_cpu"
    if group_size not in INT4PACK_GROUPS:
        return f"group_size {group_size} is not one of {INT4PACK_GROUPS}"
    if n % 16:
        return f"out_features {n} is not a multiple of 16"
    return None


@dataclass
class Int4Pack:
    """A weight in torch's CPU int4 layout: the opaque packed tensor, and per group and output
    channel the bfloat16 (scale, offset) with w = (q - 8) * scale + offset."""

    weight: torch.Tensor
    scales_and_zeros: torch.Tensor  # [G, N, 2] bfloat16
    group_size: int
    in_features: int  # K before padding to whole groups


def to_int4pack(weight: Int4Weight) -> Int4Pack:
    """``weight`` repacked for ``int4pack_matmul`` (check ``int4pack_unfit`` first)."""
    q = unpack_nibbles(weight.packed).to(torch.int32)
    q = torch.nn.functional.pad(q, (0, -q.shape[1] % weight.group_size))  # zero columns meet zero rows
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return Int4Pack(packed, int4pack_scales(weight), weight.group_size, weight.in_features)


def int4pack_scales(weight: Int4Weight) -> torch.Tensor:
    """torch's int4 kernels' (CPU and CUDA) scales and zeros [G, N, 2] in bfloat16: their
    weight is (q - 8) * scale + zero, so zero = offset + 8 scale (q * s + offset == (q - 8) * s
    + (offset + 8 s))."""
    zero = weight.offset + 8.0 * weight.scale
    return torch.stack((weight.scale, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


def int4pack_matmul(x: torch.Tensor, pack: Int4Pack) -> torch.Tensor:
    """x [M, K] @ the weight.T through torch's CPU int4 kernel, in bfloat16; [M, N] in x's dtype."""
    rows = x.to(torch.bfloat16)
    if pack.in_features % pack.group_size:
        rows = torch.nn.functional.pad(rows, (0, -pack.in_features % pack.group_size))
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, pack.weight, pack.group_size, pack.scales_and_zeros)
    return out.to(x.dtype)


def tiled_matmul(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """x [M, K] @ the dequantized weight.T, ``TILE_ROWS`` output channels at a time, in x's dtype."""
    n, k = weight.packed.shape[0], weight.in_features
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    whole_groups = k % weight.group_size == 0
    for start in range(0, n, TILE_ROWS):
        rows = slice(start, min(start + TILE_ROWS, n))
        q = unpack_nibbles(weight.packed[rows]).to(x.dtype)
        if whole_groups:  # scale and offset broadcast over each group: no [R, K] copies of them
            grouped = q.view(q.shape[0], -1, weight.group_size)
            tile = torch.addcmul(weight.offset[rows].to(x.dtype)[..., None], grouped,
                                 weight.scale[rows].to(x.dtype)[..., None]).view(q.shape[0], k)
        else:
            scale = group_columns(weight.scale[rows].to(x.dtype), weight.group_size, k)
            tile = torch.addcmul(group_columns(weight.offset[rows].to(x.dtype), weight.group_size, k), q, scale)
        torch.mm(x, tile.T, out=out[:, rows])
    return out
