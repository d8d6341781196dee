"""torch's own ways to multiply by an int4 weight on the GPU, beside the Triton kernel:

- ``tinygemm``: torch's CUDA int4 kernel (``aten._weight_int4pack_mm``, gpt-fast's batch-1
  path), over its own tiled layout built once at load (``to_tinygemm``). It computes in
  bfloat16 with w = (q - 8) * scale + zero per group, the same form as the CPU's int4pack
  (cpu.py's ``int4pack_scales``); compute capability 8.0+, groups of 32 to 256, N a
  multiple of 8 and K of 16 times its inner K tiles.
- ``compiled``: a ``torch.compile``d dequantize-and-reduce (unpack the nibbles, scale and
  offset them, multiply-and-sum), which Inductor turns into one kernel reading each packed
  byte once: the fused dequantize GEMV of few rows. Whole groups only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tessellm.plugins.quant.int4.cpu import INT4PACK_GROUPS, int4pack_scales
from tessellm.plugins.quant.int4.quantize import Int4Weight, unpack_nibbles


def inner_k_tiles(k: int) -> int | None:
    """tinygemm's inner K tiles for in_features ``k`` (the most of 8, 4, 2 whose 16-column
    tiles divide it), None if none does."""
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)


def tinygemm_unfit(n: int, k: int, group_size: int, device: torch.device) -> str | None:
    """Why torch's CUDA int4 kernel cannot run an [n, k] weight with ``group_size`` on
    ``device`` (None: it can)."""
    if device.type != "cuda":
        return "tinygemm (torch's _weight_int4pack_mm) runs on CUDA only"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "tinygemm needs compute capability 8.0+"
    if group_size not in INT4PACK_GROUPS:
        return f"tinygemm takes groups of {INT4PACK_GROUPS}, not {group_size}"
    if n % 8 or inner_k_tiles(k) is None or k % group_size:
        return f"tinygemm needs out_features a multiple of 8 and in_features of 32 and of the group ({n} x {k})"
    return None


@dataclass
class TinygemmPack:
    """A weight in tinygemm's layout and its bfloat16 scales and zeros [G, N, 2]."""

    weight: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int


def to_tinygemm(weight: Int4Weight) -> TinygemmPack:
    """``weight`` (on CUDA) in tinygemm's layout (check ``tinygemm_unfit`` first): its uint8
    input packs two values a byte with the *even* index in the high nibble, the reverse of
    quantize.py's."""
    q = unpack_nibbles(weight.packed)
    swapped = (q[:, 0::2] << 4) | q[:, 1::2]
    packed = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), inner_k_tiles(weight.in_features))
    return TinygemmPack(packed, int4pack_scales(weight), weight.group_size)


def tinygemm_matmul(x: torch.Tensor, pack: TinygemmPack) -> torch.Tensor:
    """x [M, K] @ the weight.T through tinygemm, in bfloat16; [M, N] in x's dtype."""
    out = torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16), pack.weight, pack.group_size,
                                             pack.scales_and_zeros)
    return out.to(x.dtype)


def _dequantize_reduce(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
                       ) -> torch.Tensor:
    # x [M, K]; packed [N, K / 2]; scale, offset [N, G] with K = G * group: whole groups
    n, groups = scale.shape
    q = torch.stack((packed & 15, packed >> 4), dim=-1).view(n, groups, -1).to(x.dtype)
    w = (q * scale.to(x.dtype)[..., None] + offset.to(x.dtype)[..., None]).view(n, -1)
    return (x.unsqueeze(1) * w.unsqueeze(0)).sum(dim=-1)


@functools.lru_cache(maxsize=None)
def _compiled():
    return torch.compile(_dequantize_reduce, dynamic=True, fullgraph=True)


def compiled_int4_matmul(x: torch.Tensor, weight: Int4Weight, compiled: bool = True) -> torch.Tensor:
    """x [M, K] @ the dequantized weight.T by the ``torch.compile``d reduction (``compiled``
    False: the same expression eagerly, a test reference that materialises [M, N, K])."""
    return (_compiled() if compiled else _dequantize_reduce)(x, weight.packed, weight.scale, weight.offset)
