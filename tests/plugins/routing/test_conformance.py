"""Each built-in routing policy against the routing conformance suite."""

from __future__ import annotations

from tessellm.testing.conformance import RoutingConformance


class TestRoundRobin(RoutingConformance):
    plugin = "round-robin"


class TestLeastLoad(RoutingConformance):
    plugin = "least-load"


class TestPrefixAware(RoutingConformance):
    plugin = "prefix-aware"
    options = {"block_chars": 16, "max_blocks": 256}
