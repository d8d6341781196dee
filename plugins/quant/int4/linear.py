"""``Int4WeightLinear``: ``nn.Linear``'s interface over group-wise int4 weights."""

from __future__ import annotations

import torch
from torch import nn

from tessellm.plugins.quant.int4.cpu import Int4Pack, int4pack_matmul, int4pack_unfit, tiled_matmul, to_int4pack
from tessellm.plugins.quant.int4.quantize import Int4Weight, quantize_int4


_INT4PACK_MM = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)


class Int4WeightLinear(nn.Module):
    """y = x @ W.T + bias with W held as int4 (quantize.py's layout); the float weight is not
    kept. On CUDA a Triton kernel dequantizes inside its K loop (triton_matmul.py). On the
    CPU, up to ``small_batch_rows`` rows run torch's int4 kernel where the layer fits it (and
    ``use_int4pack``); more rows, and layers it cannot take, dequantize a tile of output
    channels at a time before the BLAS (cpu.py). ``input_perm`` (act-order checkpoints)
    reorders the input's channels to the weight's."""

    def __init__(self, weight: Int4Weight, out_features: int, bias: torch.Tensor | None, *,
                 use_int4pack: bool, small_batch_rows: int, input_perm: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = weight.in_features, out_features
        self.group_size = weight.group_size
        self.small_batch_rows = small_batch_rows
        self.register_buffer("weight_packed", weight.packed)
        self.register_buffer("weight_scale", weight.scale)
        self.register_buffer("weight_offset", weight.offset)
        self.register_buffer("bias", bias)
        # act-order checkpoints: the weight's input channels permuted so groups are contiguous
        self.register_buffer("input_perm", input_perm)
        pack = to_int4pack(weight) if use_int4pack else None
        self.register_buffer("int4pack_weight", None if pack is None else pack.weight)
        self.register_buffer("int4pack_scales", None if pack is None else pack.scales_and_zeros)
        # decode's path in one call (forward): torch's kernel straight on the rows, which
        # need no padding to whole groups, no permutation and no bias added after
        self._int4pack_direct = pack is not None and self.in_features % self.group_size == 0 and \
            input_perm is None and bias is None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int, *, int4pack: bool, small_batch_rows: int
                    ) -> "Int4WeightLinear":
        """Quantize ``linear``'s weight with ``group_size``; ``int4pack``: also hold torch's
        CPU layout (only where ``int4pack_unfit`` finds nothing against it)."""
        weight = quantize_int4(linear.weight, group_size)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(weight, linear.out_features, bias, use_int4pack=int4pack, small_batch_rows=small_batch_rows)

    @classmethod
    def stack(cls, parts: list["Int4WeightLinear"]) -> "Int4WeightLinear | None":
        """One layer computing ``parts`` side by side: their packed weights, scales, offsets
        and biases concatenated along the outputs (what ``fuse_projections`` calls for a
        checkpoint's stored q/k/v or gate/up); None where the parts differ in what the product
        reads (group size, inputs, act-order permutation, a bias, the kernels held)."""
        first = parts[0]
        key = [(p.group_size, p.in_features, p.small_batch_rows, p.bias is None, p.int4pack_weight is None,
                p.input_perm is None) for p in parts]
        if len(set(key)) > 1 or (first.input_perm is not None and
                                 not all(torch.equal(p.input_perm, first.input_perm) for p in parts)):
            return None
        weight = Int4Weight(torch.cat([p.weight_packed for p in parts]), torch.cat([p.weight_scale for p in parts]),
                            torch.cat([p.weight_offset for p in parts]), first.group_size)
        bias = None if first.bias is None else torch.cat([p.bias for p in parts])
        return cls(weight, sum(p.out_features for p in parts), bias, use_int4pack=first.int4pack_weight is not None,
                   small_batch_rows=first.small_batch_rows, input_perm=first.input_perm)

    @staticmethod
    def int4pack_unfit(linear: nn.Linear, group_size: int) -> str | None:
        """Why torch's CPU int4 kernel cannot run ``linear`` (None: it can)."""
        return int4pack_unfit(linear.out_features, linear.in_features, group_size)

    @property
    def int4(self) -> Int4Weight:
        return Int4Weight(self.weight_packed, self.weight_scale, self.weight_offset, self.group_size)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, in_features] @ W.T in rows' dtype."""
        if rows.device.type == "cuda":
            from tessellm.plugins.quant.int4.triton_matmul import triton_int4_weight_matmul

            return triton_int4_weight_matmul(rows, self.weight_packed, self.weight_scale, self.weight_offset,
                                             self.group_size)
        if self.int4pack_weight is not None and rows.shape[0] <= self.small_batch_rows:
            pack = Int4Pack(self.int4pack_weight, self.int4pack_scales, self.group_size, self.in_features)
            return int4pack_matmul(rows, pack)
        return tiled_matmul(rows, self.int4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self._int4pack_direct and rows.shape[0] <= self.small_batch_rows and not rows.is_cuda:
            out = _INT4PACK_MM(rows.to(torch.bfloat16), self.int4pack_weight, self.group_size, self.int4pack_scales)
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        out = self.matmul(rows if self.input_perm is None else rows.index_select(1, self.input_perm))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        cpu = ", torch int4pack for few rows" if self.int4pack_weight is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group_size={self.group_size}{cpu}"
