"""The cache conformance suite on every built-in cache: contiguous, and paged with and
without prefix caching, with int8 K/V, and over a host tier."""

from __future__ import annotations

from tessellm.testing.conformance import CacheConformance


class TestContiguous(CacheConformance):
    plugin = "contiguous"
    options = {"max_seqs": 6}


class TestPaged(CacheConformance):
    plugin = "paged"
    options = {"block_size": 4, "num_blocks": 96}


class TestPagedWithoutPrefixCaching(CacheConformance):
    plugin = "paged"
    options = {"block_size": 4, "num_blocks": 96, "prefix_caching": False}


class TestPagedInt8(CacheConformance):
    plugin = "paged"
    options = {"block_size": 4, "num_blocks": 96, "kv_dtype": "int8"}


class TestPagedHostTier(CacheConformance):
    """Few device blocks under a small host tier: evicted prefixes come back from the host."""

    plugin = "paged"
    options = {"block_size": 4, "num_blocks": 24, "host_tier_bytes": 2**20}
