"""The scheduler conformance suite on every built-in scheduler: static and continuous (the
latter also with a small token budget, so prompts are prefilled in chunks)."""

from __future__ import annotations

from tessellm.testing.conformance import SchedulerConformance


class TestStatic(SchedulerConformance):
    plugin = "static"
    options = {"max_batch_size": 4}


class TestContinuous(SchedulerConformance):
    plugin = "continuous"
    options = {"max_num_seqs": 4}


class TestContinuousChunkedPrefill(SchedulerConformance):
    plugin = "continuous"
    options = {"max_num_seqs": 8, "max_num_batched_tokens": 16}
