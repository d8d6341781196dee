"""``Fp8Linear``: ``nn.Linear``'s interface over float8 e4m3 weights and their scales.

The weight is ``weight_fp8 * scale`` with one scale for the whole tensor ([1, 1]), one per
output channel ([N, 1]) or one per block of ``block`` = (rows, columns) ([ceil(N / rows),
ceil(K / columns)]; DeepSeek-V3's 128 x 128). The matmul dequantizes ``TILE_ROWS`` output
channels at a time into the activations' dtype and multiplies them with the BLAS (cuBLAS on
a GPU): the weights cross memory as one byte each, the activations stay in the model dtype.
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TILE_ROWS = 256
"""Output channels dequantized at once (a multiple of every block height used: 128, 64, 32)."""


def expand_scale(scale: torch.Tensor, rows: slice, shape: tuple[int, int], block: tuple[int, int] | None
                 ) -> torch.Tensor:
    """The scale of every weight in output channels ``rows`` of an [N, K] weight: [R, K] or a
    broadcastable [R, 1] / [1, 1]."""
    if block is None:
        return scale if scale.shape[0] == 1 else scale[rows]
    bn, bk = block
    start, stop = rows.start, min(rows.stop, shape[0])
    tile = scale[start // bn: (stop + bn - 1) // bn].repeat_interleave(bn, dim=0)
    tile = tile[start - (start // bn) * bn: stop - (start // bn) * bn]
    return tile.repeat_interleave(bk, dim=1)[:, : shape[1]]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight in ``dtype`` (the reference)."""
    rows = slice(0, weight.shape[0])
    return (weight.to(dtype) * expand_scale(scale, rows, tuple(weight.shape), block).to(dtype))


def quantize_fp8(weight: torch.Tensor, granularity: str, block: tuple[int, int] = (128, 128)
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale) of ``weight`` [N, K] per ``granularity``: "tensor",
    "channel" or "block" (scales of ``block``)."""
    w = weight.detach().float()
    n, k = w.shape
    if granularity == "tensor":
        scale = w.abs().amax().reshape(1, 1)
    elif granularity == "channel":
        scale = w.abs().amax(dim=1, keepdim=True)
    else:
        bn, bk = block
        padded = torch.nn.functional.pad(w.abs(), (0, -k % bk, 0, -n % bn))
        scale = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk).amax(dim=(1, 3))
    scale = (scale / FP8_MAX).clamp(min=1e-12)
    full = expand_scale(scale, slice(0, n), (n, k), block if granularity == "block" else None)
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear(nn.Module):
    """y = x @ (weight_fp8 * scale).T + bias in x's dtype; see the module docstring."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 block: tuple[int, int] | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block = None if block is None else (int(block[0]), int(block[1]))
        self.register_buffer("weight_fp8", weight)
        self.register_buffer("weight_scale", scale.float())
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        shape = (self.out_features, self.in_features)
        for start in range(0, self.out_features, TILE_ROWS):
            part = slice(start, min(start + TILE_ROWS, self.out_features))
            tile = self.weight_fp8[part].to(x.dtype) * expand_scale(self.weight_scale, part, shape, self.block).to(x.dtype)
            torch.mm(rows, tile.T, out=out[:, part])
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kind = "tensor" if self.weight_scale.numel() == 1 and self.block is None else \
            "channel" if self.block is None else f"block {self.block[0]}x{self.block[1]}"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, {kind} scales"
