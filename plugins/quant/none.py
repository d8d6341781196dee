"""Quant `none`: weights stay in the compute dtype."""

from __future__ import annotations

import tessellm
from tessellm.core.interfaces.quantizer import Quantizer


class NoQuantizer(Quantizer):
    """Leaves the model as loaded (the compute dtype given by the config)."""

    name = "none"
    api_version = "1.19"
    description = "no quantization: weights in the compute dtype"
    auto_priority = 10


@tessellm.hookimpl
def register_quant(register):
    register(NoQuantizer)
