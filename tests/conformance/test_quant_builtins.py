"""The quant conformance suite on every built-in quantizer: none; int8-weight per channel (its
compiled decode kernel) and in groups with lm_head (its tiled path); w8a8 with lm_head."""

from __future__ import annotations


from tessellm.testing.conformance import QuantConformance


class TestNone(QuantConformance):
    plugin = "none"


class TestInt8Weight(QuantConformance):
    plugin = "int8-weight"


class TestInt8WeightGrouped(QuantConformance):
    plugin = "int8-weight"
    options = {"group_size": 32, "quantize_lm_head": True, "compile": False}


class TestW8A8(QuantConformance):
    plugin = "w8a8"
    options = {"quantize_lm_head": True}
