"""Grammar `xgrammar`: structured outputs on xgrammar's compiled grammars and matchers.

A spec compiles once per tokenizer into xgrammar's ``CompiledGrammar`` (a pushdown automaton
with each state's token masks precomputed); a matcher walks it one token at a time and writes
the allowed tokens as a bitmask, 32 tokens per int32. xgrammar is imported when the backend
is built, so listing plugins does not need it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field

import tessellm
from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.grammar import GrammarBackend, GrammarMatcher, GrammarSpec
from tessellm.core.plugin import PluginOptions, SelectionContext

INSTALL_HINT = "grammar plugin 'xgrammar' needs the xgrammar package: pip install xgrammar"

_ANY_OBJECT = '{"type": "object"}'
"""``json_object`` as a schema: xgrammar's built-in JSON grammar also takes a top-level array."""

_START = "tessellm_start"
"""The start rule wrapped around an EBNF grammar's ``root``."""

_MASKED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Logits dtypes xgrammar's own kernels mask; others (float64) take the torch path."""


class XGrammarOptions(PluginOptions):
    """Options of the `xgrammar` grammar backend."""

    max_threads: int = Field(8, ge=1, le=256)
    """Threads xgrammar uses to compile one grammar (precomputing its token masks)."""
    cache_limit_bytes: int = Field(2**30, ge=0)
    """Memory the compiled grammars kept for reuse may take (xgrammar's estimate of each);
    past it the least recently used go first. The newest one is always kept."""
    any_whitespace: bool = False
    """JSON kinds: whether any whitespace may go between elements. False (the default): one
    line, separated by ', ' and ': ' as ``json.dumps`` writes, so a model cannot loop on
    blanks (SmolLM2-135M at temperature 0.8 fills max_tokens with newlines otherwise)."""


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return xgrammar


def _problem(exc: Exception) -> str:
    """xgrammar's message without its log prefix ("[time] file.cc:line: Check failed: ...")."""
    line = str(exc).strip().split("\n")[0]
    line = re.sub(r"^\[[^\]]*\]\s+\S+:\d+:\s*", "", line)
    return re.sub(r"^Check failed: \(.*?\) is false:\s*", "", line) or type(exc).__name__


def choice_ebnf(options: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``options``: an alternation of string
    literals, escaped as JSON strings (xgrammar reads the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def bounded_strings_as_patterns(schema: Any) -> Any:
    """``schema`` with each string's ``minLength`` / ``maxLength`` (no pattern, format, enum or
    const beside) written as the pattern ``^[\\s\\S]{min,max}$``. xgrammar's length-bounded
    strings admit raw control characters (a tab, U+0001: invalid JSON); its patterns match
    JSON string characters only. Neither form admits escapes."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_strings_as_patterns(v) for k, v in schema.items()}
    if out.get("type") != "string" or {"pattern", "format", "enum", "const"} & out.keys():
        return out
    low, high = out.get("minLength", 0), out.get("maxLength")
    if not {"minLength", "maxLength"} & out.keys():
        return out
    if type(low) is not int or low < 0 or high is not None and (type(high) is not int or high < low):
        return out  # bounds xgrammar refuses with its own message
    out.pop("minLength", None)
    out.pop("maxLength", None)
    out["pattern"] = f"^[\\s\\S]{{{low},{'' if high is None else high}}}$"
    return out


def int32_bits(ids: list[int], words: int) -> torch.Tensor:
    """A bitmask row [words] int32 with the bits of ``ids`` set (bit i % 32 of word i // 32)."""
    values = [0] * words
    for i in ids:
        values[i // 32] |= 1 << (i % 32)
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32)


def unpack_bitmask(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Allowed tokens [R, vocab_size] bool from a bitmask [R, ceil(vocab_size / 32)] int32."""
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = mask.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1)  # [R, words, 32]
    return bits.view(mask.shape[0], -1)[:, :vocab_size].bool()


@dataclass(frozen=True)
class _Vocab:
    """What every matcher of a backend shares about the vocabulary."""

    tokens: int  # ids from here to the logits width are padding
    never: frozenset[int]  # special tokens other than the stop tokens: never allowed
    stop_row: torch.Tensor  # [words] int32: the stop tokens only
    keep_row: torch.Tensor  # [words] int32: every token but ``never``


class XGrammarMatcher(GrammarMatcher):
    """One sequence in an xgrammar compiled grammar. Beyond the interface's contract: the
    tokenizer's special tokens (BOS, padding, chat markers) are never allowed, the stop
    tokens only where the output may end; after a stop token ``fill_mask`` allows the stop
    tokens only (never an all -inf row); ``rollback`` refuses (ValueError) more tokens than
    were accepted or than ``max_rollback``."""

    def __init__(self, matcher: Any, max_rollback: int, vocab: _Vocab):
        self._matcher = matcher
        self._max_rollback = max_rollback
        self._undoable = 0  # accepted tokens rollback may still undo
        self._vocab = vocab

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():  # xgrammar refuses a mask after the stop token
            mask[row].copy_(self._vocab.stop_row)
            return
        self._matcher.fill_next_token_bitmask(mask, row)
        if self._vocab.never:  # xgrammar reads a special token's text as literal characters
            mask[row].bitwise_and_(self._vocab.keep_row)

    def accept(self, token: int) -> bool:
        token = int(token)
        # refused here, not by xgrammar, which logs a warning for each
        if not 0 <= token < self._vocab.tokens or token in self._vocab.never:
            return False
        if not self._matcher.accept_token(token):
            return False
        self._undoable = min(self._undoable + 1, self._max_rollback)
        return True

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._undoable:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._undoable} can be undone "
                             f"(max_rollback={self._max_rollback})")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self._undoable -= num_tokens

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XGrammarBackend(GrammarBackend):
    """Every ``GrammarSpec`` kind on xgrammar: ``json_schema`` (``strict``: xgrammar's strict
    mode, no properties or items the schema does not declare), ``json_object`` (any object),
    ``regex`` (xgrammar's regex dialect: no lookaround, word boundaries or ``\\p{..}``),
    ``choice`` (an alternation of literals) and ``ebnf`` (xgrammar's GBNF-like dialect, rule
    ``root``). Compiled grammars are kept per spec (least recently used dropped past
    ``cache_limit_bytes``), so a repeated spec returns the same object; ``compile`` may run
    on any thread. Masks are int32 bitmasks, 32 tokens a word; padded ids (from
    ``len(tokenizer)`` to ``vocab_size``) and special tokens other than the stop tokens are
    never allowed."""

    name = "xgrammar"
    api_version = "1.5"
    description = "structured outputs (JSON schema, regex, choice, EBNF) on xgrammar's token masks"
    auto_priority = 10
    Options = XGrammarOptions

    def __init__(self, options: XGrammarOptions, tokenizer: Any, vocab_size: int):
        super().__init__(options, tokenizer, vocab_size)
        self._xgr = _xgrammar()
        info = self._xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # one cache, ours: it returns the same object for a spec and has the memory bound
        self._compiler = self._xgr.GrammarCompiler(info, max_threads=options.max_threads, cache_enabled=False)
        self._vocab = _vocabulary(tokenizer, vocab_size, set(info.stop_token_ids))
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()

    @classmethod
    def unsupported_reasons(cls, ctx: SelectionContext) -> list[str]:
        reasons = super().unsupported_reasons(ctx)
        if importlib.util.find_spec("xgrammar") is None:
            reasons.append(INSTALL_HINT)
        return reasons

    # ------------------------------------------------------------------ compiling

    def compile(self, spec: GrammarSpec) -> Any:
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        compiled = self._compile(spec)  # outside the lock: other specs compile meanwhile
        with self._lock:
            if spec in self._cache:  # another thread compiled it meanwhile: one object per spec
                return self._cache[spec]
            self._cache[spec] = compiled
            self._cache_bytes += compiled.memory_size_bytes
            while self._cache_bytes > self.options.cache_limit_bytes and len(self._cache) > 1:
                self._cache_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
        return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        if spec.kind not in self.supported_kinds:
            raise InvalidRequestError(f"grammar kind {spec.kind!r} is not supported by grammar plugin 'xgrammar' "
                                      f"(supported: {', '.join(sorted(self.supported_kinds))})")
        compiler, whitespace = self._compiler, self.options.any_whitespace
        try:
            if spec.kind == "json_schema":
                schema = bounded_strings_as_patterns(_parse(spec, dict, "a JSON object (the schema)"))
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=whitespace,
                                                    strict_mode=spec.strict)
            if spec.kind == "json_object":
                return compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=whitespace, strict_mode=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.source)
            if spec.kind == "choice":
                options = _parse(spec, list, "a non-empty JSON list of strings")
                if not options or not all(isinstance(o, str) for o in options):
                    raise InvalidRequestError(f"cannot compile the choice grammar: expected a non-empty JSON list "
                                              f"of strings, got {spec.source[:60]!r}")
                return compiler.compile_grammar(choice_ebnf(options))
            if not re.search(r"^\s*root\s*::=", spec.source, re.MULTILINE):
                raise InvalidRequestError("cannot compile the ebnf grammar: it has no rule named root")
            # a start rule above root: xgrammar's masks refuse tokens that close two levels
            # of a recursive start rule (its matcher accepts them)
            return compiler.compile_grammar(f"{spec.source}\n{_START} ::= root", root_rule_name=_START)
        except (RuntimeError, ValueError, TypeError) as exc:
            if isinstance(exc, InvalidRequestError):
                raise
            raise InvalidRequestError(f"cannot compile the {spec.kind} grammar: {_problem(exc)}") from exc

    # ------------------------------------------------------------------ matching and masks

    def matcher(self, compiled: Any, max_rollback: int = 0) -> XGrammarMatcher:
        # xgrammar keeps the whole history (its max_rollback_tokens is deprecated); the
        # wrapper enforces the bound the engine asked for
        if max_rollback < 0:
            raise ValueError(f"max_rollback must be >= 0, got {max_rollback}")
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled), max_rollback, self._vocab)

    def new_mask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)  # [rows, ceil(V / 32)] int32, CPU

    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
        # logits: [B, V]; mask: [>= len(rows), ceil(V / 32)] int32; mask row i masks logits[rows[i]]
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits are {logits.shape[-1]} wide, the grammar backend's vocabulary {self.vocab_size}")
        if not rows:
            return
        mask = mask[:len(rows)].to(logits.device)  # blocking: the caller may refill the buffer next
        if logits.dtype not in _MASKED_DTYPES:
            refused = unpack_bitmask(mask, self.vocab_size).logical_not_()
            for i, row in enumerate(rows):
                logits[row].masked_fill_(refused[i], float("-inf"))
            return
        if rows != list(range(len(rows))):  # xgrammar masks logits[r] with mask row r: spread the rows out
            spread = torch.full((max(rows) + 1, mask.shape[1]), -1, dtype=torch.int32, device=logits.device)
            spread[torch.tensor(rows, device=logits.device)] = mask
            mask = spread
        self._xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=list(rows))


def _vocabulary(tokenizer: Any, vocab_size: int, stops: set[int]) -> _Vocab:
    ids = tokenizer.get_vocab().values()
    special = set(tokenizer.all_special_ids)
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    never = frozenset(i for i in special - stops if 0 <= i < vocab_size)
    words = -(-vocab_size // 32)
    return _Vocab(min(max(len(ids), max(ids) + 1), vocab_size), never,
                  int32_bits(sorted(stops), words), int32_bits(sorted(never), words).bitwise_not())


def _parse(spec: GrammarSpec, expected: type, what: str) -> Any:
    try:
        value = json.loads(spec.source)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"cannot compile the {spec.kind} grammar: the source is not JSON ({exc})") from exc
    if not isinstance(value, expected):
        raise InvalidRequestError(f"cannot compile the {spec.kind} grammar: expected {what}, "
                                  f"got {type(value).__name__} {spec.source[:60]!r}")
    return value


@tessellm.hookimpl
def register_grammar(register):
    register(XGrammarBackend)
