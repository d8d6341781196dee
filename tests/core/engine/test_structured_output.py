"""Structured outputs through the engine: the grammar's mask holds for greedy, sampled and
speculative decoding (drafts the grammar refuses are rejected, the matcher rolled back),
for n > 1 and under chunked prefill; greedy speculative output equals greedy output under
the same grammar; log-probabilities stay the model's own; bad grammars and impossible
combinations are refused at admission. The tiny random model uses SmolLM2's tokenizer."""

from __future__ import annotations

import json
import re

import pytest

from tessellm import LLM
from tessellm.core.engine.grammar import GrammarSession
from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.grammar import GrammarSpec
from tessellm.core.interfaces.sequence import SamplingParams

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"},
                                           "level": {"enum": [1, 2, 3]}},
          "required": ["answer", "sure", "level"], "additionalProperties": False}
EMAIL = r"[a-z]{2,6}@example\.(com|org)"
CHOICES = ["red", "green", "light blue"]
# a repetitive prompt: n-gram lookup proposes drafts that are often outside the grammar
PROMPT = "yes no yes no {\"answer\": \"yes\", \"sure\": true} {\"answer\": \"no\", \"sure\": false} " * 3


def pipeline(cpu_config, tiny_model, **decoding) -> LLM:
    return LLM(cpu_config(tiny_model("llama"), max_model_len=256, decoding=decoding or {"name": "sample"},
                          scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 24}},
                          cache={"name": "paged", "options": {"block_size": 8, "num_blocks": 256}},
                          grammar={"name": "xgrammar"}))


@pytest.fixture(scope="module")
def sampler(cpu_config, tiny_model):
    return pipeline(cpu_config, tiny_model)


@pytest.fixture(scope="module")
def speculative(cpu_config, tiny_model):
    return pipeline(cpu_config, tiny_model, name="speculative", options={"proposer": "ngram", "k": 4,
                                                                           "adaptive_k": False})


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"answer", "sure", "level"} and value["answer"] in ("yes", "no", "maybe")
    assert isinstance(value["sure"], bool) and value["level"] in (1, 2, 3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_fit(sampler, temperature):
    params = {"max_tokens": 48, "temperature": temperature, "seed": 3, "n": 3,
              "structured_output": GrammarSpec.schema(SCHEMA)}
    for out in sampler.generate([PROMPT, "Hello", "Give me JSON:"], params):
        for sample in out.outputs:
            assert sample.finish_reason == "stop", sample
            check_schema(sample.text)


@pytest.mark.parametrize("spec, fits", [
    (GrammarSpec("regex", EMAIL), lambda t: re.fullmatch(EMAIL, t)),
    (GrammarSpec.choice(CHOICES), lambda t: t in CHOICES),
    (GrammarSpec("ebnf", 'root ::= "(" [0-9] [0-9]? ")" | "none"'), lambda t: re.fullmatch(r"\(\d\d?\)|none", t)),
])
def test_regex_choice_and_ebnf_outputs_fit(sampler, spec, fits):
    outs = sampler.generate(["a", PROMPT], {"max_tokens": 24, "temperature": 1.0, "seed": 5, "n": 2,
                                            "structured_output": spec})
    samples = [s for o in outs for s in o.outputs]
    assert all(fits(s.text) and s.finish_reason == "stop" for s in samples), [s.text for s in samples]
    assert not sampler.engine.grammar.matchers and not sampler.engine.processors.bound


def test_greedy_speculative_equals_greedy_under_the_grammar(sampler, speculative):
    params = {"max_tokens": 48, "temperature": 0.0, "structured_output": GrammarSpec.schema(SCHEMA)}
    before = speculative.engine.stats.draft_tokens
    plain = [o.text for o in sampler.generate([PROMPT, PROMPT + " again"], params)]
    drafted = [o.text for o in speculative.generate([PROMPT, PROMPT + " again"], params)]
    assert drafted == plain
    stats = speculative.engine.stats
    assert stats.draft_tokens > before  # drafts were proposed, and some refused by the grammar's mask
    for text in drafted:
        check_schema(text)


def test_sampled_speculative_outputs_fit(speculative):
    outs = speculative.generate([PROMPT] * 3, {"max_tokens": 48, "temperature": 1.0, "seed": 11,
                                               "structured_output": GrammarSpec.schema(SCHEMA)})
    for out in outs:
        check_schema(out.text)


def test_logprobs_stay_the_models_own(sampler):
    """The grammar changes which token is picked, not the log-probabilities reported."""
    (out,) = sampler.generate(["Hello"], {"max_tokens": 3, "logprobs": 1, "structured_output":
                                          GrammarSpec.choice(["zebra crossing"])})
    ids = sampler.encode("Hello") + out.token_ids
    ref = sampler.engine.score(ids).log_softmax(-1)
    start = len(ids) - len(out.token_ids)
    for i, lp in enumerate(out.outputs[0].logprobs):
        assert lp.logprob == pytest.approx(ref[start - 1 + i, out.token_ids[i]].item(), abs=1e-4)


def test_bad_grammar_is_refused_at_admission_and_nothing_leaks(sampler):
    free = sampler.engine.cache.num_free_blocks
    with pytest.raises(InvalidRequestError, match="regex"):
        sampler.generate(["a"], {"structured_output": GrammarSpec("regex", "(unclosed")})
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        sampler.generate(["a"], {"min_tokens": 2, "structured_output": GrammarSpec.choice(["x"])})
    assert sampler.engine.cache.num_free_blocks == free and not sampler.engine.requests
    assert not sampler.engine.processors.bound and not sampler.engine.grammar.matchers


def test_no_grammar_backend_names_what_to_install():
    with pytest.raises(InvalidRequestError, match="pip install xgrammar"):
        GrammarSession(None, 0).check(SamplingParams(structured_output=GrammarSpec("json_object")))
