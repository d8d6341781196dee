"""Async scheduling (``async_scheduling: true``): decode steps launched before the previous
step's tokens reach the host, their inputs taken from those tokens on the device, the
previous step absorbed while the next runs. Its outputs must equal the synchronous engine's
for any arrivals, lengths, stops, aborts and cache pressure (float64 tiny model, so batch
composition cannot change a token), with nothing leaked."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessellm import LLM
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.testing.engine import run_arrivals


@pytest.fixture(scope="module")
def folder(tiny_model):
    return tiny_model("llama")


def make(cpu_config, folder, async_scheduling: bool, *, blocks: int = 64, budget: int = 48, decoder: str = "greedy",
         max_seqs: int = 6, scheduler: str = "continuous"):
    options = ({"max_num_seqs": max_seqs, "max_num_batched_tokens": budget} if scheduler == "continuous"
               else {"max_batch_size": max_seqs})
    return LLM(cpu_config(folder, dtype="float64", decoding={"name": decoder}, async_scheduling=async_scheduling,
                          cache={"name": "paged", "options": {"block_size": 4, "num_blocks": blocks}},
                          scheduler={"name": scheduler, "options": options}))


def clean(llm: LLM) -> bool:
    engine = llm.engine
    return (engine.cache.num_free_blocks == engine.cache.num_blocks and not engine.scheduler.unfinished()
            and engine._in_flight is None)


@settings(max_examples=12)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 20), st.integers(1, 14), st.booleans()),
                min_size=1, max_size=7),
       st.sampled_from([("greedy", 64, 48, 6, "continuous"), ("sample", 64, 48, 6, "continuous"),
                        ("greedy", 24, 16, 6, "continuous"), ("greedy", 64, 48, 2, "continuous"),
                        ("sample", 24, 16, 3, "continuous"), ("greedy", 64, 48, 3, "static")]), st.integers(0, 2**16))
def test_async_outputs_equal_sync(folder, cpu_config, requests, setup, seed):
    """Random arrival steps, prompt and output lengths, stop tokens; roomy and tight caches
    (preemption), small token budgets (chunked prefill mixed with decodes), batches too small
    for every request (requests wait while steps overlap), static batches."""
    decoder, blocks, budget, max_seqs, scheduler = setup
    g = torch.Generator().manual_seed(seed)
    vocab_stop = int(torch.randint(3, 500, (1,), generator=g))
    work = []
    for arrival, prompt_len, max_tokens, stop in requests:
        prompt = torch.randint(3, 500, (prompt_len,), generator=g).tolist()
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=[vocab_stop] if stop else [])
        work.append((arrival, prompt, params))
    sync, overlapped = (make(cpu_config, folder, flag, blocks=blocks, budget=budget, decoder=decoder,
                             max_seqs=max_seqs, scheduler=scheduler) for flag in (False, True))
    assert run_arrivals(overlapped.engine, work) == run_arrivals(sync.engine, work)
    assert clean(overlapped)


def test_decode_steps_overlap_and_match(folder, cpu_config):
    sync, overlapped = make(cpu_config, folder, False), make(cpu_config, folder, True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]
    params = [{"max_tokens": m, "ignore_eos": True} for m in (10, 3, 17, 8)]
    expected = sync.generate(prompts, params)
    got = overlapped.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    stats = overlapped.engine.stats
    assert stats.overlapped_steps >= 10 and stats.generated_tokens == sum(p["max_tokens"] for p in params)
    assert clean(overlapped)


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_steps_overlap_while_requests_wait_for_a_full_batch(folder, cpu_config, scheduler):
    """More requests than the batch holds: every step after the first is planned and
    launched before the previous one's tokens arrive, prefills and admissions included, and
    each waiting request starts once a place frees, whether its holder stopped at max_tokens
    or at a stop token (learnt a step late)."""
    sync, overlapped = (make(cpu_config, folder, flag, max_seqs=2, scheduler=scheduler) for flag in (False, True))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4)]
    params = [{"max_tokens": m, "ignore_eos": True} for m in (12, 20, 9, 15, 11, 6)]
    expected = sync.generate(prompts, params)
    # a stop token the first request meets mid-way: its slot frees before max_tokens
    params[0]["stop_token_ids"] = [expected[0].token_ids[4]]
    expected = sync.generate(prompts, params)
    assert len(expected[0].token_ids) < 12
    got = overlapped.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    stats = overlapped.engine.stats
    # continuous: only the first step waits; static: also each batch's start, 3 batches of 2
    waits = 1 if scheduler == "continuous" else 3
    assert stats.overlapped_steps == stats.steps - waits, (stats.overlapped_steps, stats.steps)
    assert clean(overlapped)


def test_requests_that_cannot_sample_on_the_device_run_synchronously(folder, cpu_config):
    """Seeded sampling (CPU generators) and logprobs keep their steps synchronous; greedy
    requests beside them still match, and so do theirs."""
    sync, overlapped = (make(cpu_config, folder, flag, decoder="sample") for flag in (False, True))
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    params = [{"max_tokens": 9, "ignore_eos": True}, {"max_tokens": 9, "ignore_eos": True, "temperature": 1.0,
                                                     "seed": 7},
              {"max_tokens": 9, "ignore_eos": True, "logprobs": 2}]
    expected, got = sync.generate(prompts, params), overlapped.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    # bit for bit by construction: these requests keep every step synchronous, so both engines run the same batches
    assert got[2].outputs[0].logprobs == expected[2].outputs[0].logprobs
    only_greedy = overlapped.generate([prompts[0]] * 2, {"max_tokens": 9, "ignore_eos": True})
    assert only_greedy[0].token_ids == expected[0].token_ids
    assert overlapped.engine.stats.overlapped_steps > 0 and clean(overlapped)


def test_abort_while_a_step_is_in_flight(folder, cpu_config):
    llm = make(cpu_config, folder, True)
    engine = llm.engine
    for i, n in enumerate((4, 6, 8)):
        engine.add_request(f"r{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert engine._in_flight is not None  # a launched step holds tokens on their way
    engine.abort("r1")
    finished = []
    while engine.has_unfinished():
        finished += [s.request_id for s in engine.step()]
    assert sorted(finished) == ["r0", "r2"]
    outs = {r: engine.pop_finished(r).seqs[0].output_token_ids for r in finished}
    alone = make(cpu_config, folder, False)
    for i, n in ((0, 4), (2, 8)):
        assert outs[f"r{i}"] == alone.generate([list(range(3, 3 + n))], {"max_tokens": 20, "ignore_eos": True})[0].token_ids
    assert clean(llm)


def test_async_scheduling_defaults_to_on_with_cuda_only(folder, cpu_config):
    """``async_scheduling`` unset (None): on where the pipeline runs on CUDA, off on the CPU,
    where the forward holds the host and there is nothing to overlap; set, it is obeyed."""
    from tessellm.core.config import PipelineConfig

    assert PipelineConfig().async_scheduling is None
    unset = LLM(cpu_config(folder, dtype="float64"))
    assert unset.pipeline.async_scheduling is False and unset.engine.async_scheduling is False
    forced = LLM(cpu_config(folder, dtype="float64", async_scheduling=True))
    assert forced.engine.async_scheduling is True
    if torch.cuda.is_available():
        on_gpu = LLM(cpu_config(folder, device="cuda", async_scheduling=None))
        assert on_gpu.engine.async_scheduling is True
