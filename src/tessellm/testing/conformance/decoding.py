"""The decoding plugin contract as properties: greedy rows take the argmax, sampled tokens
follow the target distribution (chi-square; the decoder's own ``target_probs``, else the
standard rule ``tessellm.testing.reference_probs``), seeded requests repeat exactly, and a
speculative decoder's outputs keep the target's distribution (greedy: the argmax at every
step, which is plain greedy decoding; sampled: chi-square over whole continuations).

Two levels. Decoder level: the decoder, built and attached by a real pipeline, decodes
hand-made logits for prompt steps (fast: thousands of draws in one ``decode``). Engine
level: requests run through a pipeline on ``tessellm_tiny_model`` and are checked against
the model's own float64 logits from ``transformers`` (independent of tessellm's forward),
so drafting, verification and rollback are inside what is checked."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, strategies as st

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.batch import BatchMetadata, SampleSlot, ScheduledSeq, SchedulerOutput
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.testing import reference_probs
from tessellm.testing.conformance.base import ConformanceSuite, property_settings
from tessellm.testing.conformance.pipeline import build_llm, require_capacity, selection_context, skip_unless_admitted
from tessellm.testing.stats import chi_square

ALPHA = 1e-3
"""Significance level of every chi-square test here: a correct sampler fails one case with
probability 0.001 (the seeds are fixed, so a run that passes always passes)."""

DRAWS = 8_000
"""Draws per decoder-level sampling case. Categories expected fewer than 5 times are pooled
(``chi_square``), which leaves at most 212 cells for the cases here (211 degrees of
freedom). With ALPHA 0.001 the test then rejects, with power >= 0.99, any sampler whose
distribution q is at chi-square distance sum((q - p)^2 / p) >= PHI2_MIN from the target p;
a sampler that ignores a filter putting mass m >= 0.01 outside the target's support is
caught outright (a draw of probability 0 makes the statistic infinite; P(no such draw) =
(1 - m)^DRAWS < 1e-34)."""

PHI2_MIN = 0.02
"""The chi-square distance ``DRAWS`` detects with power 0.99: noncentrality DRAWS * PHI2_MIN
= 160 with 211 degrees of freedom exceeds the 0.999 quantile (280.2) with probability
0.9988 (simulated); fewer degrees of freedom only raise the power (0.9995 at 7)."""

PATH_LENGTH = 3
PATH_TOP_K = 3
PATH_TEMPERATURE = 1.3
PATH_REQUESTS = 128
PATH_SAMPLES = 16
"""Engine-level sampling: 128 seeded requests with n = 16, 2,048 continuations of 3 tokens
(top_k 3: 27 possible paths, 26 degrees of freedom). With ALPHA 0.001 the test has power
0.99 against a continuation distribution at chi-square distance >= 0.045 from the target
(noncentrality 92); e.g. resampling a rejected draft from p instead of max(0, p - q)."""

ARGMAX_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-3}
"""How far below the float64 reference's maximum a greedy token's reference logit may be
(rounding of the pipeline's dtype; near ties only). Other dtypes: ``HALF_TOLERANCE``."""
HALF_TOLERANCE = 5e-2


@dataclass(frozen=True)
class SamplingCase:
    """One sampling setting checked at decoder level. ``params`` are ``SamplingParams``
    fields, ``extra_args`` among them for a decoder's own per-request settings (its
    ``RequestArgs``); ``ignored`` names the settings (fields, or keys of ``extra_args``)
    whose omission the case must be able to detect (its power is checked, see
    ``_assert_power``)."""

    name: str
    params: dict[str, Any]
    ignored: tuple[str, ...]


SAMPLING_CASES = [
    SamplingCase("temperature=1", {"temperature": 1.0}, ()),
    SamplingCase("temperature=0.6", {"temperature": 0.6}, ("temperature",)),
    SamplingCase("top_k=4", {"temperature": 1.0, "top_k": 4}, ("top_k",)),
    SamplingCase("top_p=0.7", {"temperature": 1.0, "top_p": 0.7}, ("top_p",)),
    SamplingCase("temperature=1.5,top_p=0.9", {"temperature": 1.5, "top_p": 0.9}, ("temperature", "top_p")),
    SamplingCase("top_k=5,top_p=0.8", {"temperature": 1.0, "top_k": 5, "top_p": 0.8}, ("top_k", "top_p")),
    SamplingCase("min_p=0.3", {"temperature": 1.0, "min_p": 0.3}, ("min_p",)),
    SamplingCase("top_k=1", {"temperature": 0.8, "top_k": 1}, ()),
]
"""Temperature scales the logits first; then top_k keeps the k most likely tokens, top_p the
smallest set of those (renormalised) whose mass reaches p, min_p the tokens at least min_p
times as likely as the most likely one. A case whose setting ``SamplingParams`` lacks
(min_p, where absent) is skipped. A suite runs the cases of its ``sampling_cases``: these by
default; an author adds cases for the plugin's own settings there."""

HEAD = [0.30, 0.20, 0.15, 0.10, 0.08, 0.05]
"""Probabilities of the six most likely tokens of the decoder-level logits; the other 12%
spreads unevenly over the rest of the vocabulary, so top_p and min_p cut real mass."""

def target_distribution(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                        min_p: float = 0.0) -> torch.Tensor:
    """The standard rule from one row of logits [V]: ``tessellm.testing.reference_probs``
    (this name stays for code written against earlier releases)."""
    return reference_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def target_probs(decoder: Any, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``decoder`` must draw from for ``params`` given one row of logits
    [V]: its own ``target_probs`` when it declares one, else the standard rule. A declared
    distribution that is not one (wrong shape, negative, not summing to 1) fails here."""
    logits = logits.double()
    declared = decoder.target_probs(logits, params) if hasattr(decoder, "target_probs") else None
    if declared is None:
        return reference_probs(logits, params)
    declared = declared.detach().double().cpu()
    name = getattr(decoder, "name", type(decoder).__name__)
    assert declared.shape == logits.shape, (f"decoding plugin {name!r}: target_probs returned shape "
                                            f"{tuple(declared.shape)} for logits of shape {tuple(logits.shape)}")
    assert bool((declared >= 0).all()) and abs(float(declared.sum()) - 1) < 1e-6, (
        f"decoding plugin {name!r}: target_probs for {params.model_dump(exclude_defaults=True)} is not a "
        f"distribution (sum {float(declared.sum()):.6g}, min {float(declared.min()):.3g})")
    return declared


def head_logits(vocab: int, seed: int = 0) -> torch.Tensor:
    """Log-probabilities [V] with ``HEAD`` on scattered token ids and an uneven tail."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)
    tail = torch.rand(vocab - len(HEAD), generator=g, dtype=torch.float64) ** 3 + 1e-3
    probs = torch.empty(vocab, dtype=torch.float64)
    probs[ids[:len(HEAD)]] = torch.tensor(HEAD, dtype=torch.float64)
    probs[ids[len(HEAD):]] = (1 - sum(HEAD)) * tail / tail.sum()
    return probs.log()


class FloatReference:
    """The tiny model's logits in float64 from ``transformers``: the model's own float
    forward, with no tessellm part involved."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()

    @torch.no_grad()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), V] float64: row i scores the token after ``tokens[:i + 1]``."""
        return self.model(torch.tensor([tokens])).logits[0]


def repetitive_prompt(reference: FloatReference, length: int = 48) -> list[int]:
    """BOS and the model's greedy continuation, cut in the middle of its longest run of one
    repeated token (the continuation stays in the run for a while): a prompt on which lookup
    and self-drafting proposers draft and get drafts accepted."""
    tokens = [1]
    for _ in range(length):
        tokens.append(int(reference.logits(tokens)[-1].argmax()))
    runs, start = [], 1
    for i in range(2, len(tokens) + 1):
        if i == len(tokens) or tokens[i] != tokens[i - 1]:
            runs.append((i - start, start))
            start = i
    size, first = max(runs)
    return tokens[:first + max(size // 2, 1)] if size > 2 else tokens[:17]


def prompt_step(params: list[SamplingParams], seeds: list[int]) -> tuple[SchedulerOutput, BatchMetadata]:
    """A step in which each sequence prefills a 3-token prompt and samples its first token
    from its own seeded generator: one logits row each, in order (no drafts: no output yet)."""
    seqs = []
    for i, (p, seed) in enumerate(zip(params, seeds)):
        seq = Sequence(f"conformance-{i}", [1, 2, 3], p)
        seq.generator = torch.Generator().manual_seed(seed)
        seqs.append(seq)
    n = len(seqs)
    rows = torch.arange(n)
    batch = BatchMetadata(
        input_ids=torch.tensor([1, 2, 3] * n), positions=torch.arange(3).repeat(n),
        query_start_loc=torch.arange(0, 3 * n + 1, 3, dtype=torch.int32),
        seq_lens=torch.full((n,), 3, dtype=torch.int32), slot_mapping=torch.arange(3 * n),
        block_tables=torch.zeros((n, 0), dtype=torch.int32), logits_indices=rows * 3 + 2,
        query_lens_cpu=[3] * n, seq_lens_cpu=[3] * n, block_tables_cpu=[[] for _ in seqs], block_size=16,
        seqs=seqs, samples=[SampleSlot(seq, i, 1) for i, seq in enumerate(seqs)])
    return SchedulerOutput(scheduled=[ScheduledSeq(seq, 3) for seq in seqs]), batch


def run_prompt_step(decoder: Any, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]) -> list[int]:
    """The engine's protocol for one prompt step: propose (nothing, by contract), decode,
    finish each sequence. Returns the one token decoded per row."""
    out, batch = prompt_step(params, seeds)
    drafts = decoder.propose(out)
    assert not any(drafts.values()), f"drafts {drafts} proposed for sequences with no output yet"
    tokens = decoder.decode(logits, batch)
    for seq in batch.seqs:
        decoder.finish(seq)
    assert len(tokens) == len(params) and all(len(t) == 1 for t in tokens), \
        f"decode returned {[len(t) for t in tokens]} tokens per slot for {len(params)} undrafted slots (one each)"
    return [t[0] for t in tokens]


def exact_paths(reference: FloatReference, prompt: list[int], decoder: Any, params: SamplingParams,
                length: int) -> dict[tuple[int, ...], float]:
    """P(continuation) of every ``length``-token continuation of ``prompt`` the decoder's
    target (``target_probs``) allows for ``params``, from teacher-forced float64 logits."""
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        grown = {}
        for path, prob in out.items():
            logits = reference.logits(prompt + list(path))[-1]
            if params.top_k > 0:
                ranked = (logits / params.temperature).sort(descending=True).values
                assert float(ranked[params.top_k - 1] - ranked[params.top_k]) > 1e-3, \
                    "the suite's prompt gives a near tie at top_k"
            p = target_probs(decoder, logits, params)
            for t in torch.nonzero(p).flatten().tolist():
                grown[path + (t,)] = prob * float(p[t])
        out = grown
    return out


class DecodingConformance(ConformanceSuite):
    """The contract every decoding plugin honours, checked on the plugin named by ``plugin``
    (or ``plugin_class``) with ``options``:

    - greedy requests (temperature 0) get the argmax of their logits row, at decoder level
      on random logits and at every step of engine runs (against float64 logits of the
      model): a speculative decoder's greedy output is plain greedy decoding, token for token;
    - sampled requests follow the filtered target distribution (temperature, top_k, top_p,
      min_p where ``SamplingParams`` has it): chi-square at level ``ALPHA`` with the power
      stated at ``DRAWS`` and ``PATH_REQUESTS``, per setting at decoder level and over whole
      3-token continuations at engine level (drafted, verified and rolled back inside);
    - a request with a ``seed`` repeats its tokens exactly;
    - no drafts for a sequence with no output yet.

    The target is the decoder's own ``target_probs(logits, params)`` when it returns a
    distribution (a sampler with a rule of its own: top-a, typical-p), else the standard rule
    (``tessellm.testing.reference_probs``). ``sampling_cases`` holds the decoder-level cases
    (``SAMPLING_CASES`` by default): a subclass adds its plugin's own settings as
    ``SamplingCase``s whose params carry ``extra_args``, e.g.
    ``sampling_cases = (*SAMPLING_CASES, SamplingCase("top_a=0.3", {"temperature": 1.0,
    "extra_args": {"top_a": 0.3}}, ("top_a",)))``.

    The suite applies the engine's admission rules (``Engine.admit``) to every request it
    makes: a setting the engine refuses for this decoder (a field newer than the decoder's
    plugin API, such as ``min_p`` for a 1.0 decoder; its ``check``; ``extra_args`` its
    ``RequestArgs`` do not take) skips its case with the engine's own message, never fails
    it; a pipeline the plugin declares unsupported skips with its ``unsupported_reasons``.
    ``engine`` holds the config pieces of the pipeline besides the model and the decoder
    (device, dtype, cache, ...); a subclass whose options need a path (a draft model)
    overrides the ``decoding_options`` fixture.
    """

    kind = "decoding"
    engine: ClassVar[dict[str, Any]] = {"device": "cpu", "dtype": "float32"}
    sampling_cases: ClassVar[tuple[SamplingCase, ...]] = tuple(SAMPLING_CASES)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "sampling_case" in metafunc.fixturenames:
            cases = list(self.sampling_cases)
            metafunc.parametrize("sampling_case", cases, ids=[c.name for c in cases])

    # ------------------------------------------------------------------ fixtures

    @pytest.fixture(scope="class")
    @classmethod
    def decoding_options(cls, tessellm_tiny_model: Path) -> dict[str, Any]:
        """The options the pipeline is built with (``options``, unless a subclass adds paths)."""
        return dict(cls.options)

    @pytest.fixture(scope="class")
    @classmethod
    def decoding_llm(cls, tessellm_tiny_model: Path, decoding_options: dict[str, Any]) -> Any:
        """A pipeline on the tiny model whose decoder is the plugin under test (built once)."""
        cls.require(selection_context(cls, tessellm_tiny_model, cls.engine), "this pipeline")
        part = {"name": cls.under_test().name, "options": decoding_options}
        return build_llm(cls, tessellm_tiny_model, cls.engine, part)

    @pytest.fixture(scope="class")
    @classmethod
    def float_reference(cls, tessellm_tiny_model: Path) -> FloatReference:
        return FloatReference(tessellm_tiny_model)

    @pytest.fixture(scope="class")
    @classmethod
    def prompt(cls, float_reference: FloatReference) -> list[int]:
        return repetitive_prompt(float_reference)

    # ------------------------------------------------------------------ helpers

    def accepted(self, llm: Any, params: SamplingParams) -> None:
        """Skip the running case, with the engine's own reason, where ``llm``'s engine refuses
        ``params`` at admission: a field newer than the decoder's plugin API (``min_p`` for a
        1.0 decoder), the decoder's ``check``, ``extra_args`` its ``RequestArgs`` do not take."""
        skip_unless_admitted(type(self), llm, params)

    def tolerance(self, llm: Any) -> float:
        return ARGMAX_TOLERANCE.get(llm.pipeline.resolved.dtype, HALF_TOLERANCE)

    # ------------------------------------------------------------------ decoder level

    @given(rows=st.integers(1, 8), seed=st.integers(0, 2**31 - 1), top_k=st.integers(0, 8),
           top_p=st.floats(0.05, 1.0))
    @property_settings(max_examples=20)
    def test_greedy_rows_take_the_argmax(self, decoding_llm: Any, rows: int, seed: int, top_k: int,
                                         top_p: float) -> None:
        """Temperature 0, whatever top_k / top_p say: each row's token is its argmax."""
        self.case()
        decoder = decoding_llm.pipeline.decoder
        params = SamplingParams(temperature=0.0, top_k=top_k, top_p=top_p)
        self.accepted(decoding_llm, params)
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(rows, decoding_llm.pipeline.spec.vocab_size, generator=g) * 3
        tokens = run_prompt_step(decoder, logits, [params] * rows, list(range(rows)))
        assert tokens == logits.argmax(dim=-1).tolist(), "a greedy row did not get its argmax"

    def test_sampling_follows_the_target_distribution(self, decoding_llm: Any, sampling_case: SamplingCase) -> None:
        """``DRAWS`` first tokens, each from its own seeded generator, against the target
        (chi-square at ``ALPHA``; a draw the target gives probability 0 fails). One test per
        case of ``sampling_cases``."""
        self.case()
        case = sampling_case
        missing = [k for k in case.params if k not in SamplingParams.model_fields]
        if missing:
            pytest.skip(f"SamplingParams has no {', '.join(missing)}")
        params = SamplingParams(**case.params)
        decoder = decoding_llm.pipeline.decoder
        self.accepted(decoding_llm, params)
        logits = head_logits(decoding_llm.pipeline.spec.vocab_size)
        target = target_probs(decoder, logits, params)
        _assert_power(decoder, logits, case, target)
        tokens = run_prompt_step(decoder, logits.float()[None].expand(DRAWS, -1), [params] * DRAWS,
                                 [1_000 + i for i in range(DRAWS)])
        counts = torch.bincount(torch.tensor(tokens), minlength=logits.numel())
        if int((target > 0).sum()) == 1:
            assert counts[target > 0].sum() == DRAWS, f"{case.name}: drew tokens other than the only one allowed"
            return
        result = chi_square(counts, target)
        assert result.p_value > ALPHA, (f"{case.name}: sampled tokens do not follow the target distribution "
                                        f"({result}; outside its support: {int(counts[target == 0].sum())} draws)")

    # ------------------------------------------------------------------ engine level

    @given(data=st.data())
    @property_settings(max_examples=8)
    def test_greedy_output_is_the_argmax_at_every_step(self, decoding_llm: Any, float_reference: FloatReference,
                                                        prompt: list[int], data: Any) -> None:
        """Batches of 1 to 4 greedy requests through the engine (prefixes of the repetitive
        prompt, or tokens of its alphabet): every output token is the argmax of the float64
        logits after the tokens before it (plain greedy decoding), drafts or not."""
        self.case()
        capacity = require_capacity(type(self), decoding_llm, 2, "a one-token prompt and one new token")
        alphabet = sorted(set(prompt))
        prompts = st.one_of(st.integers(1, min(len(prompt), capacity - 1)).map(lambda n: prompt[:n]),
                            st.lists(st.sampled_from(alphabet), min_size=1, max_size=min(24, capacity - 1)))
        request = prompts.flatmap(lambda p: st.tuples(st.just(p), st.integers(1, min(12, capacity - len(p)))))
        requests = data.draw(st.lists(request, min_size=1, max_size=4))
        params = [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in requests]
        self.accepted(decoding_llm, params[0])
        outs = decoding_llm.generate([p for p, _ in requests], params)
        for (p, m), out in zip(requests, outs):
            tokens = out.outputs[0].token_ids
            assert len(tokens) == m, f"{len(tokens)} tokens for max_tokens={m}"
            _assert_argmax_path(float_reference, p, tokens, self.tolerance(decoding_llm))

    def test_sampled_continuations_follow_the_target_distribution(self, decoding_llm: Any,
                                                                  float_reference: FloatReference,
                                                                  prompt: list[int]) -> None:
        """2,048 seeded 3-token continuations of the repetitive prompt (top_k 3, temperature
        1.3) against their exact probabilities (chi-square at ``ALPHA``); a decoder that
        drafts must have drafted here (else the check says nothing about verification)."""
        self.case()
        require_capacity(type(self), decoding_llm, len(prompt) + PATH_LENGTH, "the suite's continuations")
        decoder = decoding_llm.pipeline.decoder
        params = [SamplingParams(max_tokens=PATH_LENGTH, temperature=PATH_TEMPERATURE, top_k=PATH_TOP_K,
                                 n=PATH_SAMPLES, seed=s, ignore_eos=True) for s in range(PATH_REQUESTS)]
        self.accepted(decoding_llm, params[0])
        stats = decoding_llm.engine.stats
        drafted = stats.draft_tokens
        outs = decoding_llm.generate([prompt] * PATH_REQUESTS, params)
        paths = [tuple(o.token_ids) for out in outs for o in out.outputs]
        exact = exact_paths(float_reference, prompt, decoder, params[0], PATH_LENGTH)
        index = {path: i for i, path in enumerate(exact)}
        outside = [p for p in paths if p not in index]
        assert not outside, f"{len(outside)} continuations the target gives probability 0, e.g. {outside[0]}"
        counts = torch.bincount(torch.tensor([index[p] for p in paths]), minlength=len(index))
        result = chi_square(counts, torch.tensor(list(exact.values()), dtype=torch.float64))
        assert result.p_value > ALPHA, f"sampled continuations do not follow the target distribution ({result})"
        if decoder.num_lookahead_tokens > 0:
            assert stats.draft_tokens > drafted, "the decoder drafted nothing: verification went unchecked"

    def test_seeded_requests_repeat(self, decoding_llm: Any, prompt: list[int]) -> None:
        """The same seeded requests (n = 2) run twice give the same tokens."""
        self.case()
        require_capacity(type(self), decoding_llm, len(prompt) + 10, "the suite's seeded requests")
        params = [SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=7 + i, n=2, ignore_eos=True)
                  for i in range(4)]
        self.accepted(decoding_llm, params[0])
        prompts = [prompt, prompt[:5], [5, 6, 7], prompt[::-1]]
        first = [[o.token_ids for o in out.outputs] for out in decoding_llm.generate(prompts, params)]
        second = [[o.token_ids for o in out.outputs] for out in decoding_llm.generate(prompts, params)]
        assert first == second, "seeded requests gave different tokens on a second run"


def _assert_argmax_path(reference: FloatReference, prompt: list[int], tokens: list[int], tolerance: float) -> None:
    """Each of ``tokens`` is the reference's argmax after the tokens before it (within
    ``tolerance`` of the maximum logit: near ties may go either way in a lower precision)."""
    logits = reference.logits(prompt + tokens)[len(prompt) - 1:-1]
    for i, token in enumerate(tokens):
        best = float(logits[i].max())
        assert float(logits[i, token]) >= best - tolerance, (
            f"greedy token {i} is {token} (logit {float(logits[i, token]):.6f}), not the argmax "
            f"{int(logits[i].argmax())} (logit {best:.6f}); prompt {prompt}, output {tokens}")


def _assert_power(decoder: Any, logits: torch.Tensor, case: SamplingCase, target: torch.Tensor) -> None:
    """The case can tell its target from the distribution a decoder ignoring each of
    ``case.ignored`` would draw from (the same decoder's target without that setting: a
    field at its neutral value, an ``extra_args`` key left out): mass >= 0.01 outside the
    target's support, or a chi-square distance >= ``PHI2_MIN`` (see ``DRAWS``). Guards the
    case table itself, the author's cases included."""
    neutral = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    for setting in case.ignored:
        params = dict(case.params)
        extra = dict(params.get("extra_args") or {})
        if setting in extra:
            del extra[setting]
            params["extra_args"] = extra
        elif setting in neutral:
            params[setting] = neutral[setting]
        else:
            raise AssertionError(f"suite design: case {case.name} names {setting!r} as ignored, which is neither "
                                 f"a sampling setting ({', '.join(neutral)}) nor one of its extra_args")
        wrong = target_probs(decoder, logits, SamplingParams(**params))
        leak = float(wrong[target == 0].sum())
        support = target > 0
        phi2 = float(((wrong[support] - target[support]) ** 2 / target[support]).sum())
        assert leak >= 0.01 or phi2 >= PHI2_MIN, (f"suite design: case {case.name} cannot detect a decoder "
                                                  f"ignoring {setting} (leak {leak:.4f}, distance {phi2:.4f})")
