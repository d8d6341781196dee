"""Grammar `xgrammar`: structured outputs on xgrammar's compiled grammars and matchers.

A spec compiles once per tokenizer into xgrammar's ``CompiledGrammar`` (a pushdown automaton
with each state's token masks precomputed); a matcher walks it one token at a time and writes
the allowed tokens as a bitmask, 32 tokens per int32. xgrammar is imported when the backend
is built, so listing plugins does not need it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
from pydantic import Field

import tessellm
from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.grammar import GrammarSpec
from tessellm.core.plugin import PluginOptions
from tessellm.plugins.grammar.common import (CachingGrammarBackend, Vocabulary, VocabularyMatcher, choice_options,
                                             int32_bits, parse_source, unpack_bitmask, vocabulary)

__all__ = ["INSTALL_HINT", "XGrammarBackend", "XGrammarMatcher", "XGrammarOptions", "bounded_strings_as_patterns",
           "choice_ebnf", "int32_bits", "register_grammar", "unpack_bitmask"]

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


class XGrammarMatcher(VocabularyMatcher):
    """One sequence in an xgrammar compiled grammar. Beyond the interface's contract: the
    tokenizer's special tokens (BOS, padding, chat markers) are never allowed, the stop
    tokens only where the output may end; after a stop token ``fill_mask`` allows the stop
    tokens only (never an all -inf row); ``rollback`` refuses (ValueError) more tokens than
    were accepted or than ``max_rollback``."""

    def __init__(self, matcher: Any, max_rollback: int, vocab: Vocabulary):
        super().__init__(max_rollback, vocab)
        self._matcher = matcher

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
        if not self._may_accept(token) or not self._matcher.accept_token(token):
            return False
        self._accepted()
        return True

    def rollback(self, num_tokens: int) -> None:
        self._check_rollback(num_tokens)
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XGrammarBackend(CachingGrammarBackend):
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
    package = "xgrammar"
    api_version = "1.19"
    description = "structured outputs (JSON schema, regex, choice, EBNF) on xgrammar's token masks"
    auto_priority = 10
    Options = XGrammarOptions

    def __init__(self, options: XGrammarOptions, tokenizer: Any, vocab_size: int):
        super().__init__(options, tokenizer, vocab_size)
        self._xgr = self._import_package()
        info = self._xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # one cache, ours: it returns the same object for a spec and has the memory bound
        self._compiler = self._xgr.GrammarCompiler(info, max_threads=options.max_threads, cache_enabled=False)
        self._vocab = vocabulary(tokenizer, vocab_size, info.stop_token_ids)

    # ------------------------------------------------------------------ compiling

    def _cache_limit(self) -> int:
        return self.options.cache_limit_bytes

    def _cache_cost(self, compiled: Any) -> int:
        return compiled.memory_size_bytes  # xgrammar's estimate

    def _compile(self, spec: GrammarSpec) -> Any:
        compiler, whitespace = self._compiler, self.options.any_whitespace
        try:
            if spec.kind == "json_schema":
                schema = bounded_strings_as_patterns(parse_source(spec, dict, "a JSON object (the schema)"))
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=whitespace,
                                                    strict_mode=spec.strict)
            if spec.kind == "json_object":
                return compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=whitespace, strict_mode=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.source)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_ebnf(choice_options(spec)))
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
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled), max_rollback, self._vocab)

    def new_mask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)  # [rows, ceil(V / 32)] int32, CPU

    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
        # logits: [B, V]; mask: [>= len(rows), ceil(V / 32)] int32; mask row i masks logits[rows[i]]
        self._check_width(logits)
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


INSTALL_HINT = XGrammarBackend.install_hint()
"""What ``unsupported_reasons`` and building the backend say when xgrammar is missing."""


@tessellm.hookimpl
def register_grammar(register):
    register(XGrammarBackend)
