"""The llguidance backend beyond the conformance suite and the tests every backend shares
(test_backends.py): its options, strict schemas, its regex and GBNF
dialects, masks that allow every spelling of forced text, the stop token kept by the
wrapper, the mask buffers it checks, and the engine running on it."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

pytest.importorskip("llguidance")

from tessellm.core.version import PLUGIN_API_VERSION  # noqa: E402
from tessellm.core.interfaces.grammar import GrammarSpec  # noqa: E402
from tessellm.plugins.grammar.llguidance_backend import (  # noqa: E402
    LLGuidanceBackend, gbnf_code_points, strict_schema)

EOS = 2


@pytest.fixture(scope="module")
def backend_class():
    return LLGuidanceBackend


def ids(tokenizer, *pieces: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(p) for p in pieces]


# ---------------------------------------------------------------------- options


def test_options_are_validated():
    with pytest.raises(ValidationError):
        LLGuidanceBackend.Options(cache_entries=0)
    with pytest.raises(ValidationError):
        LLGuidanceBackend.Options(max_threads=4)  # an xgrammar option


def test_takes_part_only_when_named():
    assert LLGuidanceBackend.auto_priority is None and LLGuidanceBackend.api_version == PLUGIN_API_VERSION


# ---------------------------------------------------------------------- kinds


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}


def test_strict_closes_nested_objects_and_tuples(backend, takes):
    schema = {"type": "object", "properties": {
        "o": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "t": {"type": "array", "prefixItems": [{"type": "integer"}]},
        "m": {"type": "object", "additionalProperties": {"type": "integer"}},  # a map stays a map
    }, "required": ["o", "t", "m"]}
    strict, lax = GrammarSpec.schema(schema), GrammarSpec.schema(schema, strict=False)
    good = '{"o": {"x": 1}, "t": [1], "m": {"k": 2}}'
    assert takes(backend, strict, good) and takes(backend, lax, good)
    for text in ['{"o": {"x": 1, "y": 2}, "t": [1], "m": {}}', '{"o": {}, "t": [1, 2], "m": {}}']:
        assert not takes(backend, strict, text) and takes(backend, lax, text), text


def test_strict_schema_leaves_intersected_schemas_open():
    part = {"type": "object", "properties": {"a": {"type": "integer"}}}
    schema = {"allOf": [part, {"properties": {"b": {"type": "object"}}}],
              "anyOf": [part], "$defs": {"p": part}, "properties": {"c": {"enum": [{"k": 1}]}}}
    out = strict_schema(schema)
    assert "additionalProperties" not in out  # it intersects with its allOf and anyOf
    assert "additionalProperties" not in out["allOf"][0] and "additionalProperties" not in out["anyOf"][0]
    assert out["allOf"][1]["properties"]["b"]["additionalProperties"] is False  # nested: stands alone
    assert out["$defs"]["p"]["additionalProperties"] is False
    assert out["properties"]["c"] == {"enum": [{"k": 1}]}  # values are data, not schemas
    assert strict_schema({"anyOf": [part]})["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in part  # the input is not changed


def test_regex_digits_are_ascii(backend, takes):
    spec = GrammarSpec("regex", r"\d+")
    assert takes(backend, spec, "042") and not takes(backend, spec, "٤")


def test_gbnf_grammar_with_character_classes_and_repetition(backend, takes):
    spec = GrammarSpec("ebnf", 'root ::= word ("," word){0,2}\nword ::= [a-c]+ | "(" root ")"')
    for text in ["a", "ab,c", "(a,b),cab"]:
        assert takes(backend, spec, text), text
    for text in ["", "a,", "a,b,c,a", "d", "(a"]:
        assert not takes(backend, spec, text), text


def test_gbnf_unicode_escapes(backend, takes):
    spec = GrammarSpec("ebnf", r'root ::= "\u00e9" | [\u0061-\u0063] | "\U0001F600" | "\\u0041" | "\u005c"')
    for text in ["é", "a", "c", "😀", "\\u0041", "\\"]:
        assert takes(backend, spec, text), text
    for text in ["A", "d", "u0041"]:
        assert not takes(backend, spec, text), text
    assert gbnf_code_points(r'x ::= "\u0041\\u0041" [\u00e9-\U0001F600] "\ud800\n"') == (
        r'x ::= "\x41\\u0041" [é-😀] "\ud800\n"')


def test_gbnf_rules_of_terminals_are_greedy_lexemes(backend, takes):
    """llguidance's dialect, not GBNF's: a rule made of terminals only becomes one lexeme,
    matched as long as it can go, so ``word`` takes the ``x`` the root rule expects after it."""
    assert takes(backend, GrammarSpec("ebnf", 'root ::= [a-z]+ "x"'), "abx")
    assert not takes(backend, GrammarSpec("ebnf", 'root ::= word "x"\nword ::= [a-z]+'), "abx")


# ---------------------------------------------------------------------- masks and matchers


def test_forced_text_may_be_spelled_any_way(backend, tokenizer, allowed):
    """The schema forces ``{"a": `` at the start: the mask allows every token that spells a
    piece of it (``{`` as well as the canonical ``{"``), and ``accept`` takes exactly those."""
    matcher = backend.matcher(backend.compile(GrammarSpec.schema(SCHEMA)), max_rollback=1)
    ok = allowed(backend, matcher).nonzero().flatten().tolist()
    assert ok == ids(tokenizer, "{", '{"')
    assert ok == [t for t in range(backend.vocab_size) if _takes_one(matcher, t)]


def _takes_one(matcher, token: int) -> bool:
    took = matcher.accept(token)
    if took:
        matcher.rollback(1)
    return took


def test_mask_buffers_are_checked(backend):
    matcher = backend.matcher(backend.compile(GrammarSpec("regex", "a")))
    with pytest.raises(ValueError):
        matcher.fill_mask(backend.new_mask(2)[:, :-1], 0)  # a row one word short
    with pytest.raises(ValueError, match="int32"):
        matcher.fill_mask(backend.new_mask(1).to(torch.int64), 0)


def test_a_refused_token_leaves_the_matcher_usable(backend, tokenizer):
    matcher = backend.matcher(backend.compile(GrammarSpec("regex", "ab")))
    assert not matcher.accept(tokenizer.convert_tokens_to_ids("x"))  # llguidance's consume would break it
    assert matcher.accept(tokenizer.convert_tokens_to_ids("ab")) and matcher.accept(EOS)


# ---------------------------------------------------------------------- through the engine


@pytest.mark.parametrize("decoding", [{"name": "sample"}, {"name": "speculative", "options": {
    "proposer": "ngram", "k": 4, "adaptive_k": False}}], ids=["sample", "speculative"])
def test_outputs_fit_through_the_engine(cpu_config, tiny_model, decoding):
    """The tiny model (SmolLM2's tokenizer) sampling under each kind, speculative drafts
    verified against the masks and rolled back: every output fits and ends with EOS."""
    import json
    import re

    from tessellm import LLM

    llm = LLM(cpu_config(tiny_model("llama"), max_model_len=256, decoding=decoding, grammar={"name": "llguidance"},
                         scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 24}},
                         cache={"name": "paged", "options": {"block_size": 8, "num_blocks": 256}}))
    assert type(llm.engine.grammar.backend) is LLGuidanceBackend
    prompt = 'yes no {"answer": "yes", "sure": true} {"answer": "no", "sure": false} ' * 3
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
              "required": ["answer", "sure"]}
    cases = [(GrammarSpec.schema(schema), lambda t: json.loads(t)["answer"] in ("yes", "no")),
             (GrammarSpec("regex", r"[a-z]{2,6}@example\.(com|org)"), lambda t: "@example." in t),
             (GrammarSpec.choice(["red", "light blue"]), lambda t: t in ("red", "light blue")),
             (GrammarSpec("ebnf", 'root ::= "(" [0-9] [0-9]? ")" | "none"'),
              lambda t: re.fullmatch(r"\(\d\d?\)|none", t))]
    for spec, fits in cases:
        outs = llm.generate([prompt, "a"], {"max_tokens": 40, "temperature": 1.0, "seed": 7, "n": 2,
                                            "structured_output": spec})
        samples = [s for o in outs for s in o.outputs]
        assert all(s.finish_reason == "stop" and fits(s.text) for s in samples), [s.text for s in samples]
    assert decoding["name"] != "speculative" or llm.engine.stats.draft_tokens > 0
    assert not llm.engine.grammar.matchers and not llm.engine.processors.bound
