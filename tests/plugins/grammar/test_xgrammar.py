"""The xgrammar backend beyond the conformance suite and the tests every backend shares
(test_backends.py): its options, and the workarounds it carries for
xgrammar (length-bounded strings, recursive root rules)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

pytest.importorskip("xgrammar")

from tessellm.core.interfaces.grammar import GrammarSpec  # noqa: E402
from tessellm.plugins.grammar.xgrammar_backend import XGrammarBackend, bounded_strings_as_patterns  # noqa: E402

EOS = 2


@pytest.fixture(scope="module")
def backend_class():
    return XGrammarBackend


def test_options_are_validated():
    with pytest.raises(ValidationError):
        XGrammarBackend.Options(max_threads=0)
    with pytest.raises(ValidationError):
        XGrammarBackend.Options(cache_bytes=1)


def test_recursive_root_rule_allows_tokens_that_close_two_levels(backend, tokenizer, allowed):
    matcher = backend.matcher(backend.compile(GrammarSpec("ebnf", 'root ::= "(" root* ")"')))
    assert matcher.accept(tokenizer.convert_tokens_to_ids("(("))
    closing = tokenizer.convert_tokens_to_ids("))")
    assert allowed(backend, matcher)[closing]
    assert matcher.accept(closing) and allowed(backend, matcher)[EOS]


def test_bounded_strings_refuse_control_characters(backend, takes):
    spec = GrammarSpec.schema({"type": "object", "properties": {"s": {"type": "string", "minLength": 1,
                                                                     "maxLength": 4}}, "required": ["s"]})
    assert takes(backend, spec, '{"s": "é✓ab"}') and takes(backend, spec, '{"s": "x"}')
    for text in ['{"s": ""}', '{"s": "abcde"}', '{"s": "a\tb"}', '{"s": "\x01"}']:
        assert not takes(backend, spec, text), text


def test_bounded_strings_as_patterns():
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 3},
        "b": {"type": "array", "items": {"anyOf": [{"type": "string", "minLength": 2}, {"type": "integer"}]}},
        "c": {"type": "string", "pattern": "^x+$", "maxLength": 3},
        "d": {"type": "string", "enum": ["xy"], "maxLength": 3},
    }}
    out = bounded_strings_as_patterns(schema)
    assert out["properties"]["a"] == {"type": "string", "pattern": r"^[\s\S]{0,3}$"}
    assert out["properties"]["b"]["items"]["anyOf"][0] == {"type": "string", "pattern": r"^[\s\S]{2,}$"}
    assert out["properties"]["c"] == schema["properties"]["c"] and out["properties"]["d"] == schema["properties"]["d"]
