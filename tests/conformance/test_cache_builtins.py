"""The cache conformance suite on every built-in cache: contiguous, and paged with and
without prefix caching, and with int8 K/V."""

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
