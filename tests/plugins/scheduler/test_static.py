"""`static`: FCFS fixed batches. A fake engine loop drives it over random workloads: every
request finishes, batches never exceed their size, a batch starts only when the last one has
finished, and cache slots exist for every scheduled token."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tessellm.core.interfaces.cache import CacheSpec
from tessellm.core.interfaces.kv import KVLayout
from tessellm.core.errors import RequestRejectedError
from tessellm.core.interfaces.scheduler import SchedulerLimits
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.plugins.cache.contiguous import ContiguousCache, ContiguousOptions
from tessellm.plugins.scheduler.static import StaticOptions, StaticScheduler

MAX_LEN = 40


def make(max_seqs: int, batch: int, lookahead: int = 0) -> StaticScheduler:
    spec = CacheSpec(1, 1, 2, torch.float32, torch.device("cpu"), MAX_LEN)
    cache = ContiguousCache(ContiguousOptions(max_seqs=max_seqs), spec, KVLayout("kv", MAX_LEN, torch.float32))
    return StaticScheduler(StaticOptions(max_batch_size=batch), cache, SchedulerLimits(MAX_LEN, lookahead))


@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 15)), min_size=1, max_size=12),
       st.integers(1, 4), st.integers(1, 6), st.integers(0, 3))
def test_static_batches_finish_every_request(requests, max_seqs, batch, lookahead):
    sched = make(max_seqs, batch, lookahead)
    seqs = [Sequence(f"r{i}", list(range(1, p + 1)), SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(requests)]
    sched.add(seqs)
    finished, batches, current = [], [], None
    for _ in range(10_000):
        if not sched.unfinished():
            break
        out = sched.schedule()
        assert out.scheduled, "empty batch while requests wait"
        ids = {s.seq.seq_id for s in out.scheduled}
        assert len(ids) <= batch
        if current is None or not ids <= current:  # a new batch: the previous one must be done
            assert current is None or all(s.is_finished for s in seqs if s.seq_id in current)
            current = ids
            batches.append(ids)
        for item in out.scheduled:
            seq = item.seq
            assert item.num_query_tokens == seq.num_tokens - seq.num_computed_tokens >= 1
            assert sched.cache.block_table(seq)  # slots reserved before running
            seq.num_computed_tokens += item.num_query_tokens
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                seq.status = seq.status.FINISHED
                sched.finish(seq)
                finished.append(seq.seq_id)
    assert sorted(finished) == sorted(s.seq_id for s in seqs)
    assert sched.cache.num_free_blocks == sched.cache.num_blocks
    # FCFS: batches start in arrival order
    firsts = [min(b) for b in batches]
    assert firsts == sorted(firsts)


def test_request_that_can_never_fit_is_rejected_at_admission():
    sched = make(2, 4)
    with pytest.raises(RequestRejectedError, match="max_model_len 40"):
        sched.add([Sequence("r", [1] * 30, SamplingParams(max_tokens=20))])
    sched = make(2, 4, lookahead=5)
    with pytest.raises(RequestRejectedError, match="lookahead"):
        sched.add([Sequence("r", [1] * 30, SamplingParams(max_tokens=8))])
    assert not sched.unfinished()
