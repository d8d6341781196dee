"""A cache holding fewer tokens per sequence than the context length (``max_seq_tokens`` 48
under a ``max_model_len`` of 64) passes the cache suite: no property asks a sequence for
more than the cache declares it holds."""

from __future__ import annotations

from tessellm.core.interfaces.kv import KVLayout
from tessellm.plugins.cache.contiguous import ContiguousCache
from tessellm.testing.conformance import CacheConformance

REGION = 48


class SmallRegionCache(ContiguousCache):
    """`contiguous` with regions of at most 48 tokens, whatever the context length."""

    name = "small-region"
    auto_priority = None

    @classmethod
    def kv_layout(cls, options, ctx):
        return KVLayout(ctx.model.kv_shape.format, min(REGION, ctx.max_model_len), ctx.dtype)


class TestSmallRegion(CacheConformance):
    plugin_class = SmallRegionCache
    options = {"max_seqs": 4}
    max_model_len = 64


def test_the_suite_sees_the_declared_capacity():
    assert TestSmallRegion().capacity() == REGION
