"""Quant `int8-weight`: int8 weights, activations in the model dtype.

Every ``nn.Linear`` of the decoder layers becomes an ``Int8WeightLinear`` at the same name:
symmetric int8 weights with one scale per output channel (or per group of input channels),
quantized once at load. Embeddings stay in the model dtype, and so does ``lm_head`` unless
``quantize_lm_head`` is set. Decode is memory-bound: reading one byte a weight instead of
two or four is the speed-up (bench/int8_linear.py, docs/benchmarks.md).
"""

from __future__ import annotations

import logging
from typing import Literal, Optional

import torch
from pydantic import Field
from torch import nn

import tessellm
from tessellm.core.errors import ConfigError
from tessellm.core.interfaces.quantizer import Quantizer
from tessellm.core.plugin import PluginOptions
from tessellm.plugins.quant.cpu.int8_dot import int8_unfit as int8_dot_unfit
from tessellm.plugins.quant.int8.cpu import fastest
from tessellm.plugins.quant.int8.linear import Int8WeightLinear
from tessellm.plugins.quant.int8.quantize import replace_linears
from tessellm.plugins.quant.kernel_table import choose


logger = logging.getLogger(__name__)


class Int8WeightOptions(PluginOptions):
    """Options of `int8-weight`."""

    group_size: Optional[Literal[32, 64, 128, 256]] = None
    """Input channels sharing one scale; None: one scale per output channel. It must divide
    every quantized layer's in_features."""
    quantize_lm_head: bool = False
    """Also quantize lm_head (the largest matrix of a small model; its error reaches every
    logit directly)."""
    small_batch_rows: int = Field(6, ge=0, le=256)
    """On the CPU, token rows up to which the compiled dequantize-in-the-reduction kernel runs
    (decode); above it a tile of output channels is dequantized before the BLAS matmul."""
    compile: bool = True
    """Use torch.compile for the CPU small-batch kernel (needs a C++ compiler); off: the tiled
    path for every batch."""
    kernel: Literal["auto", "triton", "int8pack", "compiled", "tiled"] = "auto"
    """The matmul. ``auto``: on CUDA per layer shape and row count from ``kernel_table``; on the
    CPU ``cpu_kernel`` up to ``small_batch_rows`` rows and ``tiled`` above. A named kernel runs
    every step on any device that can run it: ``triton`` (CUDA, or TRITON_INTERPRET=1),
    ``int8pack`` (torch's ``_weight_int8pack_mm``; per-channel scales), ``compiled`` (the
    ``torch.compile``d dequantize-in-the-reduction), ``tiled`` (dequantize tiles, then the
    BLAS / cuBLAS)."""
    kernel_table: Optional[str] = None
    """A kernel table written by ``bench/quant_kernels.py --table`` (JSON); None: the default
    for Hopper (plugins/quant/kernel_tables/sm_90.json)."""
    cpu_kernel: Literal["auto", "compiled", "int8pack", "int8-dot", "tiled"] = "auto"
    """The CPU's path for up to ``small_batch_rows`` rows: ``auto`` times the candidates on the
    largest layer at load and keeps the fastest on this CPU (the compiled reduction wins on
    one machine and loses on another); ``int8pack`` (torch's kernel) needs per-channel scales;
    ``int8-dot`` quantizes the activations to int8 per block of 32 and sums in int32 with the
    CPU's integer dot products (a C++ kernel built at first use, plugins/quant/cpu).
    ``compile`` off means ``tiled``."""
    int8_dot_digits: Literal[1, 2] = 2
    """The int8 digits of each activation the ``int8-dot`` kernel multiplies: 1 (int8 in blocks
    of 32, llama.cpp's arithmetic: fastest) or 2 (a second digit for the first's rounding,
    about 15 bits: float activations' accuracy, twice the integer products)."""


class Int8WeightQuantizer(Quantizer):
    """int8 weight-only quantization of the decoder layers' linears (and optionally lm_head)."""

    name = "int8-weight"
    api_version = "1.19"
    description = "int8 weights (per channel or group), activations in the model dtype; dequantized inside the matmul"
    Options = Int8WeightOptions
    auto_priority = None  # quantization changes results: only when named
    max_relative_error = 0.04

    def apply(self, model: nn.Module) -> nn.Module:
        options = self.options
        if "int8pack" in (options.cpu_kernel, options.kernel) and options.group_size is not None:
            which = "kernel" if options.kernel == "int8pack" else "cpu_kernel"
            raise ConfigError(f"quant.options.{which} 'int8pack' takes per-channel scales only; "
                              f"group_size {options.group_size} needs auto, compiled or tiled")
        if options.kernel == "int8pack" and self.device.type == "cuda" and self.dtype != torch.float32:
            raise ConfigError(f"quant.options.kernel 'int8pack' on CUDA takes float32 activations only (torch's CUDA "
                              f"_weight_int8pack_mm), not {self.dtype}; use auto, triton, compiled or tiled")
        choice = choose(self.name, options.kernel, options.kernel_table, self.device, triton_kernels=("triton",))

        def make(full: str, linear: nn.Linear) -> nn.Module:
            if options.group_size is not None and linear.in_features % options.group_size:
                raise ConfigError(f"quant.options.group_size: {options.group_size} does not divide "
                                  f"{full}'s in_features {linear.in_features}; choose a divisor or null")
            return Int8WeightLinear(linear, options.group_size, options.small_batch_rows, options.compile, choice)

        model = replace_linears(model, make, options.quantize_lm_head, self.name)
        layers = [m for m in model.modules() if isinstance(m, Int8WeightLinear)]
        for layer in layers:
            layer.dot_digits = options.int8_dot_digits
        dot_unfit = next(filter(None, (self._dot_unfit(m) for m in layers)), None) \
            if self.device.type == "cpu" and options.cpu_kernel == "int8-dot" and choice.named is None else None
        if dot_unfit:
            raise ConfigError(f"quant.options.cpu_kernel 'int8-dot': {dot_unfit}; use cpu_kernel auto, compiled, "
                              f"int8pack or tiled")
        if self.device.type == "cpu" and options.compile and layers and choice.named is None:
            kernel = options.cpu_kernel if options.cpu_kernel != "auto" else self._fastest_small_kernel(layers)
            for layer in layers:
                layer.small_kernel = kernel
        return model

    def _fastest_small_kernel(self, layers: list[Int8WeightLinear]) -> str:
        """Time each few-rows path on the largest layer at one row; the fastest, logged."""
        largest = max(layers, key=lambda m: m.weight_int8.numel())
        names = [k for k in Int8WeightLinear.SMALL_KERNELS if (k != "int8pack" or self.options.group_size is None)
                 and (k != "int8-dot" or not any(self._dot_unfit(m) for m in layers))]
        x = torch.randn(1, largest.in_features, dtype=self.dtype)
        with torch.inference_mode():
            kernel = fastest({name: (lambda name=name: largest.small_rows(name, x)) for name in names})
        logger.info("int8-weight: %s is the fastest few-rows path on this CPU (of %s)", kernel, ", ".join(names))
        return kernel

    @staticmethod
    def _dot_unfit(layer: Int8WeightLinear) -> str | None:
        groups = 1 if layer.scale.dim() == 1 else layer.scale.shape[1]
        return int8_dot_unfit(layer.in_features, groups)


@tessellm.hookimpl
def register_quant(register):
    register(Int8WeightQuantizer)
