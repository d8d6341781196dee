"""What the grammar backends share: int32 bitmask rows (32 tokens a word), the vocabulary
facts every matcher reads, the JSON sources of the ``json_schema`` and ``choice`` kinds, a
matcher base that keeps the tokenizer's special tokens out and bounds rollback, and a
backend base with a thread-safe cache of compiled grammars. Not a plugin: it registers
nothing and needs neither grammar library."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import threading
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.grammar import GrammarBackend, GrammarMatcher, GrammarSpec
from tessellm.core.plugin import PluginOptions, SelectionContext


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
class Vocabulary:
    """What every matcher of a backend shares about the vocabulary."""

    tokens: int  # ids from here to the logits width are padding
    stops: frozenset[int]  # the stop tokens
    never: frozenset[int]  # special tokens other than the stop tokens: never allowed
    stop_row: torch.Tensor  # [words] int32: the stop tokens only
    keep_row: torch.Tensor  # [words] int32: every token but ``never`` (and the padded ids, if asked)


def vocabulary(tokenizer: Any, vocab_size: int, stops: Iterable[int], refuse_padding: bool = False) -> Vocabulary:
    """The ``Vocabulary`` of a Hugging Face ``tokenizer`` whose logits are ``vocab_size`` wide.
    ``never`` holds its special ids (``all_special_ids`` and the added tokens marked special)
    other than ``stops``; ``keep_row`` also refuses the padded ids when ``refuse_padding``,
    for a backend whose own masks may allow them."""
    stops = frozenset(stops)
    ids = tokenizer.get_vocab().values()
    special = set(tokenizer.all_special_ids)
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    never = frozenset(i for i in special - stops if 0 <= i < vocab_size)
    tokens = min(max(len(ids), max(ids) + 1), vocab_size)
    words = -(-vocab_size // 32)
    refused = never | set(range(tokens, vocab_size)) if refuse_padding else never
    return Vocabulary(tokens, stops, never, int32_bits(sorted(stops), words),
                      int32_bits(sorted(refused), words).bitwise_not())


def parse_source(spec: GrammarSpec, expected: type, what: str) -> Any:
    """``spec.source`` read as JSON; an ``InvalidRequestError`` naming the kind when it is not
    JSON or not an instance of ``expected`` (``what`` describes it in the message)."""
    try:
        value = json.loads(spec.source)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"cannot compile the {spec.kind} grammar: the source is not JSON ({exc})") from exc
    if not isinstance(value, expected):
        raise InvalidRequestError(f"cannot compile the {spec.kind} grammar: expected {what}, "
                                  f"got {type(value).__name__} {spec.source[:60]!r}")
    return value


def choice_options(spec: GrammarSpec) -> list[str]:
    """The options of a ``choice`` spec; an ``InvalidRequestError`` unless its source is a
    non-empty JSON list of strings."""
    options = parse_source(spec, list, "a non-empty JSON list of strings")
    if not options or not all(isinstance(o, str) for o in options):
        raise InvalidRequestError(f"cannot compile the choice grammar: expected a non-empty JSON list "
                                  f"of strings, got {spec.source[:60]!r}")
    return options


class VocabularyMatcher(GrammarMatcher):
    """A matcher wrapper's shared bookkeeping: which ids may ever be accepted (inside the
    tokenizer's vocabulary, not in ``vocab.never``) and how many accepted tokens ``rollback``
    may still undo (at most ``max_rollback``; a negative bound is a ValueError)."""

    def __init__(self, max_rollback: int, vocab: Vocabulary):
        if max_rollback < 0:
            raise ValueError(f"max_rollback must be >= 0, got {max_rollback}")
        self._max_rollback = max_rollback
        self._undoable = 0  # accepted tokens rollback may still undo
        self._vocab = vocab

    def _may_accept(self, token: int) -> bool:
        """Whether ``token`` is a real id of the tokenizer and not a refused special token."""
        return 0 <= token < self._vocab.tokens and token not in self._vocab.never

    def _accepted(self) -> None:
        """Counts one accepted token toward what ``rollback`` may undo."""
        self._undoable = min(self._undoable + 1, self._max_rollback)

    def _check_rollback(self, num_tokens: int) -> None:
        """ValueError unless ``num_tokens`` accepted tokens may be undone; counts them undone."""
        if not 0 <= num_tokens <= self._undoable:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._undoable} can be undone "
                             f"(max_rollback={self._max_rollback})")
        self._undoable -= num_tokens


class CachingGrammarBackend(GrammarBackend):
    """A grammar backend whose ``compile`` keeps each spec's compiled grammar, least recently
    used dropped first once the entries' total ``_cache_cost`` passes ``_cache_limit`` (the
    newest is always kept). A repeated spec returns the same object; ``compile`` may run on
    any thread, and compiles outside the lock so other specs compile meanwhile. A kind
    outside ``supported_kinds`` is an ``InvalidRequestError`` naming the plugin. Subclasses
    name the ``package`` they need (unsupported where it is not installed, imported by
    ``_import_package`` when built), implement ``_compile`` and ``_cache_limit``;
    ``_cache_cost`` counts entries unless overridden."""

    package: ClassVar[str]
    """The Python package the backend compiles with, imported when the backend is built."""

    def __init__(self, options: PluginOptions, tokenizer: Any, vocab_size: int):
        super().__init__(options, tokenizer, vocab_size)
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._cache_total = 0  # the entries' summed _cache_cost
        self._lock = threading.Lock()

    @classmethod
    def unsupported_reasons(cls, ctx: SelectionContext) -> list[str]:
        reasons = super().unsupported_reasons(ctx)
        if importlib.util.find_spec(cls.package) is None:
            reasons.append(cls.install_hint())
        return reasons

    @classmethod
    def install_hint(cls) -> str:
        """The one line that says ``package`` is missing and how to install it."""
        return f"grammar plugin '{cls.name}' needs the {cls.package} package: pip install {cls.package}"

    @classmethod
    def _import_package(cls, *submodules: str) -> Any:
        """``package``, imported with its ``submodules``; an ImportError of one line, the
        install hint, if any is missing."""
        try:
            for module in (cls.package, *(f"{cls.package}.{s}" for s in submodules)):
                importlib.import_module(module)
        except ImportError as exc:
            raise ImportError(cls.install_hint()) from exc
        return sys.modules[cls.package]

    def compile(self, spec: GrammarSpec) -> Any:
        if spec.kind not in self.supported_kinds:
            raise InvalidRequestError(f"grammar kind {spec.kind!r} is not supported by grammar plugin "
                                      f"'{self.name}' (supported: {', '.join(sorted(self.supported_kinds))})")
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        compiled = self._compile(spec)  # outside the lock: other specs compile meanwhile
        with self._lock:
            if spec in self._cache:  # another thread compiled it meanwhile: one object per spec
                return self._cache[spec]
            self._cache[spec] = compiled
            self._cache_total += self._cache_cost(compiled)
            while self._cache_total > self._cache_limit() and len(self._cache) > 1:
                self._cache_total -= self._cache_cost(self._cache.popitem(last=False)[1])
        return compiled

    @abstractmethod
    def _compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of ``spec`` (a supported kind); InvalidRequestError if it is invalid."""

    @abstractmethod
    def _cache_limit(self) -> int:
        """The total ``_cache_cost`` the kept grammars may reach."""

    def _cache_cost(self, compiled: Any) -> int:
        """What one kept grammar counts toward ``_cache_limit``: 1, so the limit is an entry count."""
        return 1

    def _check_width(self, logits: torch.Tensor) -> None:
        """ValueError unless ``logits`` [B, V] are as wide as the backend's vocabulary."""
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits are {logits.shape[-1]} wide, the grammar backend's vocabulary {self.vocab_size}")
