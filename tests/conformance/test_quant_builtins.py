"""The quant conformance suite on the built-in quantizer `none`."""

from __future__ import annotations


from tessellm.testing.conformance import QuantConformance


class TestNone(QuantConformance):
    plugin = "none"
