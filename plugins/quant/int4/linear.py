"""``Int4WeightLinear``: ``nn.Linear``'s interface over group-wise int4 weights."""

from __future__ import annotations

import torch
from torch import nn

from tessellm.plugins.quant.cpu import int8_dot
from tessellm.plugins.quant.int4.cpu import Int4Pack, int4pack_matmul, int4pack_unfit, tiled_matmul, to_int4pack
from tessellm.plugins.quant.int4.quantize import Int4Weight, quantize_int4, unpack_nibbles
from tessellm.plugins.quant.int4.torch_kernels import (TinygemmPack, compiled_int4_matmul, tinygemm_matmul,
                                                       tinygemm_unfit, to_tinygemm)
from tessellm.plugins.quant.kernel_table import KernelChoice, RowDispatch


_INT4PACK_MM = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)


class Int4WeightLinear(nn.Module):
    """y = x @ W.T + bias with W held as int4 (quantize.py's layout); the float weight is not
    kept. ``input_perm`` (act-order checkpoints) reorders the input's channels to the weight's.

    Kernels (``KERNELS``): ``triton``, which unpacks nibbles inside its K loop and splits K for
    few rows (triton_matmul.py); ``tinygemm``, torch's CUDA int4 kernel over its own layout,
    held beside the packed one when the layer's choice uses it (torch_kernels.py);
    ``int4pack``, torch's CPU int4 kernel (cpu.py; held where ``use_int4pack``); ``compiled``,
    a ``torch.compile``d dequantize-and-reduce; ``tiled``, dequantize a tile of output channels
    at a time before the BLAS / cuBLAS. Which runs: ``kernel_choice`` names one, or (auto) on
    CUDA its table picks per row count (tinygemm only for bfloat16 activations, else
    triton); on the CPU ``few_rows`` says which of ``SMALL_KERNELS`` runs up to how many
    token rows (ascending ``(max_rows, kernel)`` pairs; by default int4pack up to
    ``small_batch_rows`` where the layer holds it, the quantizer may measure another choice at
    load), more rows and layers no few-rows kernel takes the tiles."""

    KERNELS = ("triton", "tinygemm", "int4pack", "compiled", "tiled")
    """Every kernel the ``kernel`` option names."""
    SMALL_KERNELS = ("int4pack", "int8-dot", "tiled")
    """The CPU's few-rows paths: torch's int4 kernel (bfloat16 activations), int8
    activations times the int4 weight in int32 (plugins/quant/cpu), tiles + BLAS."""

    def __init__(self, weight: Int4Weight, out_features: int, bias: torch.Tensor | None, *,
                 use_int4pack: bool, small_batch_rows: int, input_perm: torch.Tensor | None = None,
                 kernel_choice: KernelChoice | None = None):
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
        self.few_rows: tuple[tuple[int, str], ...] = ((small_batch_rows, "int4pack"),) if pack is not None else ()
        self.dot_digits = 2
        """The int8 digits a value the int8-dot kernel quantizes activations into (1 or 2)."""
        # decode's path in one call (forward): a few-rows kernel straight on the rows, which
        # need no padding to whole groups, no permutation and no bias added after
        self._direct = self.in_features % self.group_size == 0 and input_perm is None and bias is None
        self.kernel_choice = kernel_choice or KernelChoice("int4-weight", None)
        self._cuda_dispatch: RowDispatch | None = None
        tinygemm = None
        if weight.packed.is_cuda:
            self._cuda_dispatch = self.kernel_choice.cuda_dispatch(out_features, self.in_features, self.unfit, "triton")
            if "tinygemm" in self._cuda_dispatch.kernels():
                tinygemm = to_tinygemm(weight)
        self.register_buffer("tinygemm_weight", None if tinygemm is None else tinygemm.weight)
        self.register_buffer("tinygemm_scales", None if tinygemm is None else tinygemm.scales_and_zeros)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int, *, int4pack: bool, small_batch_rows: int,
                    kernel_choice: KernelChoice | None = None) -> "Int4WeightLinear":
        """Quantize ``linear``'s weight with ``group_size``; ``int4pack``: also hold torch's
        CPU layout (only where ``int4pack_unfit`` finds nothing against it)."""
        weight = quantize_int4(linear.weight, group_size)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(weight, linear.out_features, bias, use_int4pack=int4pack, small_batch_rows=small_batch_rows,
                   kernel_choice=kernel_choice)

    @classmethod
    def stack(cls, parts: list["Int4WeightLinear"]) -> "Int4WeightLinear | None":
        """One layer computing ``parts`` side by side: their packed weights, scales, offsets
        and biases concatenated along the outputs (what ``fuse_projections`` calls for a
        checkpoint's stored q/k/v or gate/up); None where the parts differ in what the product
        reads (group size, inputs, act-order permutation, a bias, the kernels held)."""
        first = parts[0]
        key = [(p.group_size, p.in_features, p.small_batch_rows, p.bias is None, p.int4pack_weight is None,
                p.input_perm is None, p.few_rows, p.dot_digits) for p in parts]
        if len(set(key)) > 1 or (first.input_perm is not None and
                                 not all(torch.equal(p.input_perm, first.input_perm) for p in parts)):
            return None
        weight = Int4Weight(torch.cat([p.weight_packed for p in parts]), torch.cat([p.weight_scale for p in parts]),
                            torch.cat([p.weight_offset for p in parts]), first.group_size)
        bias = None if first.bias is None else torch.cat([p.bias for p in parts])
        stacked = cls(weight, sum(p.out_features for p in parts), bias, use_int4pack=first.int4pack_weight is not None,
                      small_batch_rows=first.small_batch_rows, input_perm=first.input_perm,
                      kernel_choice=first.kernel_choice)
        stacked.few_rows, stacked.dot_digits = first.few_rows, first.dot_digits
        return stacked

    @staticmethod
    def int4pack_unfit(linear: nn.Linear, group_size: int) -> str | None:
        """Why torch's CPU int4 kernel cannot run ``linear`` (None: it can)."""
        return int4pack_unfit(linear.out_features, linear.in_features, group_size)

    @property
    def int4(self) -> Int4Weight:
        return Int4Weight(self.weight_packed, self.weight_scale, self.weight_offset, self.group_size)

    def unfit(self, kernel: str) -> str | None:
        """Why this layer cannot run ``kernel`` (None: it can)."""
        if kernel == "tinygemm":
            return tinygemm_unfit(self.out_features, self.in_features, self.group_size, self.weight_packed.device)
        if kernel == "int4pack" and self.int4pack_weight is None:
            return "it holds no int4pack layout (torch's CPU kernel: CPU only, and the layer must fit it)"
        if kernel == "compiled" and self.in_features % self.group_size:
            return f"compiled takes whole groups ({self.in_features} input channels in groups of {self.group_size})"
        return None

    def run(self, kernel: str, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, in_features] (already permuted) @ W.T through ``kernel`` (one of
        ``KERNELS`` or ``SMALL_KERNELS``), in rows' dtype."""
        if kernel == "triton":
            from tessellm.plugins.quant.int4.triton_matmul import triton_int4_weight_matmul

            return triton_int4_weight_matmul(rows, self.weight_packed, self.weight_scale, self.weight_offset,
                                             self.group_size)
        if kernel == "tinygemm":
            if self.tinygemm_weight is None:  # named, so not built at load: built now, once
                pack = to_tinygemm(self.int4)
                self.tinygemm_weight, self.tinygemm_scales = pack.weight, pack.scales_and_zeros
            return tinygemm_matmul(rows, TinygemmPack(self.tinygemm_weight, self.tinygemm_scales, self.group_size))
        if kernel == "int8-dot":
            out = int8_dot.int4_matmul(rows.float(), self.weight_packed, self.weight_scale, self.weight_offset,
                                       self.group_size, self.dot_digits)
            return out.to(rows.dtype)
        if kernel == "int4pack":
            return int4pack_matmul(rows, Int4Pack(self.int4pack_weight, self.int4pack_scales, self.group_size,
                                                  self.in_features))
        if kernel == "compiled":
            return compiled_int4_matmul(rows, self.int4)
        return tiled_matmul(rows, self.int4)

    def kernel_for(self, m: int) -> str | None:
        """The few-rows CPU kernel that runs ``m`` token rows (None: the tiled path)."""
        for limit, kernel in self.few_rows:
            if m <= limit:
                return kernel
        return None

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, in_features] @ W.T in rows' dtype."""
        if self.kernel_choice.named is not None:
            return self.run(self.kernel_choice.named, rows)
        if rows.device.type == "cuda":
            kernel = self._cuda_dispatch.pick(rows.shape[0])
            return self.run("triton" if kernel == "tinygemm" and rows.dtype != torch.bfloat16 else kernel, rows)
        kernel = self.kernel_for(rows.shape[0])
        return tiled_matmul(rows, self.int4) if kernel is None else self.run(kernel, rows)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """``forward(x)`` in float64 by the arithmetic its CPU kernel runs for that many rows,
        where that is not the dequantized weight's product (``reference_matmul``): the
        int8-dot kernel's (cpu/int8_dot.py); None for the other paths."""
        rows = x.reshape(-1, self.in_features)
        if rows.is_cuda or self.kernel_choice.named is not None or self.kernel_for(rows.shape[0]) != "int8-dot":
            return None
        if self.input_perm is not None:
            rows = rows.index_select(1, self.input_perm)
        out = int8_dot.reference_int4(rows.float(), unpack_nibbles(self.weight_packed), self.weight_scale,
                                      self.weight_offset, self.group_size, self.dot_digits)
        if self.bias is not None:
            out = out + self.bias.double()
        return out.view(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self._direct and not rows.is_cuda and self.kernel_choice.named is None:
            kernel = self.kernel_for(rows.shape[0])
            if kernel == "int4pack":  # straight to torch's kernel: no padding to add
                out = _INT4PACK_MM(rows.to(torch.bfloat16), self.int4pack_weight, self.group_size,
                                   self.int4pack_scales)
                return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
            if kernel is not None:
                return self.run(kernel, rows).to(x.dtype).view(*x.shape[:-1], self.out_features)
        out = self.matmul(rows if self.input_perm is None else rows.index_select(1, self.input_perm))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        cpu = "".join(f", up to {limit} rows {kernel}" for limit, kernel in self.few_rows)
        cpu += f", kernel {self.kernel_choice.named}" if self.kernel_choice.named else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group_size={self.group_size}{cpu}"
