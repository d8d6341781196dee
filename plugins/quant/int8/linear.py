"""``Int8WeightLinear``: a linear layer holding int8 weights and their scales."""

from __future__ import annotations

import torch
from torch import nn

from tessellm.plugins.quant.int8.cpu import int8_weight_matmul, tiled_matmul
from tessellm.plugins.quant.int8.quantize import quantize_per_channel


class Int8WeightLinear(nn.Module):
    """``nn.Linear``'s forward over int8 weights: y = x @ (q * scale).T + bias, in x's dtype.

    The weight is quantized once, at construction (symmetric, per output channel or per group
    of ``group_size`` input channels), and the float weight is not kept. On CUDA a Triton
    kernel dequantizes weight tiles inside its K loop (triton_matmul.py). On the CPU, up to
    ``small_batch_rows`` rows run the compiled dequantize-in-the-reduction kernel (unless
    ``compile`` is off); more rows, and other devices, dequantize a tile of output channels at
    a time before the matmul (cpu.py).
    """

    def __init__(self, linear: nn.Linear, group_size: int | None, small_batch_rows: int, compile: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size
        self.small_batch_rows = small_batch_rows
        self.compile = compile
        q, scale = quantize_per_channel(linear.weight, group_size)
        self.register_buffer("weight_int8", q.to(linear.weight.device))
        self.register_buffer("scale", scale.to(linear.weight.device))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.device.type == "cuda":
            from tessellm.plugins.quant.int8.triton_matmul import triton_int8_weight_matmul

            out = triton_int8_weight_matmul(rows, self.weight_int8, self.scale)
        elif rows.device.type == "cpu" and self.compile and rows.shape[0] <= self.small_batch_rows:
            out = int8_weight_matmul(rows, self.weight_int8, self.scale)
        else:
            out = tiled_matmul(rows, self.weight_int8, self.scale)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = "per channel" if self.group_size is None else f"group_size={self.group_size}"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 {group}"
