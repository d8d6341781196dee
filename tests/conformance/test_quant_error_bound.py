"""A quantizer whose error depends on its options declares its bound per option
(``Quantizer.error_bound``) and the quant suite holds it to that bound; one declaring only
``max_relative_error`` keeps working."""

from __future__ import annotations

from tessellm.core.interfaces.quantizer import Quantizer
from tessellm.testing.conformance import QuantConformance

from .round_bits_plugin import RoundBitsQuantizer


class TestRoundBits4(QuantConformance):
    plugin_class = RoundBitsQuantizer
    options = {"bits": 4}  # an error far above the 5% default bound


def test_the_suite_reads_the_bound_declared_for_the_options():
    class Eight(QuantConformance):
        plugin_class = RoundBitsQuantizer
        options = {"bits": 8}

    assert TestRoundBits4.error_bound() == 0.75 and Eight.error_bound() == 0.04


def test_a_quantizer_declaring_only_the_attribute_keeps_its_bound():
    class Old(Quantizer):
        name = "old-style"
        api_version = "1.0"
        max_relative_error = 0.02

    class Suite(QuantConformance):
        plugin_class = Old

    assert Old.error_bound(Old.Options()) == 0.02 and Suite.error_bound() == 0.02
