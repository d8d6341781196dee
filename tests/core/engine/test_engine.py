"""The engine and the Python API on a tiny random model (float64, so batch composition
cannot change a token): nothing dropped, nothing leaked, n > 1, stops, aborts, faults.
Every test runs three times: with the reference parts (contiguous + static), the default ones
(paged + continuous), and those with async scheduling (decode steps launched before the
previous step's tokens reach the host)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessellm import LLM
from tessellm.core.errors import InvalidRequestError, RequestRejectedError
from tessellm.core.interfaces.sequence import SamplingParams, Sequence


@pytest.fixture(scope="module")
def folder(tiny_model):
    return tiny_model("llama")


PARTS = {
    # the reference parts: one region per sequence, fixed batches
    "contiguous+static": lambda seqs, batch: (
        {"name": "contiguous", "options": {"max_seqs": seqs}},
        {"name": "static", "options": {"max_batch_size": batch}}),
    # the default parts: room for ``seqs`` prompts of 30 + 18 tokens, in-flight batching
    "paged+continuous": lambda seqs, batch: (
        {"name": "paged", "options": {"block_size": 16, "num_blocks": 3 * seqs}},
        {"name": "continuous", "options": {"max_num_seqs": batch, "max_num_batched_tokens": 64}}),
}
PARTS["paged+continuous+async"] = PARTS["paged+continuous"]


@pytest.fixture(params=list(PARTS))
def make_llm(request, folder, cpu_config):
    """Factory of float64 LLMs over the tiny model with the parts under test."""

    def make(max_seqs=8, batch=16, **extra) -> LLM:
        cache, scheduler = PARTS[request.param](max_seqs, batch)
        if request.param.endswith("+async"):
            extra["async_scheduling"] = True
        return LLM(cpu_config(folder, dtype="float64", cache=cache, scheduler=scheduler, **extra))

    return make


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def free_everything(llm: LLM) -> bool:
    engine = llm.engine
    return engine.cache.num_free_blocks == engine.cache.num_blocks and not engine.scheduler.unfinished()


def test_more_requests_than_cache_all_finish_like_alone(make_llm):
    big = make_llm()
    small = make_llm(max_seqs=2, batch=3)
    ps = prompts(7)
    params = {"max_tokens": 9, "ignore_eos": True}
    alone = [big.generate([p], params)[0].token_ids for p in ps]
    outs = small.generate(ps, params)
    assert [o.token_ids for o in outs] == alone
    assert all(len(t) == 9 for t in alone)
    assert free_everything(small)


def test_parallel_sampling_forks_and_falls_back_when_full(make_llm):
    params = {"max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 42, "ignore_eos": True}
    roomy = make_llm(max_seqs=8)
    tight = make_llm(max_seqs=2)  # 3 samples, 2 regions: a child recomputes
    ps = prompts(2, seed=3)
    a = roomy.generate(ps, params)
    b = tight.generate(ps, params)
    for x, y in zip(a, b):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        assert [c.index for c in x.outputs] == [0, 1, 2]
        assert len({tuple(c.token_ids) for c in x.outputs}) > 1  # the samples differ
    assert free_everything(tight) and free_everything(roomy)


def test_stop_strings_and_stop_tokens(make_llm):
    llm = make_llm()
    p = prompts(1, seed=5)[0]
    full = llm.generate([p], {"max_tokens": 12, "ignore_eos": True})[0]
    assert full.finish_reason == "length"
    # stop at the text of the 5th token onwards: the text must end before it
    cut = llm.tokenizer.decode(full.token_ids[:4], skip_special_tokens=True)
    stop = full.text[len(cut):len(cut) + 3]
    if stop.strip():
        stopped = llm.generate([p], {"max_tokens": 12, "stop": [stop], "ignore_eos": True})[0]
        assert stopped.finish_reason == "stop" and stop not in stopped.text
        assert full.text.startswith(stopped.text)
    by_token = llm.generate([p], {"max_tokens": 12, "stop_token_ids": [full.token_ids[3]], "ignore_eos": True})[0]
    assert by_token.finish_reason == "stop"
    assert by_token.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[3]) + 1]


def test_abort_frees_cache(make_llm):
    llm = make_llm()
    engine = llm.engine
    for i, p in enumerate(prompts(3)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.cache.num_free_blocks < engine.cache.num_blocks
    for i in range(3):
        engine.abort(f"r{i}")
    assert free_everything(llm)
    engine.abort("never-existed")  # a no-op


def test_fault_in_a_step_leaves_no_request_and_no_block(make_llm, monkeypatch):
    llm = make_llm()
    calls = {"n": 0}
    forward = llm.engine.runner.forward

    def flaky(batch, layers=None, **kwargs):
        calls["n"] += 1
        if calls["n"] in (3, 4):  # twice: async scheduling reruns a failed launch synchronously once
            raise RuntimeError("injected fault")
        return forward(batch, layers, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "forward", flaky)
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.generate(prompts(3), {"max_tokens": 6})
    assert free_everything(llm) and not llm.engine.requests
    outs = llm.generate(prompts(3), {"max_tokens": 6})  # the engine keeps working
    assert all(o.finish_reason in ("stop", "length") for o in outs)


def test_admission_errors(make_llm):
    llm = make_llm(max_model_len=32)
    with pytest.raises(RequestRejectedError, match="max_model_len 32"):
        llm.generate([[5] * 10], {"max_tokens": 30})
    with pytest.raises(InvalidRequestError, match="context window"):
        llm.generate([[5] * 40], {"max_tokens": 1})
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[5, 10**6]], {"max_tokens": 1})
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], {"max_tokens": 1})
    with pytest.raises(InvalidRequestError, match="no prompts"):
        llm.generate([], {"max_tokens": 1})
    with pytest.raises(InvalidRequestError, match="n"):
        llm.generate([[5]], {"max_tokens": 1, "n": 0})
    assert free_everything(llm)


def test_outputs_come_back_in_prompt_order_with_timings(make_llm):
    llm = make_llm(max_seqs=2, batch=2)
    ps = prompts(5, seed=9)
    outs = llm.generate(ps, [{"max_tokens": 3 + i, "ignore_eos": True} for i in range(5)])
    assert [len(o.token_ids) for o in outs] == [3, 4, 5, 6, 7]
    assert [o.prompt_token_ids for o in outs] == ps
    assert all(o.ttft_s is not None and 0 < o.ttft_s <= o.e2e_s for o in outs)


def test_score_matches_generation(make_llm):
    llm = make_llm()
    p = prompts(1, seed=11)[0]
    out = llm.generate([p], {"max_tokens": 5, "ignore_eos": True})[0]
    logits = llm.engine.score(p + out.token_ids[:-1])
    assert logits[len(p) - 1:].argmax(-1).tolist() == out.token_ids
    assert free_everything(llm)


def test_generate_takes_priority_and_cache_salt(make_llm):
    llm = make_llm()
    ps = prompts(3, seed=13)
    params = {"max_tokens": 4, "ignore_eos": True}
    plain = [o.token_ids for o in llm.generate(ps, params)]
    salted = llm.generate(ps, params, priority=[2, 0, 1], cache_salt=["a", None, "b"])
    assert [o.token_ids for o in salted] == plain
    with pytest.raises(InvalidRequestError, match="2 priority values for 3 prompts"):
        llm.generate(ps, params, priority=[0, 1])
    with pytest.raises(InvalidRequestError, match="cache_salt must be a string or None"):
        llm.generate(ps, params, cache_salt=5)
    assert free_everything(llm)


@pytest.fixture(scope="module")
def stop_llm(folder, cpu_config):
    return LLM(cpu_config(folder))


@settings(max_examples=40)
@given(st.lists(st.integers(0, 49151), min_size=1, max_size=120), st.data())
def test_stop_strings_checked_on_a_window_match_the_whole_text(stop_llm, ids, data):
    """The windowed stop-string check finds the first stop exactly where decoding the whole
    output after every token finds it (SmolLM2's byte-level tokenizer: multi-byte
    characters split across tokens, spaces, special tokens)."""
    llm = stop_llm
    text = llm.tokenizer.decode(ids, skip_special_tokens=True)
    start = data.draw(st.integers(0, max(len(text) - 1, 0)))
    stop = text[start:start + data.draw(st.integers(1, 12))] or "x"
    stops = [stop, data.draw(st.sampled_from(["\n\n", "###", "zzq"]))]
    seq = Sequence("s", [1], SamplingParams(stop=stops, max_tokens=200))
    found, expected = None, None
    for i, token in enumerate(ids):
        seq.token_ids.append(token)
        full = llm.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        if expected is None and any(s in full for s in stops):
            expected = (i, min(full.find(s) for s in stops if s in full))
        if found is None and llm.engine.stop._hit_stop_string(seq):
            found = (i, seq.stop_text_len)
        if found or expected:
            break
    assert found == expected

