"""What every built-in grammar backend keeps beyond the conformance suite, run on each: its
error messages, its options (JSON whitespace, the cache bound), strict schemas, choices, special tokens, float
logits and padded vocabularies, rollback, a missing package and its hook."""

from __future__ import annotations

import importlib
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.grammar import GrammarSpec

EOS = 2

TINY_CACHE = {"xgrammar": {"cache_limit_bytes": 0}, "llguidance": {"cache_entries": 1}}
"""Each backend's options that keep one compiled grammar only."""


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend_class(request):
    pytest.importorskip(request.param)
    module = importlib.import_module(f"tessellm.plugins.grammar.{request.param}_backend")
    return next(c for c in vars(module).values() if getattr(c, "name", None) == request.param)


# ---------------------------------------------------------------------- errors and options


ERRORS = [  # (spec, words in every backend's message, words in one backend's)
    (GrammarSpec("regex", "a(b"), ["cannot compile the regex grammar"], {"xgrammar": ["parenthesis"]}),
    (GrammarSpec("regex", r"\bword"), ["regex"], {"xgrammar": ["Word boundary"]}),
    (GrammarSpec("regex", "(?=a)b"), ["regex"], {}),
    (GrammarSpec("json_schema", '{"type": '), ["json_schema", "not JSON"], {}),
    (GrammarSpec("json_schema", "[1, 2]"), ["json_schema", "expected a JSON object", "list"], {}),
    (GrammarSpec("json_schema", '{"type": "frob"}'), ["json_schema", "frob"], {}),
    (GrammarSpec("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}'), ["json_schema"],
     {"xgrammar": ["minLength 5 is greater than maxLength 2"]}),
    (GrammarSpec("choice", "[]"), ["choice", "non-empty JSON list of strings"], {}),
    (GrammarSpec("choice", '["a", 1]'), ["choice", "non-empty JSON list of strings"], {}),
    (GrammarSpec("ebnf", 'rot ::= "a"'), ["ebnf"], {"xgrammar": ["no rule named root"],
                                                    "llguidance": ["No 'root' rule"]}),
    (GrammarSpec("ebnf", "root ::= foo"), ["ebnf"], {"xgrammar": ['Rule "foo" is not defined'],
                                                     "llguidance": ["Rule 'foo' not found"]}),
    (GrammarSpec("ebnf", 'root ::= "a'), ["ebnf"], {"llguidance": ["end of input"]}),
    (GrammarSpec("toml", "x"), ["'toml' is not supported", "choice, ebnf, json_object, json_schema, regex"], {}),
]


@pytest.mark.parametrize("spec, words, own_words", ERRORS)
def test_errors_are_one_line_naming_the_kind(backend, spec, words, own_words):
    with pytest.raises(InvalidRequestError) as info:
        backend.compile(spec)
    message = str(info.value)
    assert all(w in message for w in words + own_words.get(backend.name, [])), message
    assert "\n" not in message and ".cc:" not in message and "Check failed" not in message, message  # xgrammar's log


def test_missing_package_is_one_clear_line(backend_class, make, monkeypatch):
    package, module = backend_class.package, sys.modules[backend_class.__module__]
    monkeypatch.setitem(sys.modules, package, None)  # importing the package now raises ImportError
    with pytest.raises(ImportError, match=rf"^grammar plugin '{package}' needs the {package} package: "
                                          rf"pip install {package}$"):
        make()
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    ctx = SimpleNamespace(device=torch.device("cpu"))
    assert backend_class.unsupported_reasons(ctx) == [module.INSTALL_HINT]


# ---------------------------------------------------------------------- kinds


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}


def test_json_schema_strict_refuses_undeclared_properties(backend, takes):
    strict, lax = GrammarSpec.schema(SCHEMA), GrammarSpec.schema(SCHEMA, strict=False)
    for text in ['{"a": 1}', '{"a": 1, "b": "x"}']:
        assert takes(backend, strict, text) and takes(backend, lax, text)
    extra = '{"a": 1, "c": [true]}'
    assert not takes(backend, strict, extra)
    assert takes(backend, lax, extra)
    assert not takes(backend, lax, '{"b": "x"}')  # required still holds


def test_any_whitespace_option(make, backend, takes):
    loose = make(any_whitespace=True)
    spec = GrammarSpec.schema(SCHEMA)
    assert takes(backend, spec, '{"a": 1, "b": "x"}')  # the default: one line, as json.dumps writes
    for text in ['{"a":1}', '{ "a": 1 }', '{"a": 1,\n "b": "x"}']:
        assert takes(loose, spec, text) and not takes(backend, spec, text), text


def test_json_object_is_an_object_only(backend, takes):
    spec = GrammarSpec("json_object")
    assert takes(backend, spec, '{"k": [1, "x", {"n": null}]}')
    for text in ["[1]", '"x"', "3", "null"]:
        assert not takes(backend, spec, text), text  # xgrammar's built-in JSON grammar takes arrays


def test_choice_takes_exactly_its_options(backend, allowed, takes):
    options = ["no", "not now", 'say "hi"', "back\\slash", "new\nline", "é✓😀", "a|b*", "/x/", ""]
    spec = GrammarSpec.choice(options)
    for text in options:
        assert takes(backend, spec, text), text
    for text in ["n", "no ", "not", "say hi", "a", "ab", "x"]:
        assert not takes(backend, spec, text), text
    matcher = backend.matcher(backend.compile(spec))
    assert allowed(backend, matcher)[EOS]  # "" is an option: the stop token is allowed at once


# ---------------------------------------------------------------------- masks and matchers


def test_special_tokens_are_never_allowed(backend, tokenizer, allowed):
    # inside a JSON string xgrammar alone allows "<s>" and "<pad>": it reads them as text
    matcher = backend.matcher(backend.compile(GrammarSpec("json_object")), max_rollback=1)
    assert matcher.accept(tokenizer.convert_tokens_to_ids('{"'))
    ok = allowed(backend, matcher)
    assert ok[tokenizer.convert_tokens_to_ids("a")] and not ok[0] and not ok[1] and not ok[EOS]
    assert not matcher.accept(1) and not matcher.accept(0) and not matcher.accept(EOS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_apply_mask_in_every_float_dtype(backend, tokenizer, allowed, dtype):
    """Rows named out of order, a spare mask row, padded ids: every float dtype (xgrammar:
    float64 on the torch path, the others on its kernels) gives the same -inf pattern."""
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


def test_a_terminated_matcher_allows_the_stop_token_only(backend, tokenizer, allowed):
    matcher = backend.matcher(backend.compile(GrammarSpec.choice(["ab"])), max_rollback=2)
    assert matcher.accept(tokenizer.convert_tokens_to_ids("ab")) and matcher.accept(EOS)
    assert matcher.is_terminated() and not matcher.accept(EOS)
    assert allowed(backend, matcher).nonzero().flatten().tolist() == [EOS]
    matcher.rollback(1)  # a rejected speculative stop token
    assert not matcher.is_terminated() and allowed(backend, matcher).nonzero().flatten().tolist() == [EOS]
    matcher.rollback(1)  # back to the start, past the grammar's end
    assert allowed(backend, matcher)[tokenizer.convert_tokens_to_ids("ab")]


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
    assert not matcher.accept(len(tokenizer))  # a padded id
    with pytest.raises(ValueError, match="max_rollback"):
        backend.matcher(compiled, max_rollback=-1)


# ---------------------------------------------------------------------- compiling


def test_cache_returns_one_object_per_spec_from_any_thread(make):
    backend = make()
    spec = GrammarSpec("regex", "[a-c]{2,5}")
    results = []
    threads = [threading.Thread(target=lambda: results.append(backend.compile(spec))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 6 and all(r is results[0] for r in results)
    assert backend.compile(GrammarSpec("regex", "[a-c]{2,5}")) is results[0]


def test_cache_bound_keeps_the_newest(backend_class, make):
    backend = make(**TINY_CACHE[backend_class.name])
    a, b = GrammarSpec("regex", "a+"), GrammarSpec("regex", "b+")
    first = backend.compile(a)
    assert backend.compile(a) is first
    backend.compile(b)
    assert backend.compile(a) is not first  # evicted by b: recompiled


def test_tiny_model_tokenizer(backend_class, allowed, tmp_path: Path):
    """The tiny model's word-level tokenizer (t0, t1, ...): a choice of its words works."""
    from transformers import AutoTokenizer

    from tessellm.testing.models import save_word_tokenizer

    save_word_tokenizer(tmp_path, 64)
    words = backend_class(backend_class.Options(), AutoTokenizer.from_pretrained(tmp_path), 64)
    matcher = words.matcher(words.compile(GrammarSpec.choice(["t5", "t17"])))
    assert allowed(words, matcher).nonzero().flatten().tolist() == [5, 17]
    assert matcher.accept(17) and allowed(words, matcher).nonzero().flatten().tolist() == [2]


def test_registers_through_its_hook(backend_class):
    registered = []
    sys.modules[backend_class.__module__].register_grammar(registered.append)
    assert registered == [backend_class]
