"""`sample` and `greedy`: the filtering rules on hand-made distributions, the sampler's
distribution, seeds, and equivalences on the real model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tessellm.core.interfaces.batch import BatchMetadata, SampleSlot
from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.plugins.decoding.greedy import GreedyDecoder
from tessellm.plugins.decoding.sample import SampleDecoder, filter_logits


def kept(probs: list[float], top_p: float = 1.0, top_k: int = 0, temperature: float = 1.0) -> set[int]:
    logits = torch.tensor([probs], dtype=torch.float64).log()
    out = filter_logits(logits, torch.tensor([temperature], dtype=torch.float64), torch.tensor([top_k]),
                        torch.tensor([top_p], dtype=torch.float64))
    return set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist())


def smallest_set_reaching(probs: list[float], p: float) -> set[int]:
    """Reference: tokens by decreasing probability until their mass reaches p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    chosen, mass = set(), 0.0
    for i in order:
        if mass >= p:
            break
        chosen.add(i)
        mass += probs[i]
    return chosen


@pytest.mark.parametrize("top_p, expected", [
    (1.0, {0, 1, 2, 3}),
    (0.5, {1}),  # 0.5 alone reaches 0.5
    (0.6, {1, 0}),
    (0.75, {1, 0}),  # exactly 0.75: two tokens suffice
    (0.8, {1, 0, 2}),
    (0.01, {1}),  # the most likely token always stays
])
def test_top_p_keeps_smallest_set_reaching_p(top_p, expected):
    assert kept([0.25, 0.5, 0.125, 0.125], top_p=top_p) == expected


@pytest.mark.parametrize("top_k, expected", [(1, {2}), (2, {2, 0}), (3, {2, 0, 1}), (0, {0, 1, 2, 3}), (9, {0, 1, 2, 3})])
def test_top_k_keeps_k_most_likely(top_k, expected):
    assert kept([0.3, 0.15, 0.5, 0.05], top_k=top_k) == expected


def test_top_k_then_top_p_renormalizes():
    # top_k=2 leaves {0.5, 0.3} -> renormalized {0.625, 0.375}; top_p 0.6 then keeps only the first
    assert kept([0.5, 0.3, 0.2], top_k=2, top_p=0.6) == {0}
    assert kept([0.5, 0.3, 0.2], top_k=2, top_p=0.7) == {0, 1}


@given(st.lists(st.integers(1, 1000), min_size=2, max_size=30, unique=True), st.floats(0.05, 1.0))
def test_top_p_property(weights, top_p):
    total = sum(weights)
    probs = [w / total for w in weights]
    expected = smallest_set_reaching(probs, top_p)
    # near the boundary float rounding may go either way; skip exact ties of cumulative mass
    ordered = sorted(probs, reverse=True)
    sums = [sum(ordered[:i]) for i in range(len(ordered) + 1)]
    if any(abs(s - top_p) < 1e-9 for s in sums):
        return
    assert kept(probs, top_p=top_p) == expected


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 4.0]], dtype=torch.float64)
    out = filter_logits(logits, torch.tensor([2.0], dtype=torch.float64), torch.tensor([0]),
                        torch.tensor([1.0], dtype=torch.float64))
    assert torch.allclose(out.softmax(-1), (logits / 2).softmax(-1))


def _batch(logits_rows: int, params: list[SamplingParams], seed: int = 0) -> BatchMetadata:
    samples = []
    for i, p in enumerate(params):
        seq = Sequence(f"r{i}", [1, 2, 3], p)
        seq.generator = torch.Generator().manual_seed(seed + i)
        samples.append(SampleSlot(seq, i, 1))
    empty = torch.zeros(0, dtype=torch.long)
    return BatchMetadata(empty, empty, empty, empty, empty, empty, torch.arange(logits_rows), [], [], [], 16,
                         [], samples)


def test_sampler_follows_filtered_distribution():
    """Chi-square goodness of fit of 20,000 draws (fixed seed) against the filtered distribution;
    the same test rejects a sampler that ignores top_p."""
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], dtype=torch.float64)
    params = SamplingParams(temperature=1.0, top_p=0.8)
    decoder = SampleDecoder(SampleDecoder.Options(), None, torch.device("cpu"))
    n = 20_000
    logits = probs.log().float()[None].repeat(n, 1)
    batch = _batch(n, [params] * n, seed=123)
    counts = torch.bincount(torch.tensor([t[0] for t in decoder.decode(logits, batch)]), minlength=5).double()
    target = torch.tensor([0.4, 0.3, 0.15, 0.0, 0.0], dtype=torch.float64) / 0.85

    def chi2(expected: torch.Tensor) -> float:
        mask = expected > 0
        return float(((counts[mask] - n * expected[mask]) ** 2 / (n * expected[mask])).sum())

    assert counts[3:].sum() == 0, "sampled a token top_p removed"
    assert chi2(target) < 13.8  # chi-square, 2 degrees of freedom, p = 0.001
    unfiltered = probs / probs.sum()
    wrong = float(((counts - n * unfiltered) ** 2 / (n * unfiltered)).sum())
    assert wrong > 13.8 * 10, "the test has no power against ignoring top_p"


def test_same_seed_same_tokens_and_independent_of_batch():
    decoder = SampleDecoder(SampleDecoder.Options(), None, torch.device("cpu"))
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.9, seed=1)] * 3
    first = decoder.decode(logits, _batch(3, params, seed=5))
    second = decoder.decode(logits, _batch(3, params, seed=5))
    assert first == second
    alone = decoder.decode(logits[1:2], _batch(1, params[:1], seed=6))
    assert alone[0] == first[1]


def test_greedy_refuses_sampling_requests():
    decoder = GreedyDecoder(GreedyDecoder.Options(), None, torch.device("cpu"))
    decoder.check(SamplingParams(temperature=0.0))
    decoder.check(SamplingParams(temperature=0.7, top_k=1))
    with pytest.raises(InvalidRequestError, match="temperature=0.7"):
        decoder.check(SamplingParams(temperature=0.7))


def test_real_model_seeds_top_k_1_and_greedy(smollm2_llm):
    prompts = ["The weather today is", "In 1492, Columbus"]
    sampled = {"max_tokens": 12, "temperature": 0.9, "seed": 11}
    a = smollm2_llm.generate(prompts, sampled)
    b = smollm2_llm.generate(prompts, sampled)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    alone = smollm2_llm.generate(prompts[1:], sampled)
    assert alone[0].token_ids == a[1].token_ids  # the batch does not change a seeded request
    greedy = smollm2_llm.generate(prompts, {"max_tokens": 12})
    top1 = smollm2_llm.generate(prompts, {"max_tokens": 12, "temperature": 1.3, "top_k": 1, "seed": 3})
    assert [o.token_ids for o in greedy] == [o.token_ids for o in top1]
