"""The grammar-backend contract as properties: a mask allows exactly the tokens ``accept``
takes; seeded random walks through the masks end in outputs the spec matches; ``rollback``
returns to the masks it left; ``apply_mask`` sets exactly the disallowed logits to -inf in
the rows it names; bad specs are refused with ``InvalidRequestError``; compiling is cached.

The suite runs on a byte-level BPE tokenizer built in memory (``byte_level_tokenizer``):
every text is spellable, tokens span grammar symbols (``{"``, ``": ``, ``))``), and the
logits are ``PADDING`` ids wider than the tokenizer. The tiny model's word-level tokenizer
(``t0``, ``t1``, ...) cannot spell JSON, so it is not used. Everything is offline."""

from __future__ import annotations

import json
import random
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, strategies as st

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.grammar import GrammarSpec
from tessellm.testing.conformance.base import ConformanceSuite, property_settings

PADDING = 45
"""Logits ids past the tokenizer (a padded lm_head); not a multiple of 32, so a packed mask
ends in a partial word."""

MAX_WALK = 64
"""Tokens a random walk takes at most before it is cut off unfinished."""

ROLLBACK_DEPTH = 4
"""The speculative depth matchers are made with (``max_rollback``)."""

STOP_CHANCE = 0.3
"""Chance a walk takes the stop token when the mask allows it."""

CLOSERS = "\"}])"
"""Tokens holding one of these are drawn 8 times as often (strings and groups close, so walks
finish); blank tokens a quarter as often (JSON would otherwise wander in whitespace)."""

PIECES = ('{"', '":', '": ', '", "', '"}', '},', '[{', '}]', '", ', ', ', ' "', 'true', 'false', 'null',
          '12', '0,', 'ab', 'cd', 'x y', 'flag', 'tag', 'count', 'items', 'inner', 'name', '\n  ', '  ',
          '((', '))', '()', 'x)', 'yz', '-4', '.x', 'yes', 'no', 'not', ' now', 'é', '✓', 'say', '|b')
"""The multi-character tokens of ``byte_level_tokenizer``, besides its 256 bytes."""


def byte_level_tokenizer() -> Any:
    """A GPT-2-style byte-level BPE tokenizer: ``<pad>`` 0, ``<s>`` 1 (BOS), ``</s>`` 2 (EOS),
    the 256 bytes, then ``PIECES`` (each merged left to right)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = []
    for piece in PIECES:
        chars = "".join(s for s, _ in split.pre_tokenize_str(piece))
        token = chars[0]
        for ch in chars[1:]:
            if token + ch not in vocab:
                vocab[token + ch] = len(vocab)
                merges.append((token, ch))
            token += ch
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = split
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", clean_up_tokenization_spaces=False)


# ---------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class GrammarCase:
    """A spec; ``check``, which a finished output must pass; texts it must take (``accepted``,
    each followed by the stop token) and texts it must refuse (``refused``: some token of
    the text, or the stop token after it, is disallowed)."""

    name: str
    spec: GrammarSpec
    check: Callable[[str], bool]
    accepted: tuple[str, ...]
    refused: tuple[str, ...] = ()


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "flag": {"type": "boolean"},
        "inner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}}, "required": ["name"]},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        "tag": {"enum": ["ab", "cd", "x y"]},
    },
    "required": ["count", "flag", "tag"],
}
"""Bounded values (enum, integer ranges, maxItems, maxLength), an optional nested object;
properties in sorted order, as ``GrammarSpec.schema`` writes them."""


def _record(strict: bool) -> Callable[[str], bool]:
    """``SCHEMA`` checked by hand (and by ``jsonschema`` where installed); strict: no keys
    the schema does not declare, at either level."""

    def check(text: str) -> bool:
        value = json.loads(text)
        _jsonschema(value, SCHEMA)
        if not isinstance(value, dict) or not {"count", "flag", "tag"} <= value.keys():
            return False
        inner, items = value.get("inner", {"name": ""}), value.get("items", [])
        ok = (isinstance(value["flag"], bool) and value["tag"] in ("ab", "cd", "x y")
              and _int_in(value["count"], 0, 99) and isinstance(items, list) and len(items) <= 3
              and all(_int_in(i, 0, 9) for i in items)
              and isinstance(inner, dict) and isinstance(inner.get("name"), str) and len(inner["name"]) <= 4)
        if strict:
            ok = ok and value.keys() <= SCHEMA["properties"].keys() and inner.keys() == {"name"}
        return ok

    return check


def _int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _jsonschema(value: Any, schema: dict[str, Any]) -> None:
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(value, schema)


def _balanced(text: str) -> bool:
    """``EBNF``'s language: a parenthesised group of groups, ``x`` and ``yz``."""
    return _group(text, 0) == len(text)


def _group(text: str, i: int) -> int:
    """End of the group starting at ``i`` (-1: none)."""
    if not text.startswith("(", i):
        return -1
    i += 1
    while i < len(text) and text[i] != ")":
        if text.startswith("yz", i):
            i += 2
        elif text[i] == "x":
            i += 1
        else:
            i = _group(text, i)
            if i < 0:
                return -1
    return i + 1 if i < len(text) else -1


EBNF = 'root ::= "(" item* ")"\nitem ::= root | "x" | "yz"'
REGEX = r"(ab|c)+-[0-9]{1,3}(\.[a-z]+)?"
CHOICES = ["yes", "no", "not now", 'say "hi"', "a|b", "é✓", "x*"]
_RECORD = '{"count": 42, "flag": true, "inner": {"name": "é✓ab"}, "items": [1, 0, 9], "tag": "x y"}'
_EXTRA = '{"count": 7, "flag": false, "tag": "ab", "more": [1, {"a": null}]}'

CASES = [
    GrammarCase("json_schema", GrammarSpec.schema(SCHEMA), _record(True),
                (_RECORD, '{"count": 0, "flag": false, "tag": "cd"}'),
                (_EXTRA, '{"flag": true, "tag": "ab"}', '{"count": 0, "flag": 1, "tag": "ab"}',
                 '{"count": 100, "flag": true, "tag": "ab"}', '{"count": 0, "flag": true, "tag": "zz"}',
                 '{"count": 0, "flag": true, "inner": {"name": "a\tb"}, "tag": "ab"}')),
    GrammarCase("json_schema-lax", GrammarSpec.schema(SCHEMA, strict=False), _record(False),
                (_RECORD, _EXTRA),
                ('{"count": 1, "flag": true}', '{"count": 0, "flag": true, "tag": "ab", "x": "\x01"}')),
    GrammarCase("json_object", GrammarSpec("json_object"), lambda t: isinstance(json.loads(t), dict),
                ("{}", '{"a": [1, {"b": null}], "c": "x y", "d": -1.5e3}'), ("[1, 2]", '"x"', "{", "{}}")),
    GrammarCase("regex", GrammarSpec("regex", REGEX), lambda t: re.fullmatch(REGEX, t) is not None,
                ("ab-1", "cabc-042.xyz"), ("ab", "abd-1", "c-1234", "c-1.")),
    GrammarCase("choice", GrammarSpec.choice(CHOICES), lambda t: t in CHOICES,
                tuple(CHOICES), ("n", "yes!", "not", "a", "x")),
    GrammarCase("ebnf", GrammarSpec("ebnf", EBNF), _balanced, ("()", "(x(yz)(()x))"), ("(", "())", "x", "(y)")),
]
"""One case per kind (json_schema strict and not). Documents list their properties in the
schema's order: a backend may fix that order. A raw control character inside a string is
never valid JSON."""

BAD_SPECS = {
    "schema-not-json": GrammarSpec("json_schema", '{"type": '),
    "schema-unknown-type": GrammarSpec("json_schema", '{"type": "frob"}'),
    "regex-unclosed-group": GrammarSpec("regex", "a(b"),
    "regex-reversed-range": GrammarSpec("regex", "[z-a]"),
    "ebnf-undefined-rule": GrammarSpec("ebnf", "root ::= undefined_rule"),
    "ebnf-unterminated-literal": GrammarSpec("ebnf", 'root ::= "a'),
    "choice-empty": GrammarSpec("choice", "[]"),
    "choice-not-a-list": GrammarSpec("choice", '"yes"'),
    "choice-not-strings": GrammarSpec("choice", "[1, 2]"),
    "unsupported-kind": GrammarSpec("yaml", "a: 1"),  # type: ignore[arg-type]
}
"""Specs no backend can compile, by what is wrong with them."""


# ---------------------------------------------------------------------- walking


class Walker:
    """Masks as sets of token ids, and seeded random walks through them, for one backend."""

    def __init__(self, backend: Any, tokenizer: Any):
        self.backend = backend
        self.tokenizer = tokenizer
        self.stop = tokenizer.eos_token_id
        self.special = torch.tensor(sorted(set(tokenizer.all_special_ids) - {self.stop}), dtype=torch.long)
        texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
        weights = [8.0 if any(c in t for c in CLOSERS) else 0.25 if t.isspace() else 1.0 for t in texts]
        self.weights = torch.tensor(weights + [0.0] * (backend.vocab_size - len(texts)), dtype=torch.float64)

    def mask(self, matcher: Any) -> torch.Tensor:
        mask = self.backend.new_mask(1)
        matcher.fill_mask(mask, 0)
        return mask

    def allowed(self, mask: torch.Tensor) -> torch.Tensor:
        """[V] bool: the tokens mask row 0 leaves finite (apply_mask on zeros)."""
        logits = torch.zeros(1, self.backend.vocab_size)
        self.backend.apply_mask(logits, mask, [0])
        return torch.isfinite(logits[0])

    def pick(self, allowed: torch.Tensor, rng: random.Random, stop: bool = True) -> int:
        """An allowed token: the stop token with ``STOP_CHANCE`` when allowed (and ``stop``),
        else one drawn by ``weights`` among the others."""
        if allowed[self.stop] and (stop and rng.random() < STOP_CHANCE or int(allowed.sum()) == 1):
            return self.stop
        weights = self.weights * allowed
        weights[self.stop] = 0.0
        g = torch.Generator().manual_seed(rng.getrandbits(63))
        return int(torch.multinomial(weights, 1, generator=g))

    def advance(self, matcher: Any, rng: random.Random, tokens: int, stop: bool) -> list[int]:
        """Up to ``tokens`` accepted tokens (fewer when the walk stops)."""
        taken = []
        while len(taken) < tokens and not matcher.is_terminated():
            token = self.pick(self.allowed(self.mask(matcher)), rng, stop)
            if token == self.stop and not stop:
                break
            assert matcher.accept(token), f"the mask allows token {token} but accept refused it"
            taken.append(token)
        return taken

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t != self.stop], clean_up_tokenization_spaces=False)


class GrammarConformance(ConformanceSuite):
    """The contract every grammar backend honours, checked on the plugin named by ``plugin``
    (or ``plugin_class``) with ``options``, for each ``GrammarSpec`` kind it declares in
    ``supported_kinds`` (a case of another kind is skipped, saying so):

    - the mask allows exactly the tokens ``accept`` takes (every token checked, at every step
      of seeded random walks), never a padded id or a special token other than the stop
      token, and at least one token while unfinished; a refused token leaves the state (the
      mask) unchanged;
    - a walk that ends with the stop token spells an output the spec matches (JSON parsed
      and checked against the schema, strict refusing undeclared keys; ``re.fullmatch``;
      one of the choices; the EBNF's language); given documents are taken, bad ones refused;
    - ``rollback(k)`` for k up to the speculative depth (in pieces too) restores the masks;
    - ``apply_mask`` sets exactly the disallowed logits of the rows it names to -inf (float32,
      float64, bfloat16; logits wider than the tokenizer) and leaves other rows alone;
    - matchers of one compiled grammar are independent;
    - a spec that cannot compile, or of a kind not supported, raises ``InvalidRequestError``
      whose one-line message names the kind; ``compile`` of an equal spec returns the same
      compiled grammar, and compiles from several threads at once all work.

    ``grammar_tokenizer`` is the tokenizer the backend is built with (``byte_level_tokenizer``;
    override the fixture to try another whose every token decodes on its own). Every token
    is tried at every step of a walk, so the suite's time grows with the vocabulary: keep
    it small.
    """

    kind = "grammar"

    # ------------------------------------------------------------------ fixtures

    @pytest.fixture(scope="class")
    @classmethod
    def grammar_tokenizer(cls) -> Any:
        return byte_level_tokenizer()

    @pytest.fixture(scope="class")
    @classmethod
    def grammar_backend(cls, grammar_tokenizer: Any) -> Any:
        """The backend under test for ``grammar_tokenizer``, logits ``PADDING`` ids wider."""
        return cls.under_test()(cls.plugin_options(), grammar_tokenizer, len(grammar_tokenizer) + PADDING)

    @pytest.fixture(scope="class")
    @classmethod
    def walker(cls, grammar_backend: Any, grammar_tokenizer: Any) -> Walker:
        return Walker(grammar_backend, grammar_tokenizer)

    # ------------------------------------------------------------------ helpers

    def compiled(self, backend: Any, case: GrammarCase) -> Any:
        """The case's compiled grammar; skips a kind the backend does not declare."""
        if case.spec.kind not in backend.supported_kinds:
            pytest.skip(f"{self.label()} does not declare grammar kind {case.spec.kind!r} "
                        f"(supported_kinds: {sorted(backend.supported_kinds)})")
        return backend.compile(case.spec)

    def takes(self, walker: Walker, case: GrammarCase, text: str) -> bool:
        """Whether the case's grammar takes ``text`` token by token, then the stop token."""
        matcher = walker.backend.matcher(self.compiled(walker.backend, case))
        for token in walker.tokenizer.encode(text, add_special_tokens=False) + [walker.stop]:
            if not walker.allowed(walker.mask(matcher))[token]:
                return False
            assert matcher.accept(token), f"{case.name}: the mask allows token {token} but accept refused it"
        return matcher.is_terminated()

    # ------------------------------------------------------------------ properties

    @pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
    @given(seed=st.integers(0, 2**32 - 1))
    @property_settings(max_examples=12)
    def test_random_walks_match_the_spec(self, walker: Walker, case: GrammarCase, seed: int) -> None:
        """A seeded walk: at each step every token is tried (accept, then rollback of what it
        took) against the mask, the mask is the same after the refusals, and a token drawn
        from the mask is accepted; a walk that stops spells an output the spec matches."""
        self.case()
        backend, rng = walker.backend, random.Random(seed)
        matcher = backend.matcher(self.compiled(backend, case), ROLLBACK_DEPTH)
        tokens: list[int] = []
        while len(tokens) < MAX_WALK and not matcher.is_terminated():
            mask = walker.mask(matcher)
            allowed = walker.allowed(mask)
            assert allowed.any(), f"{case.name}: nothing allowed after {walker.text(tokens)!r}"
            assert not allowed[len(walker.tokenizer):].any(), f"{case.name}: a padded id is allowed"
            assert not allowed[walker.special].any(), (
                f"{case.name}: special tokens {walker.special[allowed[walker.special]].tolist()} are allowed")
            for token in range(backend.vocab_size):
                took = matcher.accept(token)
                if took:
                    matcher.rollback(1)
                verdicts = ("allows", "refused") if allowed[token] else ("refuses", "took")
                assert took == bool(allowed[token]), (
                    f"{case.name}: after {walker.text(tokens)!r} the mask {verdicts[0]} token {token} "
                    f"({walker.tokenizer.decode([token])!r}) but accept {verdicts[1]} it")
            assert torch.equal(walker.mask(matcher), mask), f"{case.name}: refused tokens changed the mask"
            token = walker.pick(allowed, rng)
            assert matcher.accept(token)
            tokens.append(token)
        if not matcher.is_terminated():
            return  # cut off unfinished: every step above was still checked
        assert tokens[-1] == walker.stop, f"{case.name}: terminated without the stop token"
        assert not matcher.accept(walker.stop), f"{case.name}: a terminated matcher accepted another token"
        text = walker.text(tokens)
        assert case.check(text), f"{case.name}: the walk spelled {text!r}, which the spec does not match"

    @pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
    def test_documents_are_taken_or_refused(self, walker: Walker, case: GrammarCase) -> None:
        """Every ``accepted`` text goes through its mask token by token and ends with the stop
        token; every ``refused`` text meets a disallowed token on the way."""
        self.case()
        for text in case.accepted:
            assert case.check(text), f"suite design: {text!r} does not pass {case.name}'s own check"
            assert self.takes(walker, case, text), f"{case.name}: the grammar refused {text!r}"
        for text in case.refused:
            assert not self.takes(walker, case, text), f"{case.name}: the grammar took {text!r}"

    @pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
    @given(seed=st.integers(0, 2**32 - 1), prefix=st.integers(0, 12), depth=st.integers(0, ROLLBACK_DEPTH),
           first=st.integers(0, ROLLBACK_DEPTH))
    @property_settings(max_examples=10)
    def test_rollback_restores_the_masks(self, walker: Walker, case: GrammarCase, seed: int, prefix: int,
                                         depth: int, first: int) -> None:
        """After a prefix, ``depth`` more tokens (the stop token among them maybe), rolled back
        in two pieces: each piece lands on the mask recorded at that point, unterminated."""
        self.case()
        backend, rng = walker.backend, random.Random(seed)
        matcher = backend.matcher(self.compiled(backend, case), ROLLBACK_DEPTH)
        walker.advance(matcher, rng, prefix, stop=False)
        masks = [walker.mask(matcher)]
        for _ in range(depth):
            if matcher.is_terminated():
                break
            walker.advance(matcher, rng, 1, stop=True)
            if not matcher.is_terminated():
                masks.append(walker.mask(matcher))
            else:
                masks.append(None)  # no mask is asked of a terminated matcher
        taken = len(masks) - 1
        first = min(max(first, int(matcher.is_terminated())), taken)  # a terminated matcher has no mask
        for step in (first, taken - first):
            matcher.rollback(step)
            taken -= step
            assert not matcher.is_terminated(), f"{case.name}: terminated after rolling back {step} tokens"
            assert torch.equal(walker.mask(matcher), masks[taken]), (
                f"{case.name}: rolling back {step} tokens (to {taken} after the prefix) did not restore the mask")

    @given(data=st.data())
    @property_settings(max_examples=20)
    def test_apply_mask_sets_exactly_the_disallowed_logits(self, walker: Walker, data: Any) -> None:
        """Mask rows from matchers at assorted states, applied to a subset of logits rows in
        any order: row ``rows[i]`` gets -inf exactly where row i's tokens are disallowed
        (padded ids included), every other value and row stays as it was."""
        self.case()
        backend = walker.backend
        cases = [c for c in CASES if c.spec.kind in backend.supported_kinds]
        count = data.draw(st.integers(1, 4), label="rows")
        batch = data.draw(st.integers(count, count + 3), label="logits rows")
        rows = data.draw(st.permutations(range(batch)), label="order")[:count]
        dtype = data.draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), label="dtype")
        mask = backend.new_mask(count + data.draw(st.integers(0, 2), label="spare mask rows"))
        allowed = []
        for i in range(count):
            case = data.draw(st.sampled_from(cases), label=f"case {i}")
            matcher = backend.matcher(backend.compile(case.spec))
            walker.advance(matcher, random.Random(data.draw(st.integers(0, 2**32 - 1))),
                           data.draw(st.integers(0, 10)), stop=False)
            matcher.fill_mask(mask, i)
            allowed.append(walker.allowed(walker.mask(matcher)))
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), label="logits seed"))
        logits = torch.randn(batch, backend.vocab_size, generator=g, dtype=torch.float64).to(dtype)
        expected = logits.clone()
        for i, row in enumerate(rows):
            expected[row] = expected[row].masked_fill(~allowed[i], float("-inf"))
        backend.apply_mask(logits, mask, rows)
        wrong = [r for r in range(batch) if not torch.equal(logits[r], expected[r])]
        assert not wrong, f"apply_mask({dtype}, rows={rows}) differs from the rows' masks in logits rows {wrong}"

    @pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
    def test_matchers_are_independent(self, walker: Walker, case: GrammarCase) -> None:
        """Advancing one matcher of a compiled grammar leaves another's mask at the start."""
        self.case()
        compiled = self.compiled(walker.backend, case)
        still, moved = walker.backend.matcher(compiled), walker.backend.matcher(compiled)
        start = walker.mask(still)
        walker.advance(moved, random.Random(0), 6, stop=False)
        assert torch.equal(walker.mask(still), start), f"{case.name}: one matcher's tokens moved another"

    @pytest.mark.parametrize("spec", BAD_SPECS.values(), ids=BAD_SPECS.keys())
    def test_bad_specs_are_invalid_requests(self, grammar_backend: Any, spec: GrammarSpec) -> None:
        """Refused with a one-line ``InvalidRequestError`` naming the kind, every time (an
        error is not cached as a grammar); a kind the backend does not support is refused
        the same way."""
        self.case()
        for _ in range(2):
            with pytest.raises(InvalidRequestError) as info:
                grammar_backend.compile(spec)
            message = str(info.value)
            assert spec.kind in message and "\n" not in message, f"{spec.describe()}: message {message!r}"

    def test_compile_is_cached_and_thread_safe(self, grammar_backend: Any) -> None:
        """An equal spec (a new object) gets the same compiled grammar; specs compiled from
        four threads at once, each spec by two, all compile and start at equal masks."""
        self.case()
        for case in CASES:
            if case.spec.kind in grammar_backend.supported_kinds:
                first = grammar_backend.compile(case.spec)
                again = grammar_backend.compile(GrammarSpec(case.spec.kind, case.spec.source, case.spec.strict))
                assert again is first, f"{case.name}: a second compile of the spec was not the cached grammar"
        if "regex" not in grammar_backend.supported_kinds:
            return
        specs = [GrammarSpec("regex", f"thread{i}-[a-c]+") for i in range(2)] * 2
        results: list[Any] = [None] * len(specs)

        def run(i: int) -> None:
            try:
                results[i] = grammar_backend.compile(specs[i])
            except Exception as exc:  # reported below, in the test's thread
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(specs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for spec, result in zip(specs, results):
            assert not isinstance(result, Exception), f"{spec.describe()}: compile from a thread raised {result!r}"
            masks = grammar_backend.new_mask(2)
            grammar_backend.matcher(result).fill_mask(masks, 0)
            grammar_backend.matcher(grammar_backend.compile(spec)).fill_mask(masks, 1)
            assert torch.equal(masks[0], masks[1]), f"{spec.describe()}: a thread's grammar starts elsewhere"
