"""Quant `fp8`: float8 e4m3 weights; on a GPU with FP8 tensor cores, e4m3 activations too.

Quantized at load from a float checkpoint (scales per output channel by default, per tensor,
or per block), or read as stored from an FP8 checkpoint (checkpoints.py): every decoder-layer
``nn.Linear`` becomes an ``Fp8Linear``. Half the bytes of bfloat16. Where the device has
FP8 tensor cores (compute capability 8.9+) a layer with tensor or channel scales quantizes
its activations per token and runs ``torch._scaled_mm`` (``matmul: auto``); elsewhere, and
for block scales, the weights are dequantized inside the matmul and the activations stay in
the model dtype.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from pydantic import Field
from torch import nn

import tessellm
from tessellm.core.errors import ConfigError
from tessellm.core.interfaces.quantizer import Quantizer
from tessellm.core.plugin import PluginOptions
from tessellm.plugins.quant.fp8.checkpoints import checkpoint_support, read_fp8, shard_rule
from tessellm.plugins.quant.fp8.linear import (FP8, Fp8Linear, dequantize_fp8, fp8_matmul_unfit, quantize_fp8,
                                               scaled_mm_unfit)
from tessellm.plugins.quant.int8.quantize import replace_linears
from tessellm.plugins.quant.kernel_table import KernelChoice, check_named, choose
from tessellm.plugins.quant.stored_linears import refuse_unread, replace_stored_linears


class Fp8Options(PluginOptions):
    """Options of `fp8` (when quantizing a float checkpoint; an FP8 checkpoint keeps its own)."""

    granularity: Literal["channel", "tensor", "block"] = "channel"
    """One scale per output channel, for the whole weight, or per ``block_size`` block."""
    block_size: int = Field(128, ge=16, le=1024)
    """Rows and columns of a block (granularity block)."""
    quantize_lm_head: bool = False
    """Also quantize lm_head."""
    matmul: Literal["auto", "scaled_mm", "dequantize", "triton", "compiled"] = "auto"
    """How a layer multiplies. ``scaled_mm``: activations quantized to e4m3 per token, then
    ``torch._scaled_mm`` (FP8 tensor cores; torch's CPU kernel runs it too, slowly), for
    layers with tensor or channel scales whose sizes are multiples of 16. ``dequantize``: the
    weights widened into the activations' dtype, any layer, any device. ``triton`` (CUDA, or
    TRITON_INTERPRET=1) and ``compiled`` (``torch.compile``): weight-only kernels that convert
    e4m3 in registers, tensor or channel scales. A layer a named kernel cannot run is refused
    at load. ``auto``: on a GPU with FP8 tensor cores (compute capability 8.9+), per layer
    shape and row count from ``kernel_table``; dequantize elsewhere and in float64."""
    kernel_table: Optional[str] = None
    """A kernel table written by ``bench/quant_kernels.py --table`` (JSON); None: the default
    for Hopper (plugins/quant/kernel_tables/sm_90.json)."""


class Fp8Quantizer(Quantizer):
    """float8 e4m3 weights for the decoder layers' linears (and optionally lm_head)."""

    name = "fp8"
    api_version = "1.19"
    description = ("float8 e4m3 weights (tensor, channel or block scales); activations e4m3 per token through "
                   "torch._scaled_mm on FP8 tensor cores, else in the model dtype")
    Options = Fp8Options
    auto_priority = None  # quantization changes results: only when named, or read from a checkpoint
    max_relative_error = 0.2

    @classmethod
    def error_bound(cls, options: PluginOptions) -> float:
        # e4m3 keeps 3 mantissa bits (~2-3% rms error a weight); the tiny conformance model's
        # logits come out 11-13% off, a little more with lm_head quantized too, and about 15%
        # with the activations in e4m3 as well (scaled_mm, which auto picks on FP8 GPUs)
        activations = 0.0 if options.matmul == "dequantize" else 0.05
        return 0.15 + (0.05 if options.quantize_lm_head else 0.0) + activations

    def use_scaled_mm(self, name: str, weight: torch.Tensor, block: tuple[int, int] | None) -> bool:
        """Whether layer ``name`` (an [N, K] e4m3 ``weight`` scaled per ``block``) may run
        ``torch._scaled_mm`` under the ``matmul`` option (auto: on an FP8 GPU, for the row
        counts its table gives it); a ConfigError where the option demands it and the layer
        cannot."""
        choice = self.options.matmul
        if choice not in ("auto", "scaled_mm"):
            return False
        unfit = scaled_mm_unfit(*weight.shape, block)
        if choice == "scaled_mm":
            if unfit is not None:
                raise ConfigError(f"quant.options.matmul=scaled_mm: {name} cannot run torch._scaled_mm, because of "
                                  f"{unfit}; allowed: matmul auto (scaled_mm where a layer fits) or dequantize")
            return True
        return unfit is None and fp8_matmul_unfit(self.device) is None and self.dtype != torch.float64

    def kernel_choice(self) -> KernelChoice:
        """The layers' kernel choice: the named ``matmul``; auto reads the table on an FP8 GPU
        outside float64, and is dequantize elsewhere."""
        matmul = self.options.matmul
        if matmul == "auto" and (fp8_matmul_unfit(self.device) is not None or self.dtype == torch.float64):
            matmul = "dequantize"
        return choose(self.name, matmul, self.options.kernel_table, self.device, triton_kernels=("triton",),
                      option="matmul")

    def _layer(self, name: str, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               block: tuple[int, int] | None, choice: KernelChoice) -> Fp8Linear:
        self.use_scaled_mm(name, weight, block)  # the refusal of a named scaled_mm, with its message
        layer = Fp8Linear(weight, scale, bias, block, kernel_choice=choice)
        check_named(choice.named, name, layer.unfit, Fp8Linear.KERNELS, option="matmul")
        return layer

    def apply(self, model: nn.Module) -> nn.Module:
        options = self.options
        block = (options.block_size, options.block_size)

        choice = self.kernel_choice()

        def make(full: str, linear: nn.Linear) -> nn.Module:
            weight, scale = quantize_fp8(linear.weight, options.granularity, block)
            bias = None if linear.bias is None else linear.bias.detach().clone()
            return self._layer(full, weight, scale, bias, block if options.granularity == "block" else None, choice)

        return replace_linears(model, make, options.quantize_lm_head, self.name)

    @classmethod
    def checkpoint_support(cls, quantization_config: dict[str, Any]) -> str | None:
        return checkpoint_support(quantization_config)

    @classmethod
    def checkpoint_shard_rule(cls, suffix: str, weight_rule: Any, quantization_config: dict[str, Any]) -> Any:
        return shard_rule(suffix, weight_rule, quantization_config)

    def load_quantized(self, model: nn.Module, state: dict[str, torch.Tensor],
                       quantization_config: dict[str, Any]) -> None:
        """Every linear whose weight the checkpoint stores in float8 becomes an ``Fp8Linear``;
        a float8 weight of any other module (an MLA latent up-projection, which the attention
        reads as a matrix) is dequantized to float in ``state`` and loads as usual."""
        for name, module in list(model.named_modules()):
            if type(module) is not nn.Linear and f"{name}.weight" in state:
                read = read_fp8(state, name, quantization_config)
                if read is not None:
                    state[f"{name}.weight"] = dequantize_fp8(*read)

        choice = self.kernel_choice()

        def build(name: str, linear: nn.Linear) -> nn.Module | None:
            read = read_fp8(state, name, quantization_config)
            if read is None:
                return None
            weight, scale, block = read
            bias = state.pop(f"{name}.bias", None)
            return self._layer(name, weight.to(self.device), scale.to(self.device),
                               None if bias is None else bias.to(self.device, self.dtype), block, choice)

        replace_stored_linears(model, build)
        refuse_unread(state, self.name, "float8 tensors", lambda _, tensor: tensor.dtype == FP8)


@tessellm.hookimpl
def register_quant(register):
    register(Fp8Quantizer)
