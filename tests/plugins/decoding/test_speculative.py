"""`speculative` inside the engine: exact greedy equivalence for every proposer under
continuous batching over the paged cache, the target's sampling distribution end to end
(n > 1 included), and bad options, aborts and a full draft cache.

A tiny random-weight model in float64 makes greedy comparisons exact: verification scores
k+1 positions in one forward where plain decoding scores one, and only rounding could tell
the two apart."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessellm import LLM
from tessellm.core.errors import ConfigError
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.testing.engine import run_arrivals as run
from tessellm.testing.stats import chi_square

NUM_BLOCKS = 96
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def other_draft(tiny_model, tmp_path_factory):
    """The tiny llama's weights plus noise: a draft that agrees with it only some of the time."""
    from tessellm.testing.models import noisy_copy

    return noisy_copy(tiny_model("llama"), tmp_path_factory.mktemp("tiny-noisy-draft"))


@pytest.fixture(scope="module")
def reference(tiny_model, cpu_config):
    """Plain decoding (contiguous cache, static batches): each request alone."""
    return LLM(cpu_config(tiny_model("llama"), dtype="float64"))


def spec_config(cpu_config, model, proposer: str, wide: bool = False, **options) -> dict:
    """Paged + continuous, float64; narrow (4 sequences, 24-token steps: chunked prompts,
    preemption) or ``wide`` (64 sequences, for the sampling runs)."""
    return cpu_config(model, dtype="float64",
                      cache={"name": "paged", "options": {"block_size": BLOCK_SIZE,
                                                          "num_blocks": NUM_BLOCKS * (8 if wide else 1)}},
                      scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 1024 if wide else 24,
                                                                   "max_num_seqs": 64 if wide else 4}},
                      attention={"name": "auto"},
                      decoding={"name": "speculative", "options": {"proposer": proposer, **options}})


_pipelines: dict[tuple, LLM] = {}


def speculative_llm(cpu_config, tiny_model, other_draft, variant: str, k: int, adaptive: bool,
                    wide: bool = False) -> LLM:
    key = (variant, k, adaptive, wide)
    if key not in _pipelines:
        options: dict = {"k": k, "adaptive_k": adaptive}
        proposer = variant
        if variant == "layer-skip":
            options["draft_layers"] = [0]
        elif variant.startswith("draft"):
            proposer = "draft"
            same = variant == "draft-same"
            # the target's own weights in float32: almost always agrees; the other model rarely does
            options["draft_model"] = str(tiny_model("llama") if same else other_draft)
            options["draft_overrides"] = ["dtype=float32" if same else "dtype=float64",
                                          f"cache.options.num_blocks={NUM_BLOCKS * 8}"]
        _pipelines[key] = LLM(spec_config(cpu_config, tiny_model("llama"), proposer, wide, **options))
    return _pipelines[key]


_alone: dict[tuple, list[int]] = {}


def alone(reference: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    key = (tuple(prompt), max_tokens)
    if key not in _alone:
        _alone[key] = reference.generate([prompt], {"max_tokens": max_tokens})[0].token_ids
    return _alone[key]


def assert_nothing_left(llm: LLM) -> None:
    """Every block back (target and draft caches) and no per-sequence state in the decoder."""
    p = llm.pipeline
    assert p.cache.num_free_blocks == p.cache.num_blocks
    decoder = p.decoder
    assert not decoder.adaptive._rates
    proposer = decoder.proposer
    if proposer.name == "draft":
        assert not proposer._shadows and proposer.draft.cache.num_free_blocks == proposer.draft.cache.num_blocks
    if proposer.name == "ngram":
        assert not proposer._index


ALPHABET = [17, 230, 4242, 777, 9001]  # few distinct tokens: prompts repeat, so n-grams match


prompt_st = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=28)
request_st = st.tuples(st.integers(0, 4), prompt_st, st.integers(1, 20))


@settings(max_examples=24)
@given(variant=st.sampled_from(["ngram", "layer-skip", "draft-same", "draft-other"]), k=st.integers(1, 5),
       adaptive=st.booleans(), requests=st.lists(request_st, min_size=1, max_size=4))
def test_greedy_speculative_equals_plain_greedy(variant, k, adaptive, requests, cpu_config, tiny_model, other_draft,
                                               reference):
    """For every proposer, random k, prompts, lengths and arrival steps, in one continuous
    batch: each request's greedy tokens equal plain greedy decoding of it alone."""
    llm = speculative_llm(cpu_config, tiny_model, other_draft, variant, k, adaptive)
    before = llm.engine.stats.draft_tokens
    outputs = run(llm.engine, [(at, prompt, SamplingParams(max_tokens=m)) for at, prompt, m in requests])
    for i, (_, prompt, m) in enumerate(requests):
        assert outputs[f"r{i}"][0] == alone(reference, prompt, m), f"request {i} of {variant}, k={k}"
    assert_nothing_left(llm)
    assert llm.engine.stats.draft_tokens >= before


@pytest.mark.parametrize("variant", ["ngram", "layer-skip", "draft-same", "draft-other"])
def test_every_proposer_drafts_and_gets_drafts_accepted(variant, cpu_config, tiny_model, other_draft, reference):
    """The equivalence above is not vacuous: each proposer drafts, and its drafts are accepted
    (all of them, with a bonus token, at least once) and rejected in the same runs."""
    llm = speculative_llm(cpu_config, tiny_model, other_draft, variant, 4, False)
    engine = llm.engine
    engine.stats = type(engine.stats)()
    prompts = [[ALPHABET[i % 3] for i in range(n)] for n in (5, 9, 14)] + [ALPHABET * 3]
    outputs = run(llm.engine, [(0, p, SamplingParams(max_tokens=40)) for p in prompts])
    for i, p in enumerate(prompts):
        assert outputs[f"r{i}"][0] == alone(reference, p, 40)
    stats = engine.stats
    assert stats.draft_tokens > 0 and stats.accepted_draft_tokens > 0
    if variant != "draft-same":
        assert stats.accepted_draft_tokens < stats.draft_tokens
    assert stats.tokens_per_forward > 1.0


# ----------------------------------------------------------------------------- sampling


TOP_K = 3
LENGTH = 3


def exact_distribution(reference: LLM, prompt: list[int], temperature: float,
                       process=None) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) of the target after top-k filtering, from teacher-forced logits (first
    transformed by ``process(logits, prompt, path)`` where given: a logits processor's reference)."""
    from tessellm.plugins.decoding.sample import filter_logits

    def next_probs(tokens: list[int]) -> torch.Tensor:
        logits = reference.engine.score(tokens)[-1:].double()
        if process is not None:
            logits = process(logits, prompt, tokens[len(prompt):])
        f = filter_logits(logits, torch.tensor([temperature], dtype=torch.float64), torch.tensor([TOP_K]),
                          torch.tensor([1.0], dtype=torch.float64))
        return f.softmax(dim=-1)[0]

    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(LENGTH):
        grown = {}
        for path, prob in out.items():
            p = next_probs(prompt + list(path))
            for t in torch.nonzero(p).flatten().tolist():
                grown[path + (t,)] = prob * float(p[t])
        out = grown
    return out


def sample_paths(llm: LLM, prompt: list[int], temperature: float, requests: int | None = None,
                 **fields) -> list[tuple[int, ...]]:
    params = [SamplingParams(max_tokens=LENGTH, temperature=temperature, top_k=TOP_K, n=16, seed=s, **fields)
              for s in range(requests or NUM_REQUESTS)]
    outs = llm.generate([prompt] * len(params), params)
    return [tuple(o.token_ids) for out in outs for o in out.outputs]


def fit(paths: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]):
    index = {path: i for i, path in enumerate(exact)}
    if not set(paths) <= set(index):
        return None  # a continuation the target gives probability 0
    counts = torch.bincount(torch.tensor([index[p] for p in paths]), minlength=len(index))
    return chi_square(counts, torch.tensor(list(exact.values())))


PROMPT = [ALPHABET[i % 5] for i in range(11)]
TEMPERATURE = 1.3
# 1,024 samples: the right rule's p-values are about 0.3 to 0.5, the wrong rule's about 1e-10
# (2,048 samples gave 0.3 to 0.6 and 1e-19 at twice the time)
NUM_REQUESTS = 64


@pytest.mark.parametrize("variant", ["layer-skip", pytest.param("draft-other", marks=pytest.mark.extended)])
def test_sampled_output_has_the_target_distribution(variant, cpu_config, tiny_model, other_draft, reference):
    """1,024 samples (64 requests with n = 16 and their own seeds) of 3 tokens, drafted and
    verified by rejection sampling inside the engine, against the target's exact
    distribution of 3-token continuations (chi-square; fixed seeds)."""
    llm = speculative_llm(cpu_config, tiny_model, other_draft, variant, 2, False, wide=True)
    engine = llm.engine
    engine.stats = type(engine.stats)()
    paths = sample_paths(llm, PROMPT, TEMPERATURE)
    assert len(paths) == NUM_REQUESTS * 16 and all(len(p) == LENGTH for p in paths)
    result = fit(paths, exact_distribution(reference, PROMPT, TEMPERATURE))
    assert result is not None and result.p_value > 1e-3, result
    assert engine.stats.draft_tokens > len(paths) / 4  # speculation did the work
    assert 0 < engine.stats.accepted_draft_tokens < engine.stats.draft_tokens
    assert_nothing_left(llm)


PENALTIES = {"presence_penalty": -1.5, "frequency_penalty": -1.0, "repetition_penalty": 1.6}
"""Negative presence and frequency penalties favour the tokens already out: the distribution of
each token depends strongly on the ones before it (drafts included)."""


def penalised(logits: torch.Tensor, prompt: list[int], path: list[int]) -> torch.Tensor:
    """``PENALTIES`` in float64 plain torch: the repetition penalty over prompt and output,
    then presence and frequency over the output (the processors' order)."""
    row = logits[0].clone()
    seen = torch.tensor(sorted(set(prompt) | set(path)), dtype=torch.long)
    row[seen] = torch.where(row[seen] > 0, row[seen] / 1.6, row[seen] * 1.6)
    for token in set(path):
        row[token] -= -1.5 + -1.0 * path.count(token)
    return row[None]


def test_sampled_output_with_penalties_has_the_processed_distribution(cpu_config, tiny_model, other_draft, reference):
    """Rejection sampling stays exact for the processed distribution: 512 samples drafted by
    another model and verified against penalised rows (each row seeing the drafts before it as
    accepted) fit the penalised target's exact distribution, and not the unpenalised one."""
    llm = speculative_llm(cpu_config, tiny_model, other_draft, "draft-other", 2, False, wide=True)
    engine = llm.engine
    engine.stats = type(engine.stats)()
    paths = sample_paths(llm, PROMPT, TEMPERATURE, NUM_REQUESTS // 2, **PENALTIES)
    result = fit(paths, exact_distribution(reference, PROMPT, TEMPERATURE, penalised))
    assert result is not None and result.p_value > 1e-3, result
    unpenalised = fit(paths, exact_distribution(reference, PROMPT, TEMPERATURE))
    assert unpenalised is None or unpenalised.p_value < 1e-4, unpenalised
    assert 0 < engine.stats.accepted_draft_tokens < engine.stats.draft_tokens
    assert_nothing_left(llm)


@pytest.mark.extended
def test_engine_distribution_test_catches_a_wrong_rule(monkeypatch, cpu_config, tiny_model, other_draft, reference):
    """Power, end to end: resampling a rejected position from p instead of norm(max(0, p - q))
    over-weights the draft's favourite tokens, and the same test with the same seeds fails."""
    from tessellm.plugins.decoding.speculative import rejection

    monkeypatch.setattr(rejection, "residual", lambda p, q, x: p)
    llm = speculative_llm(cpu_config, tiny_model, other_draft, "draft-other", 2, False, wide=True)
    result = fit(sample_paths(llm, PROMPT, TEMPERATURE), exact_distribution(reference, PROMPT, TEMPERATURE))
    assert result is None or result.p_value < 1e-4, result


def test_logprobs_come_from_the_row_that_produced_each_token(cpu_config, tiny_model, other_draft, reference):
    """With drafts accepted several at a time, each token's logprob is the target's at its own
    position (teacher-forced float64 logits), as in plain decoding."""
    llm = speculative_llm(cpu_config, tiny_model, other_draft, "draft-same", 4, False)
    prompt = [ALPHABET[i % 3] for i in range(9)]
    out = llm.generate([prompt], {"max_tokens": 12, "logprobs": 2})[0].outputs[0]
    assert llm.engine.stats.accepted_draft_tokens > 0 and len(out.logprobs) == len(out.token_ids)
    logits = reference.engine.score(prompt + out.token_ids).double()
    expected = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry.logprob == pytest.approx(float(expected[i, token]), abs=1e-9)
        assert [t for t, _ in entry.top] == expected[i].topk(2).indices.tolist()


def test_seeded_sampling_is_reproducible(cpu_config, tiny_model, other_draft):
    llm = speculative_llm(cpu_config, tiny_model, other_draft, "draft-other", 3, True)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=42, n=2)
    first = llm.generate([[17, 230, 17, 230, 17]], params)[0]
    second = llm.generate([[17, 230, 17, 230, 17]], params)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]


# ----------------------------------------------------------------------------- faults and limits


def test_abort_mid_run_frees_target_and_draft_caches(cpu_config, tiny_model, other_draft):
    llm = speculative_llm(cpu_config, tiny_model, other_draft, "draft-other", 3, False)
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"a{i}", [17, 230, 4242] * (i + 1), SamplingParams(max_tokens=30))
    for _ in range(4):
        engine.step()
    assert llm.pipeline.decoder.proposer._shadows
    for i in range(3):
        engine.abort(f"a{i}")
    assert not engine.has_unfinished()
    assert_nothing_left(llm)


def test_full_draft_cache_drafts_nothing_and_stays_exact(cpu_config, tiny_model, reference):
    """A draft cache too small for the prompt: those sequences go undrafted, outputs exact."""
    llm = LLM(spec_config(cpu_config, tiny_model("llama"), "draft", k=3, draft_model=str(tiny_model("llama")),
                          draft_overrides=["cache.options.num_blocks=3"]))
    prompts = [[17, 230] * 4, [4242] * 20]
    outs = llm.generate(prompts, {"max_tokens": 10})
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == alone(reference, prompt, 10)
    assert_nothing_left(llm)


def test_drafts_never_pass_max_tokens_or_the_context_window(cpu_config, tiny_model):
    llm = LLM({**spec_config(cpu_config, tiny_model("llama"), "ngram", k=8, adaptive_k=False), "max_model_len": 40})
    outs = llm.generate([[17, 230] * 6, [17, 230] * 15], [{"max_tokens": 5}, {"max_tokens": 10}])
    assert [len(o.token_ids) for o in outs] == [5, 10]
    assert_nothing_left(llm)


def test_engine_refuses_a_decoder_that_breaks_its_contract(monkeypatch, cpu_config, tiny_model):
    """Too many tokens back from decode, or more drafts than the reserved lookahead: a clear
    error, and the requests are aborted with every block returned."""
    from tessellm import ContractError
    from tessellm.plugins.decoding.speculative.proposer import Draft

    llm = LLM(spec_config(cpu_config, tiny_model("llama"), "ngram", k=2, adaptive_k=False))
    decoder = llm.pipeline.decoder
    with monkeypatch.context() as m:
        m.setattr(decoder, "decode", lambda logits, batch: [[1, 2, 3, 4]] * len(batch.samples))
        with pytest.raises(ContractError, match="decoding plugin 'speculative'.* broke its contract: decode returned 4 "
                                                "tokens for sample slot 0, which verifies 0 drafts"):
            llm.generate([[17, 230] * 4], {"max_tokens": 5})
    assert_nothing_left(llm)
    with monkeypatch.context() as m:
        m.setattr(decoder.proposer, "propose", lambda seqs, budgets: [Draft([17] * 5) for _ in seqs])
        with pytest.raises(ContractError, match="num_lookahead_tokens"):
            llm.generate([[17, 230] * 4], {"max_tokens": 5})
    assert_nothing_left(llm)
    assert llm.generate([[17, 230] * 4], {"max_tokens": 5})[0].finish_reason == "length"  # still serving


@pytest.mark.parametrize("options, match", [
    ({"proposer": "medusa"}, "ngram.*draft.*layer-skip"),
    ({"proposer": "ngram", "k": 0}, "k"),
    ({"proposer": "ngram", "ngram_min": 5, "ngram_max": 2}, "ngram_min"),
    ({"proposer": "ngram", "draft_model": "x"}, "draft_model"),
    ({"proposer": "ngram", "draft_layers": [0]}, "draft_layers"),
    ({"proposer": "draft"}, "needs a draft model"),
    ({"proposer": "layer-skip", "draft_layers": [0, 7]}, r"layers in \[0, 2\)"),
])
def test_bad_options_name_the_problem(options, match, cpu_config, tiny_model):
    with pytest.raises(ConfigError, match=match):
        LLM(cpu_config(tiny_model("llama"), decoding={"name": "speculative", "options": options}))


def test_draft_model_must_share_the_vocabulary(cpu_config, tiny_model):
    small_vocab = tiny_model("llama", vocab_size=1024)
    with pytest.raises(ConfigError, match="must share the target's tokenizer"):
        LLM(cpu_config(tiny_model("llama"), decoding={"name": "speculative", "options": {
            "proposer": "draft", "draft_model": str(small_vocab)}}))
