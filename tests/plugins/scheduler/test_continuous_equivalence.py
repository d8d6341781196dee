"""Continuous batching over the paged cache gives every request the tokens it gets alone.

A tiny random-weight model in float64 makes this exact: for any arrival order and timing,
block size, token budget, sequence limit and cache size (small enough to force preemption),
greedy outputs equal each request run alone through the contiguous cache, sampled outputs
(seeded) too, and no block is leaked at the end."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessellm import LLM
from tessellm.core.engine.engine import Engine
from tessellm.core.engine.outputs import StopRule
from tessellm.core.model.runner import ModelRunner
from tessellm.core.interfaces.scheduler import SchedulerLimits
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.plugins.cache.paged import PagedCache, PagedOptions
from tessellm.plugins.scheduler.continuous import ContinuousOptions, ContinuousScheduler
from tessellm.testing.engine import run_arrivals as run

PREFIX = torch.Generator().manual_seed(1)
SHARED = torch.randint(3, 49152, (40,), generator=PREFIX).tolist()  # prompts share parts of this


@pytest.fixture(scope="module")
def reference(tiny_model, cpu_config):
    """The contiguous-cache float64 pipeline; its engine runs each request alone. Its
    attention backend, shared with the paged engines, attends shared prefixes as a cascade
    from one block on (prefix hits and forks exercise it)."""
    return LLM(cpu_config(tiny_model("llama"), dtype="float64",
                          attention={"name": "cascade", "options": {"min_shared_tokens": 1}},
                          cache={"name": "contiguous", "options": {"max_seqs": 8}},
                          scheduler={"name": "static", "options": {"max_batch_size": 8}}))


def paged_engine(reference: LLM, block_size: int, num_blocks: int, prefix_caching: bool = True,
                 **sched_options) -> Engine:
    """A paged + continuous engine sharing the reference pipeline's model (no reload)."""
    p = reference.pipeline
    cache = PagedCache(PagedOptions(block_size=block_size, num_blocks=num_blocks, prefix_caching=prefix_caching),
                       p.cache.spec, p.cache.layout.__class__("kv", block_size, p.cache.layout.dtype))
    limits = SchedulerLimits(p.resolved.max_model_len, p.decoder.num_lookahead_tokens)
    scheduler = ContinuousScheduler(ContinuousOptions(**sched_options), cache, limits)
    runner = ModelRunner(p.model, p.spec, p.attention, cache, p.runner.device)
    return Engine(runner, cache, scheduler, p.decoder, stop=StopRule(set(), p.resolved.max_model_len),
                  vocab_size=p.spec.vocab_size)


_alone: dict[tuple, list[list[int]]] = {}


def alone(reference: LLM, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    key = (tuple(prompt), params.model_dump_json())
    if key not in _alone:
        out = reference.generate([prompt], params)[0]
        _alone[key] = [o.token_ids for o in out.outputs]
    return _alone[key]


request = st.tuples(
    st.integers(0, 6),  # arrival step
    st.integers(0, 40), st.integers(1, 12), st.integers(0, 10**6),  # shared prefix length, own length, seed
    st.integers(1, 10),  # max_tokens
    st.integers(0, 2),  # priority
)


def build(r) -> tuple[int, list[int], SamplingParams, int]:
    arrival, shared, own, seed, max_tokens, priority = r
    g = torch.Generator().manual_seed(seed)
    prompt = SHARED[:shared] + torch.randint(3, 49152, (own,), generator=g).tolist()
    return arrival, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority


@settings(max_examples=25)
@given(st.lists(request, min_size=1, max_size=7), st.sampled_from([1, 4, 16]), st.integers(1, 64),
       st.integers(1, 8), st.sampled_from(["fcfs", "priority"]), st.booleans(), st.integers(0, 3))
def test_greedy_output_equals_running_alone(reference, requests, block_size, budget, max_seqs, policy,
                                           prefix_caching, tightness):
    reqs = [build(r) for r in requests]
    longest = max(len(p) + s.max_tokens for _, p, s, _ in reqs)
    # from roomy down to just enough for the longest request alone: tight caches preempt
    num_blocks = -(-longest // block_size) + [0, 1, 4, 64][tightness]
    engine = paged_engine(reference, block_size, num_blocks, prefix_caching,
                          max_num_batched_tokens=budget, max_num_seqs=max_seqs, policy=policy)
    outputs = run(engine, reqs)
    for i, (_, prompt, params, _) in enumerate(reqs):
        assert outputs[f"r{i}"] == alone(reference, prompt, params), f"request {i}"
    assert engine.cache.pool.num_used == 0
    assert engine.cache.num_free_blocks == engine.cache.num_blocks


def test_preempted_requests_produce_the_same_tokens(reference):
    prompts = [SHARED[:10 + 3 * i] for i in range(4)]
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=7)
    for params in (greedy, sampled):
        engine = paged_engine(reference, 4, 14, max_num_batched_tokens=64)  # room for ~1.5 sequences
        outputs = run(engine, [(0, p, params, 0) for p in prompts])
        assert engine.stats.preemptions > 0, "the cache was meant to be too small"
        for i, p in enumerate(prompts):
            assert outputs[f"r{i}"] == alone(reference, p, params)
        assert engine.cache.pool.num_used == 0


def test_prefix_cache_hits_and_outputs_are_unchanged(reference):
    engine = paged_engine(reference, 4, 64)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    first = run(engine, [(0, SHARED[:33], params, 0)])
    stats = engine.cache.prefix_cache_stats()
    assert stats.hit_tokens == 0
    second = run(engine, [(0, SHARED[:33], params, 0), (1, SHARED[:30] + [7, 8], params, 0)])
    stats = engine.cache.prefix_cache_stats()
    assert stats.hit_tokens == 32 + 28  # 8 full blocks of the first, 7 of the second
    assert second["r0"] == first["r0"] == alone(reference, SHARED[:33], params)
    assert second["r1"] == alone(reference, SHARED[:30] + [7, 8], params)


def test_cache_salt_keeps_tenants_apart(reference):
    engine = paged_engine(reference, 4, 64)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for salt, expect_hit in (("tenant-a", 0), ("tenant-b", 0), ("tenant-a", 36), (None, 0), (None, 36)):
        before = engine.cache.prefix_cache_stats().hit_tokens
        engine.add_request(f"{salt}-{expect_hit}", SHARED[:37], params, cache_salt=salt)
        while engine.has_unfinished():
            engine.step()
        assert engine.cache.prefix_cache_stats().hit_tokens - before == expect_hit, salt


def test_parallel_sampling_shares_the_prompt_blocks(reference):
    prompt = SHARED[:32] + [5, 6, 7]
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=3, n=4)
    shared = paged_engine(reference, 4, 128)
    out = run(shared, [(0, prompt, params, 0)])
    assert out["r0"] == alone(reference, prompt, params)  # the contiguous cache copies instead
    # four samples of 35 + 6 tokens hold 9 prompt blocks once plus their own tails
    unshared = -(-(len(prompt) + 6) // 4) * 4
    assert shared.stats.peak_kv_blocks < unshared / 2
    assert shared.cache.cow_copies >= 3  # each sample but one copied the shared last block


def test_request_too_large_for_the_cache_is_rejected_and_nothing_leaks(reference):
    from tessellm.core.errors import RequestRejectedError

    engine = paged_engine(reference, 4, 8)
    with pytest.raises(RequestRejectedError, match="holds at most 32 tokens"):
        engine.add_request("big", SHARED[:30], SamplingParams(max_tokens=5))
    assert not engine.requests and not engine.has_unfinished()
    assert run(engine, [(0, SHARED[:20], SamplingParams(max_tokens=4, ignore_eos=True), 0)])["r0"]


@settings(max_examples=15)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 2), st.sampled_from([1, 1, 2, 5])), min_size=1,
                max_size=8), st.sampled_from([1, 4, 8]))
def test_outputs_with_the_prefix_cache_equal_outputs_without(reference, mix, block_size):
    """Random mixes of arrivals, a few prompts repeated (so later requests hit earlier ones'
    blocks) and short outputs, max_tokens 1 (scoring) above all: the same tokens with the
    prefix cache as without, and every request that ran looked its prompt up."""
    prompts = [SHARED[:20 + 7 * k] for k in range(3)]
    reqs = [(arrival, prompts[k], SamplingParams(max_tokens=m, ignore_eos=True), 0) for arrival, k, m in mix]
    outputs = {}
    for caching in (False, True):
        engine = paged_engine(reference, block_size, 128, caching, max_num_batched_tokens=64)
        outputs[caching] = run(engine, reqs)
        assert engine.cache.pool.num_used == 0
    assert outputs[True] == outputs[False]
    stats = engine.cache.prefix_cache_stats()
    assert stats.queried_tokens == sum(len(p) for _, p, _, _ in reqs)


@pytest.mark.parametrize("n, max_tokens", [(1, 1), (2, 1), (1, 2)])
def test_a_repeated_prompt_hits_whatever_its_max_tokens(reference, n, max_tokens):
    engine = paged_engine(reference, 4, 64)
    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, temperature=0.0 if n == 1 else 0.8, seed=3)
    first = run(engine, [(0, SHARED[:33], params, 0)])
    assert engine.cache.prefix_cache_stats().hit_tokens == 0
    second = run(engine, [(0, SHARED[:33], params, 0)])
    stats = engine.cache.prefix_cache_stats()
    assert stats.queried_tokens == 2 * 33 and stats.hit_tokens == 32  # 8 full blocks: all but the last token
    assert second == first
    assert engine.cache.pool.num_used == 0
