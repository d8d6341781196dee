"""Group-wise asymmetric int4 weight quantization, its packing and its plain-torch reference.

A weight [N, K] is cut along K into groups of ``group_size`` input channels (the last group
may be shorter when ``group_size`` does not divide K). Each group has a float scale and a
float offset: ``w ~ q * scale + offset`` with q in 0..15, the group's range spread over the
16 levels (GGUF's Q4_1 form). Formats with an integer zero point z (GPTQ, AWQ,
compressed-tensors: ``(q - z) * scale``) are the case offset = -z * scale. Two values share a byte,
along K, the even index in the low nibble: ``packed [N, K / 2] uint8``. This is the layout the
kernels read; checkpoint formats (GPTQ, AWQ, compressed-tensors) are repacked into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int4Weight:
    """One int4 weight: ``packed`` [N, K / 2] uint8, ``scale`` and ``offset`` [N, G] float32
    (G = ceil(K / group_size) groups), with ``in_features`` K."""

    packed: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group_size: int

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 2


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers in 0..15 (K even) -> [N, K / 2] uint8, index 2j in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_nibbles``: [N, K / 2] uint8 -> [N, K] uint8 in 0..15."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).view(packed.shape[0], -1)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] as [N, G, group_size]; a short last group is padded with its own last value,
    which changes neither its minimum nor its maximum."""
    n, k = w.shape
    pad = -k % group_size
    if pad:
        w = torch.cat((w, w[:, -1:].expand(n, pad)), dim=1)
    return w.view(n, -1, group_size)


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """The int4 form of ``weight`` [N, K] (K even) with groups of ``group_size``."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"int4 packs two values a byte along in_features: {k} is odd")
    w = _grouped(weight.detach().float(), group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-10)
    q = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).view(n, -1)[:, :k]
    return Int4Weight(pack_nibbles(q), scale, lo, group_size)


def group_columns(values: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """Per-group values [N, G] repeated over each group's input channels: [N, K]."""
    return values.repeat_interleave(group_size, dim=1)[:, :k]


def dequantize_int4(weight: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] that ``weight`` stands for, in ``dtype`` (float32 by default)."""
    k = weight.in_features
    q = unpack_nibbles(weight.packed).to(dtype)
    scale = group_columns(weight.scale.to(dtype), weight.group_size, k)
    return q * scale + group_columns(weight.offset.to(dtype), weight.group_size, k)


def reference_matmul(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_int4(weight).T (+ bias) in float64: what every kernel is held to."""
    out = x.double() @ dequantize_int4(weight, torch.float64).T
    return out if bias is None else out + bias.double()
