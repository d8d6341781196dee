"""Each built-in pooler against the pooling conformance suite."""

from __future__ import annotations

from tessellm.testing.conformance import PoolingConformance


class TestLast(PoolingConformance):
    plugin = "last"


class TestMean(PoolingConformance):
    plugin = "mean"


class TestCls(PoolingConformance):
    plugin = "cls"
    options = {"normalize": True}


class TestClassify(PoolingConformance):
    plugin = "classify"


class TestYesNo(PoolingConformance):
    plugin = "yes-no"
