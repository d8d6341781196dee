"""The grammar-backend interface: structured outputs (a JSON schema, a regex, a choice, an
EBNF grammar) compiled once into a token-level automaton whose masks the engine applies to
the logits before any decoder picks."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from tessellm.core.plugin import Plugin, PluginOptions

GrammarKind = Literal["json_object", "json_schema", "regex", "choice", "ebnf"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "choice", "ebnf")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match; hashable, so compiled grammars are cached by it.

    - ``json_object``: any JSON object (``source`` is ignored, "").
    - ``json_schema``: ``source`` is the schema as JSON text; ``strict`` (OpenAI's flag)
      refuses what the schema does not declare (no extra properties where it is silent).
    - ``regex``: ``source`` is the regular expression the whole output matches.
    - ``choice``: ``source`` is a JSON list of strings; the output is exactly one of them.
    - ``ebnf``: ``source`` is a grammar in the backend's EBNF dialect (GBNF-like, ``root``
      rule), as vLLM's ``guided_grammar``.
    """

    kind: GrammarKind
    source: str = ""
    strict: bool = True

    @classmethod
    def choice(cls, options: list[str]) -> "GrammarSpec":
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def schema(cls, schema: dict[str, Any] | str, strict: bool = True) -> "GrammarSpec":
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema), strict)

    def describe(self) -> str:
        """A short name for errors and logs."""
        return self.kind if not self.source else f"{self.kind} {self.source[:60]!r}"


class GrammarMatcher(ABC):
    """One sequence's position in a compiled grammar (a pushdown automaton over tokens).

    Contract:
    - ``fill_mask(mask, row)`` writes the tokens allowed next into row ``row`` of a mask made
      by its backend's ``new_mask``; once the grammar is complete only the stop tokens
      (EOS) are allowed.
    - ``accept(token)`` advances by one token and returns True; a token the grammar does not
      allow returns False and leaves the state unchanged.
    - ``rollback(num_tokens)`` undoes the last ``num_tokens`` accepted tokens (rejected
      speculative drafts, a stop token among them); at most the ``max_rollback`` the matcher
      was made with; 0 does nothing.
    - ``is_terminated()``: a stop token was accepted (the output is complete).
    """

    @abstractmethod
    def fill_mask(self, mask: torch.Tensor, row: int) -> None: ...

    @abstractmethod
    def accept(self, token: int) -> bool: ...

    @abstractmethod
    def rollback(self, num_tokens: int) -> None: ...

    @abstractmethod
    def is_terminated(self) -> bool: ...


class GrammarBackend(Plugin):
    """Compiles ``GrammarSpec``s against the model's tokenizer and makes matchers for them.

    Contract:
    - Built once per pipeline with ``(options, tokenizer, vocab_size)``: the model's
      transformers tokenizer and the logits' width (which may exceed ``len(tokenizer)``:
      padded ids are never allowed, nor are the tokenizer's special tokens other than the
      stop tokens).
    - ``supported_kinds``: the ``GrammarSpec.kind`` values it compiles; ``compile`` refuses
      others with ``InvalidRequestError`` naming the kind and the supported ones.
    - ``compile(spec)`` returns an opaque compiled grammar. It is thread-safe and cached by
      ``spec`` (a second call returns at once), so a server compiles off the engine's step
      and the engine's own call then hits the cache. A spec that cannot compile (a bad
      schema, an invalid regex) raises ``InvalidRequestError`` naming the spec's kind and
      what is wrong.
    - ``matcher(compiled, max_rollback)`` starts a ``GrammarMatcher`` at the grammar's start,
      able to roll back ``max_rollback`` tokens.
    - ``new_mask(rows)`` makes a mask buffer for ``rows`` logits rows (CPU, backend's own
      layout: xgrammar packs 32 tokens per int32); ``apply_mask(logits, mask, rows)`` sets
      the disallowed logits of ``logits[rows[i]]`` from mask row ``i`` to -inf in place and
      leaves the other rows alone (``logits`` [B, vocab_size] of any float dtype, on any
      device; ``mask`` has at least ``len(rows)`` rows).
    """

    kind: ClassVar[str] = "grammar"
    supported_kinds: ClassVar[frozenset[str]] = frozenset(GRAMMAR_KINDS)

    def __init__(self, options: PluginOptions, tokenizer: Any, vocab_size: int):
        self.options = options
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any: ...

    @abstractmethod
    def matcher(self, compiled: Any, max_rollback: int = 0) -> GrammarMatcher: ...

    @abstractmethod
    def new_mask(self, rows: int) -> torch.Tensor: ...

    @abstractmethod
    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None: ...
