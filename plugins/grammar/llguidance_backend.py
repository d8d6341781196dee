"""Grammar `llguidance`: structured outputs on llguidance's Earley parser and lazy lexer.

Every spec becomes a Lark grammar (JSON schemas inline as ``%json``, regexes as one terminal,
GBNF through llguidance's own converter) and compiles once into an ``LLMatcher`` kept at the
grammar's start; each sequence's matcher is a copy of it that shares its lexer caches. Masks
are the same int32 bitmasks as xgrammar's, 32 tokens a word. llguidance is imported when the
backend is built, so listing plugins does not need it; it takes part only when a config
names it (``grammar.name: llguidance``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pydantic import Field

import tessellm
from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.grammar import GrammarSpec
from tessellm.core.plugin import PluginOptions
from tessellm.plugins.grammar.common import (CachingGrammarBackend, Vocabulary, VocabularyMatcher, choice_options,
                                             parse_source, unpack_bitmask, vocabulary)

_HEADER = '%llguidance {"no_forcing": true}\n'
"""Put above every grammar. llguidance otherwise allows only the canonical first token where
the grammar forces text (``{"count": `` after ``{``) while ``consume`` still takes every other
spelling of it, and a mask must allow exactly what ``accept`` takes."""

_ANY_OBJECT: dict[str, Any] = {"type": "object"}
"""``json_object`` as a schema."""

_GBNF_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|.)", re.DOTALL)
"""One escape of a GBNF grammar (a backslash and what it escapes, ``\\\\`` included)."""

_COMBINATORS = ("allOf", "anyOf", "oneOf", "$ref", "if")
"""Keywords whose subschemas llguidance intersects with the keywords beside them."""

_OBJECT_KEYWORDS = ("properties", "required", "patternProperties", "minProperties", "maxProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_STANDALONE = ("items", "prefixItems", "additionalProperties", "additionalItems", "unevaluatedProperties",
               "unevaluatedItems", "contains", "propertyNames")
"""Keywords whose subschemas describe a value of their own (a property, an item)."""


class LLGuidanceOptions(PluginOptions):
    """Options of the `llguidance` grammar backend."""

    any_whitespace: bool = False
    """JSON kinds: whether any whitespace may go between elements. False (the default): one
    line, separated by ', ' and ': ' as ``json.dumps`` writes, as the xgrammar backend does,
    so a model cannot loop on blanks."""
    cache_entries: int = Field(256, ge=1, le=1 << 20)
    """Compiled grammars kept for reuse (each with the lexer states its matchers built);
    past it the least recently used go first."""


def _one_line(exc: Exception | str) -> str:
    """An llguidance message on one line: its first line without the position in our Lark
    wrapper ("at 1(8): "), and the regex parser's reason ("error: unclosed group") where it
    gives one further down, below its picture of the grammar."""
    lines = [line.strip() for line in str(exc).strip().split("\n")]
    first = re.sub(r"^(at )?\d+\(\d+\):\s*", "", lines[0])
    reason = next((line[len("error:"):].strip() for line in lines[1:] if line.startswith("error:")), "")
    return f"{first} {reason}".strip() or (type(exc).__name__ if isinstance(exc, Exception) else "unknown error")


def strict_schema(schema: Any, close: bool = True) -> Any:
    """``schema`` with nothing undeclared allowed (``GrammarSpec.strict``): every object schema
    that stands alone gets ``"additionalProperties": false`` and every ``prefixItems`` array
    ``"items": false``, unless it says otherwise. A schema intersected with others stays open
    (a member of ``allOf``, ``then``, ``else`` or ``dependentSchemas``; a schema's own object
    keywords beside ``allOf``, ``anyOf``, ``oneOf``, ``$ref`` or ``if``, and then its
    ``anyOf`` / ``oneOf`` branches too): closing one part would refuse the properties another
    declares. ``$defs`` entries are closed, as they stand alone where a property refers to
    them; what is under ``not`` is left as it is."""
    if isinstance(schema, list):
        return [strict_schema(s, close) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    own_object = any(k in out for k in _OBJECT_KEYWORDS)
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: strict_schema(v, key != "dependentSchemas") for k, v in value.items()}
        elif key in _STANDALONE:
            out[key] = strict_schema(value)
        elif key in ("anyOf", "oneOf"):
            out[key] = strict_schema(value, not own_object)
        elif key in ("allOf", "if", "then", "else"):
            out[key] = strict_schema(value, False)
    types = out.get("type")
    is_object = own_object or types == "object" or isinstance(types, list) and "object" in types
    intersected = any(k in out for k in _COMBINATORS)
    if close and is_object and not intersected and not {"additionalProperties", "unevaluatedProperties"} & out.keys():
        out["additionalProperties"] = False
    if close and "prefixItems" in out and not {"items", "unevaluatedItems"} & out.keys():
        out["items"] = False
    return out


def gbnf_code_points(source: str) -> str:
    """A GBNF grammar with its ``\\uXXXX`` and ``\\UXXXXXXXX`` escapes written as the
    characters (as ``\\xNN`` below U+0080, where the raw character may be syntax): llguidance's
    converter writes them with their leading zeros dropped (``\\ue9``), which its own lexer
    and regex parser refuse. Other escapes, and surrogates, are left as they are."""

    def write(match: re.Match[str]) -> str:
        digits = match.group(1) or match.group(2)
        point = int(digits, 16) if digits else -1
        if point < 0 or 0xD800 <= point < 0xE000 or point > 0x10FFFF:
            return match.group(0)
        return f"\\x{point:02x}" if point < 0x80 else chr(point)

    return _GBNF_ESCAPE.sub(write, source)


def choice_lark(options: list[str]) -> str:
    """A Lark grammar whose language is exactly ``options``: an alternation of string
    literals, escaped as JSON strings (llguidance reads the same escapes)."""
    return "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


@dataclass(frozen=True)
class LLGuidanceGrammar:
    """A compiled spec: an ``LLMatcher`` at the grammar's start, never advanced itself;
    matchers are copies of it."""

    spec: GrammarSpec
    start: Any


class LLGuidanceMatcher(VocabularyMatcher):
    """One sequence in an llguidance grammar. Beyond the interface's contract: the tokenizer's
    special tokens (BOS, padding, chat markers) are never allowed, the stop token only where
    the output may end; after a stop token ``fill_mask`` allows the stop token only (never an
    all -inf row); ``rollback`` refuses (ValueError) more tokens than were accepted or than
    ``max_rollback``. The stop token is kept here, not given to llguidance, so rolling it
    back only clears the flag."""

    def __init__(self, matcher: Any, max_rollback: int, vocab: Vocabulary):
        super().__init__(max_rollback, vocab)  # the stop token counts among the tokens to undo
        self._matcher = matcher
        self._terminated = False

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        # mask: [R, ceil(V / 32)] int32, CPU, rows contiguous (new_mask's buffer)
        target = mask[row]
        if mask.dtype != torch.int32 or mask.device.type != "cpu" or not target.is_contiguous():
            raise ValueError(f"a grammar mask is CPU int32 with contiguous rows, got {mask.dtype} on {mask.device}")
        if self._terminated:
            target.copy_(self._vocab.stop_row)
            return
        # writes exactly one row: llguidance checks the size against its vocabulary
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)
        target.bitwise_and_(self._vocab.keep_row)

    def accept(self, token: int) -> bool:
        token = int(token)
        if self._terminated or not self._may_accept(token):
            return False
        if token in self._vocab.stops:
            # the mask's rule: llguidance allows the stop token once stopped or where it may end
            if not (self._matcher.is_stopped() or self._matcher.is_accepting()):
                return False
            self._terminated = True
        elif self._matcher.is_stopped() or self._matcher.try_consume_tokens([token]) != 1:
            return False  # consume_token would leave the matcher in its error state for good
        self._accepted()
        return True

    def rollback(self, num_tokens: int) -> None:
        self._check_rollback(num_tokens)
        if not num_tokens:
            return
        if self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: "
                               f"{_one_line(self._matcher.get_error())}")

    def is_terminated(self) -> bool:
        return self._terminated


class LLGuidanceBackend(CachingGrammarBackend):
    """Every ``GrammarSpec`` kind on llguidance: ``json_schema`` (llguidance's JSON schema
    compiler, properties in the schema's order; ``strict`` closes the objects and tuples the
    schema leaves open, see ``strict_schema``), ``json_object`` (any object), ``regex`` (Rust
    regex syntax, ``\\d`` ASCII digits; no lookaround or backreferences), ``choice`` (an
    alternation of literals) and ``ebnf`` (GBNF with a ``root`` rule, converted to Lark by
    llguidance: a rule made only of terminals becomes one lexeme, matched as long as it can
    go, so ``word ::= [a-z]+`` never leaves a following ``"x"`` to the rule above it; ``.``
    is any character). Compiled grammars are kept per spec (the ``cache_entries`` most recently
    used), so a repeated spec returns the same object; ``compile`` may run on any thread.
    Masks are int32 bitmasks, 32 tokens a word; padded ids (from ``len(tokenizer)`` to
    ``vocab_size``) and special tokens other than the EOS token are never allowed. Needs a
    fast (``tokenizers``) tokenizer with an EOS token."""

    name = "llguidance"
    package = "llguidance"
    api_version = "1.19"
    description = "structured outputs (JSON schema, regex, choice, EBNF) on llguidance's parser"
    auto_priority = None
    Options = LLGuidanceOptions

    def __init__(self, options: LLGuidanceOptions, tokenizer: Any, vocab_size: int):
        super().__init__(options, tokenizer, vocab_size)
        self._llg = self._import_package("gbnf_to_lark", "hf")
        stop = tokenizer.eos_token_id
        if stop is None:
            raise ValueError("grammar plugin 'llguidance' needs a tokenizer with an EOS token (the stop token)")
        # llguidance's masks may allow the padded ids: keep_row refuses them
        self._vocab = vocabulary(tokenizer, vocab_size, [stop], refuse_padding=True)
        self._tokenizer = _ll_tokenizer(self._llg, tokenizer, vocab_size, self._vocab, stop)
        self._json_options = ({"whitespace_flexible": True} if options.any_whitespace else
                              {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})

    # ------------------------------------------------------------------ compiling

    def _cache_limit(self) -> int:
        return self.options.cache_entries

    def _compile(self, spec: GrammarSpec) -> LLGuidanceGrammar:
        lark = _HEADER + self._lark(spec)
        start = self._llg.LLMatcher(self._tokenizer, lark, log_level=0)  # never raises: errors are its state
        if start.is_error():
            raise InvalidRequestError(f"cannot compile the {spec.kind} grammar: {_one_line(start.get_error())}")
        return LLGuidanceGrammar(spec, start)

    def _lark(self, spec: GrammarSpec) -> str:
        """The spec as a Lark grammar (without ``_HEADER``)."""
        if spec.kind in ("json_schema", "json_object"):
            schema = _ANY_OBJECT
            if spec.kind == "json_schema":
                schema = parse_source(spec, dict, "a JSON object (the schema)")
                schema = strict_schema(schema) if spec.strict else schema
            # options override the schema's own x-guidance
            return "start: %json " + json.dumps({**schema, "x-guidance": self._json_options}, ensure_ascii=False)
        if spec.kind == "regex":
            try:
                return "start: /" + self._llg.regex_to_lark(spec.source, "d") + "/"
            except (ValueError, RuntimeError) as exc:
                raise InvalidRequestError(f"cannot compile the regex grammar: {_one_line(exc)}") from exc
        if spec.kind == "choice":
            return choice_lark(choice_options(spec))
        try:
            return self._llg.gbnf_to_lark.gbnf_to_lark(gbnf_code_points(spec.source))
        except Exception as exc:  # the converter raises bare Exceptions ("Rule 'x' not found")
            raise InvalidRequestError(f"cannot compile the ebnf grammar: {_one_line(exc)}") from exc

    # ------------------------------------------------------------------ matching and masks

    def matcher(self, compiled: LLGuidanceGrammar, max_rollback: int = 0) -> LLGuidanceMatcher:
        # llguidance keeps the whole history; the wrapper enforces the bound the engine asked for
        return LLGuidanceMatcher(compiled.start.deep_copy(), max_rollback, self._vocab)

    def new_mask(self, rows: int) -> torch.Tensor:
        return torch.full((rows, -(-self.vocab_size // 32)), -1, dtype=torch.int32)  # [rows, ceil(V / 32)], CPU

    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
        # logits: [B, V]; mask: [>= len(rows), ceil(V / 32)] int32; mask row i masks logits[rows[i]]
        self._check_width(logits)
        if not rows:
            return
        refused = _refused(mask[:len(rows)], self.vocab_size, logits.device)  # [n, V] bool
        for i, row in enumerate(rows):
            logits[row].masked_fill_(refused[i], float("-inf"))


def _refused(mask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The disallowed tokens [R, vocab_size] bool on ``device`` of a bitmask [R, words] int32
    (CPU): unpacked by numpy for CPU logits (far cheaper than torch's shifts), by torch on others."""
    if device.type != "cpu":
        return unpack_bitmask(mask.to(device), vocab_size).logical_not_()
    bits = np.unpackbits(np.invert(mask.contiguous().numpy().view(np.uint8)), axis=-1, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))[:, :vocab_size]  # little-endian: bit i of a word is token i


def _ll_tokenizer(llg: Any, tokenizer: Any, vocab_size: int, vocab: Vocabulary, stop: int) -> Any:
    """llguidance's view of ``tokenizer``: read from its ``tokenizers`` JSON (byte-level or
    byte-fallback decoders), else, for one llguidance cannot read (a word-level tokenizer),
    each token's text decoded alone as its bytes."""
    try:
        return llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop)
    except ValueError as exc:
        if "decoder" not in str(exc):
            raise
    texts = _TokenTexts(tokenizer, vocab_size, vocab, stop)
    return llg.LLTokenizer(llg.TokenizerWrapper(texts), n_vocab=vocab_size, eos_token=stop)


class _TokenTexts:
    """What llguidance's ``TokenizerWrapper`` reads: every id's bytes (padded ids empty), the
    special ids (never spelled by text), and encoding."""

    def __init__(self, tokenizer: Any, vocab_size: int, vocab: Vocabulary, stop: int):
        self.eos_token_id = stop
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.decode([i]).encode() if i < vocab.tokens else b"" for i in range(vocab_size)]
        self.special_token_ids = sorted(vocab.never | vocab.stops)
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


INSTALL_HINT = LLGuidanceBackend.install_hint()
"""What ``unsupported_reasons`` and building the backend say when llguidance is missing."""


@tessellm.hookimpl
def register_grammar(register):
    register(LLGuidanceBackend)
