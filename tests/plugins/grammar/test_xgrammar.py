"""The xgrammar backend beyond the conformance suite: its error messages, its options (JSON
whitespace, the cache bound), the workarounds it carries for xgrammar (length-bounded
strings, recursive root rules, special tokens), float64 logits and padded vocabularies."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

pytest.importorskip("xgrammar")

from tessellm.core.errors import InvalidRequestError  # noqa: E402
from tessellm.core.interfaces.grammar import GrammarSpec  # noqa: E402
from tessellm.plugins.grammar import xgrammar_backend  # noqa: E402
from tessellm.plugins.grammar.xgrammar_backend import XGrammarBackend, bounded_strings_as_patterns  # noqa: E402
from tessellm.testing.conformance.grammar import PADDING, byte_level_tokenizer  # noqa: E402

EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def make(tokenizer, padding: int = PADDING, **options) -> XGrammarBackend:
    return XGrammarBackend(XGrammarBackend.Options(**options), tokenizer, len(tokenizer) + padding)


@pytest.fixture(scope="module")
def backend(tokenizer) -> XGrammarBackend:
    return make(tokenizer)


def allowed(backend: XGrammarBackend, matcher) -> torch.Tensor:
    """[V] bool: the tokens the matcher's mask leaves finite."""
    mask = backend.new_mask(1)
    matcher.fill_mask(mask, 0)
    logits = torch.zeros(1, backend.vocab_size)
    backend.apply_mask(logits, mask, [0])
    return torch.isfinite(logits[0])


def takes(backend: XGrammarBackend, spec: GrammarSpec, text: str) -> bool:
    """Whether the masks let ``text`` through token by token, then the stop token."""
    matcher = backend.matcher(backend.compile(spec))
    for token in backend.tokenizer.encode(text, add_special_tokens=False) + [EOS]:
        if not allowed(backend, matcher)[token]:
            return False
        assert matcher.accept(token)
    return matcher.is_terminated()


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec("regex", "a(b"), ["cannot compile the regex grammar", "parenthesis"]),
    (GrammarSpec("regex", r"\bword"), ["regex", "Word boundary"]),
    (GrammarSpec("json_schema", '{"type": '), ["json_schema", "not JSON"]),
    (GrammarSpec("json_schema", "[1, 2]"), ["json_schema", "expected a JSON object", "list"]),
    (GrammarSpec("json_schema", '{"type": "frob"}'), ["json_schema", "frob"]),
    (GrammarSpec("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}'),
     ["json_schema", "minLength 5 is greater than maxLength 2"]),
    (GrammarSpec("choice", "[]"), ["choice", "non-empty JSON list of strings"]),
    (GrammarSpec("choice", '["a", 1]'), ["choice", "non-empty JSON list of strings"]),
    (GrammarSpec("ebnf", 'rot ::= "a"'), ["ebnf", "no rule named root"]),
    (GrammarSpec("ebnf", "root ::= foo"), ["ebnf", 'Rule "foo" is not defined']),
    (GrammarSpec("toml", "x"), ["'toml' is not supported", "choice, ebnf, json_object, json_schema, regex"]),
])
def test_errors_are_one_line_naming_the_kind(backend, spec, words):
    with pytest.raises(InvalidRequestError) as info:
        backend.compile(spec)
    message = str(info.value)
    assert all(w in message for w in words), message
    assert "\n" not in message and ".cc:" not in message and "Check failed" not in message, message


def test_missing_xgrammar_is_one_clear_line(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    with pytest.raises(ImportError, match=r"^grammar plugin 'xgrammar' needs the xgrammar package: "
                                          r"pip install xgrammar$"):
        make(tokenizer)
    monkeypatch.setattr(xgrammar_backend.importlib.util, "find_spec", lambda name: None)
    ctx = SimpleNamespace(device=torch.device("cpu"))
    assert XGrammarBackend.unsupported_reasons(ctx) == [xgrammar_backend.INSTALL_HINT]


def test_options_are_validated():
    with pytest.raises(ValidationError):
        XGrammarBackend.Options(max_threads=0)
    with pytest.raises(ValidationError):
        XGrammarBackend.Options(cache_bytes=1)


# ---------------------------------------------------------------------- kinds


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}


def test_json_schema_strict_refuses_undeclared_properties(backend):
    strict, lax = GrammarSpec.schema(SCHEMA), GrammarSpec.schema(SCHEMA, strict=False)
    for text in ['{"a": 1}', '{"a": 1, "b": "x"}']:
        assert takes(backend, strict, text) and takes(backend, lax, text)
    extra = '{"a": 1, "c": [true]}'
    assert not takes(backend, strict, extra)
    assert takes(backend, lax, extra)
    assert not takes(backend, lax, '{"b": "x"}')  # required still holds


def test_any_whitespace_option(tokenizer, backend):
    loose = make(tokenizer, any_whitespace=True)
    spec = GrammarSpec.schema(SCHEMA)
    assert takes(backend, spec, '{"a": 1, "b": "x"}')  # the default: one line, as json.dumps writes
    for text in ['{"a":1}', '{ "a": 1 }', '{"a": 1,\n "b": "x"}']:
        assert takes(loose, spec, text) and not takes(backend, spec, text), text


def test_json_object_is_an_object_only(backend):
    spec = GrammarSpec("json_object")
    assert takes(backend, spec, '{"k": [1, "x", {"n": null}]}')
    for text in ["[1]", '"x"', "3", "null"]:
        assert not takes(backend, spec, text), text  # xgrammar's built-in JSON grammar takes arrays


def test_choice_takes_exactly_its_options(backend):
    options = ["no", "not now", 'say "hi"', "back\\slash", "new\nline", "é✓😀", "a|b*", ""]
    spec = GrammarSpec.choice(options)
    for text in options:
        assert takes(backend, spec, text), text
    for text in ["n", "no ", "not", "say hi", "a", "ab"]:
        assert not takes(backend, spec, text), text
    matcher = backend.matcher(backend.compile(spec))
    assert allowed(backend, matcher)[EOS]  # "" is an option: the stop token is allowed at once


def test_recursive_root_rule_allows_tokens_that_close_two_levels(backend, tokenizer):
    matcher = backend.matcher(backend.compile(GrammarSpec("ebnf", 'root ::= "(" root* ")"')))
    assert matcher.accept(tokenizer.convert_tokens_to_ids("(("))
    closing = tokenizer.convert_tokens_to_ids("))")
    assert allowed(backend, matcher)[closing]
    assert matcher.accept(closing) and allowed(backend, matcher)[EOS]


def test_bounded_strings_refuse_control_characters(backend):
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


# ---------------------------------------------------------------------- masks and matchers


def test_special_tokens_are_never_allowed(backend, tokenizer):
    # inside a JSON string xgrammar alone allows "<s>" and "<pad>": it reads them as text
    matcher = backend.matcher(backend.compile(GrammarSpec("json_object")), max_rollback=1)
    assert matcher.accept(tokenizer.convert_tokens_to_ids('{"'))
    ok = allowed(backend, matcher)
    assert ok[tokenizer.convert_tokens_to_ids("a")] and not ok[0] and not ok[1] and not ok[EOS]
    assert not matcher.accept(1) and not matcher.accept(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_apply_mask_in_every_float_dtype(backend, tokenizer, dtype):
    """Rows named out of order, a spare mask row, padded ids: float64 (torch path) and the
    xgrammar kernels' dtypes give the same -inf pattern."""
    specs = [GrammarSpec.choice(["yes", "no"]), GrammarSpec("regex", "[0-9]+"), GrammarSpec("json_object")]
    mask = backend.new_mask(len(specs) + 1)
    expected = []
    for i, spec in enumerate(specs):
        matcher = backend.matcher(backend.compile(spec))
        matcher.fill_mask(mask, i)
        expected.append(allowed(backend, matcher))
    rows = [4, 0, 2]
    logits = torch.randn(5, backend.vocab_size, dtype=torch.float64).to(dtype)
    reference = logits.clone()
    for i, row in enumerate(rows):
        reference[row] = reference[row].masked_fill(~expected[i], float("-inf"))
    backend.apply_mask(logits, mask, rows)
    assert torch.equal(logits, reference)
    assert torch.isinf(logits[rows, len(tokenizer):]).all()  # padded ids
    backend.apply_mask(logits, mask, [])  # no rows: nothing to do
    assert torch.equal(logits, reference)


def test_apply_mask_checks_the_logits_width(backend):
    with pytest.raises(ValueError, match="wide"):
        backend.apply_mask(torch.zeros(1, backend.vocab_size - 1), backend.new_mask(1), [0])


def test_a_terminated_matcher_allows_the_stop_token_only(backend, tokenizer):
    matcher = backend.matcher(backend.compile(GrammarSpec.choice(["ab"])), max_rollback=2)
    assert matcher.accept(tokenizer.convert_tokens_to_ids("ab")) and matcher.accept(EOS)
    assert matcher.is_terminated() and not matcher.accept(EOS)
    assert allowed(backend, matcher).nonzero().flatten().tolist() == [EOS]
    matcher.rollback(1)  # a rejected speculative stop token
    assert not matcher.is_terminated() and allowed(backend, matcher).nonzero().flatten().tolist() == [EOS]


def test_rollback_bounds(backend, tokenizer):
    compiled = backend.compile(GrammarSpec("regex", "[a-z]+"))
    matcher = backend.matcher(compiled, max_rollback=2)
    matcher.rollback(0)
    with pytest.raises(ValueError, match="cannot roll back 1 tokens: 0 can be undone"):
        matcher.rollback(1)
    for ch in "abcde":
        assert matcher.accept(tokenizer.convert_tokens_to_ids(ch))
    with pytest.raises(ValueError, match="max_rollback=2"):
        matcher.rollback(3)
    matcher.rollback(2)
    with pytest.raises(ValueError):
        matcher.rollback(1)  # the history kept is max_rollback tokens
    assert not matcher.accept(-1) and not matcher.accept(backend.vocab_size) and not matcher.accept(10**9)
    with pytest.raises(ValueError, match="max_rollback"):
        backend.matcher(compiled, max_rollback=-1)


# ---------------------------------------------------------------------- compiling


def test_cache_returns_one_object_per_spec_from_any_thread(tokenizer):
    backend = make(tokenizer)
    spec = GrammarSpec("regex", "[a-c]{2,5}")
    results = []
    threads = [threading.Thread(target=lambda: results.append(backend.compile(spec))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 6 and all(r is results[0] for r in results)
    assert backend.compile(GrammarSpec("regex", "[a-c]{2,5}")) is results[0]


def test_cache_limit_keeps_the_newest(tokenizer):
    backend = make(tokenizer, cache_limit_bytes=0)
    a, b = GrammarSpec("regex", "a+"), GrammarSpec("regex", "b+")
    first = backend.compile(a)
    assert backend.compile(a) is first
    backend.compile(b)
    assert backend.compile(a) is not first  # evicted by b: recompiled


def test_tiny_model_tokenizer(tmp_path: Path):
    """The tiny model's word-level tokenizer (t0, t1, ...): a choice of its words works."""
    from transformers import AutoTokenizer

    from tessellm.testing.models import save_word_tokenizer

    save_word_tokenizer(tmp_path, 64)
    words = XGrammarBackend(XGrammarBackend.Options(), AutoTokenizer.from_pretrained(tmp_path), 64)
    matcher = words.matcher(words.compile(GrammarSpec.choice(["t5", "t17"])))
    assert allowed(words, matcher).nonzero().flatten().tolist() == [5, 17]
    assert matcher.accept(17) and allowed(words, matcher).nonzero().flatten().tolist() == [2]


def test_registers_through_its_hook():
    registered = []
    xgrammar_backend.register_grammar(registered.append)
    assert registered == [XGrammarBackend] and XGrammarBackend.name == "xgrammar"
