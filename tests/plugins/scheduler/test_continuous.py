"""`continuous`: in-flight batching over the paged cache.

A fake engine loop (no model) checks the scheduling rules on random workloads: every request
finishes, the token budget and sequence limit hold, long prompts are chunked without
starving decodes, urgency order, rejection, no leaked block. The tests that need outputs run
a tiny float64 model (see test_continuous_equivalence.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tessellm.core.interfaces.cache import CacheSpec
from tessellm.core.interfaces.kv import KVLayout
from tessellm.core.errors import RequestRejectedError
from tessellm.core.interfaces.scheduler import SchedulerLimits
from tessellm.core.interfaces.sequence import SamplingParams, Sequence, SequenceStatus
from tessellm.plugins.cache.paged import PagedCache, PagedOptions
from tessellm.plugins.scheduler.continuous import ContinuousOptions, ContinuousScheduler

MAX_LEN = 64


def make(num_blocks=16, block_size=4, lookahead=0, prefix_caching=True, **options) -> ContinuousScheduler:
    spec = CacheSpec(1, 1, 2, torch.float32, torch.device("cpu"), MAX_LEN)
    cache = PagedCache(PagedOptions(block_size=block_size, num_blocks=num_blocks, prefix_caching=prefix_caching), spec,
                       KVLayout("kv", block_size, torch.float32))
    return ContinuousScheduler(ContinuousOptions(**options), cache, SchedulerLimits(MAX_LEN, lookahead))


def fake_step(sched: ContinuousScheduler, finished: list[Sequence]):
    """Run one step as the engine would, without a model: every scheduled token is computed,
    a sequence whose chunk reaches its end gains one token (and finishes at max_tokens)."""
    out = sched.schedule()
    for item in out.scheduled:
        seq = item.seq
        assert 1 <= item.num_query_tokens <= seq.num_tokens - seq.num_computed_tokens
        reserved = len(sched.cache.block_table(seq)) * sched.cache.layout.block_size
        assert reserved >= seq.num_computed_tokens + item.num_query_tokens  # slots exist
        seq.num_computed_tokens += item.num_query_tokens
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(5)
            if seq.num_output_tokens >= seq.params.max_tokens:
                seq.status = SequenceStatus.FINISHED
                sched.finish(seq)
                finished.append(seq)
                continue
        sched.cache.commit(seq)
    return out


@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 4)), min_size=1, max_size=10),
       st.sampled_from([1, 2, 4, 8]), st.integers(12, 40), st.integers(1, 24), st.integers(1, 6),
       st.integers(0, 2), st.sampled_from(["fcfs", "priority"]), st.booleans(), st.booleans(), st.booleans())
def test_every_request_finishes_within_limits(requests, block_size, num_blocks_base, budget, max_seqs, lookahead,
                                              policy, arrive_late, chunked, prefix_caching):
    num_blocks = max(num_blocks_base // block_size, 1) * 4
    sched = make(num_blocks, block_size, lookahead, prefix_caching, max_num_batched_tokens=budget,
                 max_num_seqs=max_seqs, policy=policy, chunked_prefill=chunked)
    seqs, rejected = [], 0
    for i, (p, m, prio) in enumerate(requests):
        seq = Sequence(f"r{i}", [1 + (i * 7 + j) % 5 for j in range(p)], SamplingParams(max_tokens=m), priority=prio)
        try:
            sched.add([seq])
            seqs.append(seq)
        except RequestRejectedError:
            assert p + m + lookahead > num_blocks * block_size or (not chunked and p > budget)
            rejected += 1
        if arrive_late and seqs:
            fake_step(sched, [])
    finished: list[Sequence] = []
    for _ in range(5_000):
        if not sched.unfinished():
            break
        out = fake_step(sched, finished)
        assert out.scheduled, "empty step while requests wait"
        assert sum(i.num_query_tokens for i in out.scheduled) <= budget
        assert sched.num_running <= max(max_seqs, 1) or len(out.scheduled) == 1
    assert all(s.is_finished for s in seqs)
    cache = sched.cache
    assert cache.pool.num_used == 0 and cache.num_free_blocks == cache.num_blocks


def test_long_prompt_is_chunked_and_decodes_are_not_starved():
    sched = make(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    short = Sequence("short", [1, 2, 3], SamplingParams(max_tokens=30))
    sched.add([short])
    fake_step(sched, [])
    long = Sequence("long", [9] * 50, SamplingParams(max_tokens=2))
    sched.add([long])
    chunks = []
    while long.num_output_tokens == 0:
        out = fake_step(sched, [])
        ids = {i.seq.request_id: i.num_query_tokens for i in out.scheduled}
        assert ids.get("short") == 1, "the decode must run in every step of the long prefill"
        chunks.append(ids["long"])
    assert sum(chunks) == 50 and max(chunks) == 7  # the budget minus the decode


def test_without_chunking_a_prompt_over_the_budget_is_rejected():
    sched = make(max_num_batched_tokens=8, chunked_prefill=False)
    with pytest.raises(RequestRejectedError, match="max_num_batched_tokens=8"):
        sched.add([Sequence("r", [1] * 9, SamplingParams(max_tokens=1))])
    assert not sched.unfinished()


def test_request_larger_than_the_whole_cache_is_rejected_at_admission():
    sched = make(num_blocks=4, block_size=4)
    with pytest.raises(RequestRejectedError, match="can never fit in the KV cache, which holds at most 16 tokens"):
        sched.add([Sequence("r", [1] * 10, SamplingParams(max_tokens=7))])
    sched.add([Sequence("ok", [1] * 10, SamplingParams(max_tokens=6))])
    assert sched.num_waiting == 1


def test_priority_policy_runs_urgent_requests_first_and_fcfs_by_arrival():
    for policy, expect in (("priority", ["c", "a", "b"]), ("fcfs", ["a", "b", "c"])):
        sched = make(max_num_seqs=1, policy=policy)
        for name, prio in (("a", 1), ("b", 2), ("c", 0)):
            sched.add([Sequence(name, [1, 2], SamplingParams(max_tokens=2), priority=prio)])
        finished: list[Sequence] = []
        while sched.unfinished():
            fake_step(sched, finished)
        assert [s.request_id for s in finished] == expect, policy


def test_memory_pressure_preempts_the_least_urgent_and_it_resumes():
    # 8 blocks of 2: two sequences growing to 10 tokens each cannot both fit
    sched = make(num_blocks=8, block_size=2, max_num_batched_tokens=64)
    a = Sequence("a", [1, 2], SamplingParams(max_tokens=8))
    b = Sequence("b", [3, 4], SamplingParams(max_tokens=8))
    sched.add([a, b])
    finished: list[Sequence] = []
    preempted = []
    while sched.unfinished():
        out = fake_step(sched, finished)
        preempted += [s.request_id for s in out.preempted]
    assert preempted and set(preempted) == {"b"}, "the later arrival is the victim"
    assert [s.request_id for s in finished] == ["a", "b"]
    assert b.num_output_tokens == 8


def test_priority_arrival_preempts_a_less_urgent_running_sequence():
    sched = make(num_blocks=6, block_size=2, policy="priority")
    low = Sequence("low", [1] * 4, SamplingParams(max_tokens=6), priority=5)
    sched.add([low])
    for _ in range(3):
        fake_step(sched, [])
    high = Sequence("high", [2] * 6, SamplingParams(max_tokens=4), priority=0)
    sched.add([high])
    out = fake_step(sched, [])
    assert [s.request_id for s in out.preempted] == ["low"]
    assert [i.seq.request_id for i in out.scheduled] == ["high"]
    finished: list[Sequence] = []
    while sched.unfinished():
        fake_step(sched, finished)
    assert [s.request_id for s in finished] == ["high", "low"]


def test_options_are_validated():
    with pytest.raises(ValueError, match="policy"):
        ContinuousOptions(policy="lifo")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        ContinuousOptions(max_num_batched_tokens=0)


def test_without_chunking_a_preempted_sequence_longer_than_a_step_still_resumes():
    sched = make(num_blocks=6, block_size=2, max_num_batched_tokens=4, chunked_prefill=False, prefix_caching=False)
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=8))
    b = Sequence("b", [4, 5, 6], SamplingParams(max_tokens=8))
    sched.add([a, b])
    finished: list[Sequence] = []
    preempted = 0
    for _ in range(200):
        if not sched.unfinished():
            break
        out = fake_step(sched, finished)
        preempted += len(out.preempted)
        assert out.scheduled
    assert preempted and {s.request_id for s in finished} == {"a", "b"}
