"""A quantizer whose error depends on its options: weights rounded to ``bits`` bits per
output channel (fake quantization: the linears stay ``nn.Linear``), so it declares its bound
per option through ``error_bound``."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

import tessellm
from tessellm.core.interfaces.quantizer import Quantizer
from tessellm.core.plugin import PluginOptions


class RoundBitsOptions(PluginOptions):
    """Options of `round-bits`."""

    bits: Literal[4, 8] = 8
    """Bits per weight (symmetric, one scale per output channel)."""


class RoundBitsQuantizer(Quantizer):
    """The decoder layers' linear weights rounded to ``bits`` bits, in place."""

    name = "round-bits"
    api_version = "1.6"
    description = "weights rounded to 4 or 8 bits per channel (a conformance-suite test plugin)"
    Options = RoundBitsOptions
    BOUNDS = {8: 0.04, 4: 0.75}
    """Measured on the suite's tiny model, one prompt of 1 to 48 tokens at a time: at most
    0.031 with 8 bits, 0.58 with 4."""

    @classmethod
    def error_bound(cls, options: RoundBitsOptions) -> float:
        return cls.BOUNDS[options.bits]

    @torch.no_grad()
    def apply(self, model: nn.Module) -> nn.Module:
        top = 2 ** (self.options.bits - 1) - 1
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and ".layers." in f".{name}.":
                w = module.weight
                scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / top
                w.copy_((w / scale).round().clamp(-top, top) * scale)
        return model


@tessellm.hookimpl
def register_quant(register):
    register(RoundBitsQuantizer)
