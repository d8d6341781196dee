"""The parts of `speculative` on their own: exact rejection sampling (checked by the output
distribution of a whole speculative generation over a Markov chain, and shown to catch a
wrong rule), the n-gram index against a brute-force search, and the adaptive draft length."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.plugins.decoding.speculative import rejection
from tessellm.plugins.decoding.speculative.adaptive import AdaptiveK, best_k, expected_tokens, verify_share
from tessellm.plugins.decoding.speculative.ngram import NgramProposer
from tessellm.plugins.decoding.speculative.rejection import accept_greedy, accept_sampled
from tessellm.testing.stats import chi_square

V = 4  # vocabulary of the chain
LENGTH = 3  # tokens generated per trial: V**LENGTH outcomes
TRIALS = 12_000


def chain(seed: int, sharpness: float) -> torch.Tensor:
    """A random transition matrix [V, V] (rows sum to 1), float64."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, V, generator=g, dtype=torch.float64) * sharpness).softmax(dim=-1)


P = chain(1, 1.5)  # the target: P[a, b] = p(next b | last a)
Q = chain(2, 1.5)  # the draft, deliberately different


def generate(k: int, gen: torch.Generator, one_hot: bool) -> tuple[int, ...]:
    """One speculative generation of LENGTH tokens after token 0, as the decoder runs it:
    at most k drafts per step and never past LENGTH (the last step leaves room for the
    target's own token). ``one_hot``: a deterministic proposer (next = last + 1 mod V)."""
    seq = [0]
    while len(seq) - 1 < LENGTH:
        n = min(k, LENGTH - len(seq))
        draft, qs, last = [], [], seq[-1]
        for _ in range(n):
            x = (last + 1) % V if one_hot else int(torch.multinomial(Q[last], 1, generator=gen))
            draft.append(x)
            qs.append(Q[last])
            last = x
        p = P[[seq[-1], *draft]]  # target rows after the last token and after each draft
        seq += accept_sampled(p, draft, None if one_hot or not qs else torch.stack(qs), gen)
    return tuple(seq[1:LENGTH + 1])


def exact() -> torch.Tensor:
    probs = torch.zeros((V,) * LENGTH, dtype=torch.float64)
    for path in itertools.product(range(V), repeat=LENGTH):
        prob, last = 1.0, 0
        for t in path:
            prob *= float(P[last, t])
            last = t
        probs[path] = prob
    return probs.flatten()


def counts(k: int, one_hot: bool, seed: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros(V ** LENGTH, dtype=torch.float64)
    for _ in range(TRIALS):
        path = generate(k, gen, one_hot)
        out[sum(t * V ** (LENGTH - 1 - i) for i, t in enumerate(path))] += 1
    return out


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft-distribution", "one-hot-drafts"])
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_output_has_the_target_distribution(k, one_hot):
    """The whole generation (drafts, acceptances, resamples and bonus tokens over several
    steps) draws each 3-token continuation with exactly the target chain's probability."""
    result = chi_square(counts(k, one_hot), exact())
    assert result.p_value > 1e-3, result


@pytest.mark.parametrize("wrong", ["resample-from-target", "always-accept"])
def test_the_distribution_test_catches_a_wrong_acceptance_rule(monkeypatch, wrong):
    """Power: the same test, with the same seed, fails when rejection resamples from p instead
    of norm(max(0, p - q)), or when drafts are accepted without the min(1, p/q) test."""
    if wrong == "resample-from-target":
        monkeypatch.setattr(rejection, "residual", lambda p, q, x: p)
    else:
        monkeypatch.setattr(rejection, "accept_sampled",
                            lambda p, draft, q, g: [*draft, int(torch.multinomial(p[len(draft)], 1, generator=g))])
        monkeypatch.setitem(globals(), "accept_sampled", rejection.accept_sampled)
    result = chi_square(counts(3, one_hot=False), exact())
    assert result.p_value < 1e-6, result


def test_identical_draft_is_always_accepted():
    p = chain(3, 2.0)[:3]
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        draft = [int(torch.multinomial(p[i], 1, generator=gen)) for i in range(2)]
        assert accept_sampled(p, draft, p[:2], gen)[:2] == draft


def test_greedy_acceptance_keeps_the_matching_prefix():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # correction at the first mismatch
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert accept_greedy([3], []) == [3]


def test_rejected_token_is_never_resampled():
    """max(0, p - q) is 0 wherever the draft was rejected (p(x) < q(x)), and a one-hot draft's
    residual excludes the draft token."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    assert rejection.residual(p, q, 1)[1] == 0 and rejection.residual(p, None, 0).tolist() == [0.0, 0.3, 0.2]


# ----------------------------------------------------------------------------- n-gram lookup


def brute_force(tokens: list[int], lo: int, hi: int, budget: int) -> list[int]:
    last = len(tokens) - 1
    for n in range(min(hi, last), lo - 1, -1):
        suffix = tokens[last - n + 1:]
        ends = [e for e in range(n - 1, last) if tokens[e - n + 1:e + 1] == suffix]
        if ends:
            extended = list(tokens)
            src = ends[-1] + 1
            out = []
            while len(out) < budget:
                out.append(extended[src])
                extended.append(extended[src])
                src += 1
            return out
    return []


@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40), lo=st.integers(1, 3),
       extra=st.integers(0, 3), budget=st.integers(1, 6))
def test_ngram_lookup_matches_brute_force_as_the_sequence_grows(tokens, lo, extra, budget):
    hi = lo + extra
    proposer = NgramProposer(lo, hi)
    seq = Sequence("r", tokens[:1], SamplingParams())
    for t in tokens[1:] + [None]:
        [draft] = proposer.propose([seq], [budget])
        assert draft.tokens == brute_force(seq.token_ids, lo, hi, budget)
        assert draft.probs is None
        if t is not None:
            seq.token_ids.append(t)
    proposer.finish(seq)
    assert not proposer._index


def test_ngram_prefers_the_longest_and_most_recent_match():
    proposer = NgramProposer(1, 3)
    seq = Sequence("r", [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3], SamplingParams())
    # suffix [1, 2, 3] occurs at the start (followed by 9); [2, 3] also later (followed by 8)
    assert proposer.propose([seq], [2])[0].tokens == [9, 2]
    assert proposer.propose([seq], [0])[0].tokens == []


# ----------------------------------------------------------------------------- adaptive k


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_best_k_trades_acceptance_against_cost():
    assert best_k(0.9, 8, 0.02) >= 6  # cheap drafts, high acceptance: draft many
    assert best_k(0.5, 8, 0.0) == 8  # free drafts always pay
    assert best_k(0.2, 8, 0.9) == 0  # expensive drafts, rarely accepted: switch off
    assert 1 <= best_k(0.7, 8, 0.1) < 8


def test_adaptive_k_switches_off_then_probes():
    ctl = AdaptiveK(4, draft_cost=0.2, verify_cost=0.1, probe_interval=4)
    ks = []
    for _ in range(40):
        k = ctl.k_for(1)
        ks.append(k)
        ctl.observe(1, k, 0)  # every draft rejected
    assert ks[0] > 0 and ks[-1] == 0, ks
    probes = [i for i in range(1, len(ks)) if ks[i] == 1 and ks[i - 1] == 0]
    assert [b - a for a, b in zip(probes, probes[1:])] == [8, 16], ks  # probes after 4, 8, 16 idle steps
    for _ in range(20):
        ctl.observe(1, 4, 4)
    assert ctl.k_for(1) == 4
    ctl.forget(1)
    assert ctl.rate(1) == ctl.overall.value


def test_adaptive_k_never_drafts_when_drafts_cannot_pay():
    ctl = AdaptiveK(4, draft_cost=26 / 30, verify_cost=0.1)  # layer-skip of 26 of 30 layers on a CPU
    assert ctl.hopeless(1) and all(ctl.k_for(1) == 0 for _ in range(100))
    assert not AdaptiveK(4, draft_cost=0.4, verify_cost=0.1).hopeless(1)


def test_verification_costs_more_in_larger_batches():
    """Alone, a verified token costs verify_cost of the step; in a compute-bound batch, nearly
    a whole token's share: n-gram drafts that pay alone stop paying in a large CPU batch."""
    assert verify_share(0.1, 1) == pytest.approx(0.1)
    assert verify_share(0.1, 16) == pytest.approx(0.4)
    assert verify_share(0.0, 64) == 0.0 and verify_share(0.2, 400) == 1.0
    ctl = AdaptiveK(4, draft_cost=0.0, verify_cost=0.1)
    ctl.observe(1, 4, 1)
    ctl.observe(1, 4, 2)  # acceptance about 0.5
    assert ctl.k_for(1, batch_size=1) >= 2 and ctl.k_for(1, batch_size=64) == 0
