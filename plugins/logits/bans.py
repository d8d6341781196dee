"""The bans: ``bad_words`` (vLLM's, with transformers' ``bad_words_ids``), ``allowed_token_ids``
(vLLM's) and ``no_repeat_ngram_size`` (transformers'). Each sets the logits of the tokens a
row may not pick to -inf."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from pydantic import Field

import tessellm
from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.logits import LogitsProcessor, ProcessorRows, to_device
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.core.plugin import PluginOptions
from tessellm.core.version import PLUGIN_API_VERSION


def ban_tokens(logits: torch.Tensor, row_ids: list[int], col_ids: list[int]) -> None:
    """Set ``logits[row_ids[i], col_ids[i]]`` to -inf (each pair once), except in a row these
    bans would leave with no finite logit: that row keeps its logits as they came (the contract:
    a processor leaves a row that came with a finite logit one). No wait for the device."""
    if not row_ids:
        return
    index = to_device([row_ids, col_ids], torch.long, logits.device)
    flat = index[0] * logits.shape[1] + index[1]
    flat_logits = logits.view(-1)
    before = flat_logits.index_select(0, flat)
    flat_logits.index_fill_(0, flat, float("-inf"))
    # the rows it emptied, from a max over the span of rows touched (a view: nothing copied)
    low = min(row_ids)
    best = logits[low:max(row_ids) + 1].amax(dim=1).index_select(0, index[0] - low)  # [bans] its row's max
    flat_logits.index_copy_(0, flat, torch.where(best == float("-inf"), before, float("-inf")))


def _outside(ids: Iterable[int], vocab_size: int) -> Optional[int]:
    """The first of ``ids`` outside [0, vocab_size), or None."""
    return next((t for t in ids if not 0 <= t < vocab_size), None)


# ---------------------------------------------------------------------- bad_words


class BadWordsArgs(PluginOptions):
    banned: tuple[int, ...] = ()
    """The one-token words: never picked."""
    sequences: tuple[tuple[int, ...], ...] = ()
    """The longer words: the last token is banned where the row's tokens end with the others."""


class BadWords(LogitsProcessor):
    """vLLM's ``bad_words``, transformers' ``NoBadWordsLogitsProcessor``: a token that would
    complete a bad word (its other tokens end the row's prompt, output and drafts) is banned; a
    one-token word always is. It reads the row's last tokens on the host, so it does not run in
    the overlapped step."""

    name = "bad_words"
    api_version = PLUGIN_API_VERSION
    order = 40
    fields = ("bad_words", "bad_words_ids")
    Args = BadWordsArgs

    def request_args(self, params: SamplingParams) -> Optional[BadWordsArgs]:
        if not params.bad_words and not params.bad_words_ids:
            return None
        words: dict[tuple[int, ...], None] = {}  # in order, without repeats
        for text in params.bad_words:
            for ids in self.encodings(text):
                words.setdefault(ids)
        for ids in params.bad_words_ids:
            bad = _outside(ids, self.ctx.vocab_size)
            if bad is not None:
                raise InvalidRequestError(f"bad_words_ids {ids} holds token id {bad}, outside the vocabulary "
                                          f"[0, {self.ctx.vocab_size})")
            words.setdefault(tuple(ids))
        return BadWordsArgs(banned=tuple(sorted({w[0] for w in words if len(w) == 1})),
                            sequences=tuple(w for w in words if len(w) > 1))

    def encodings(self, text: str) -> list[tuple[int, ...]]:
        """``text``'s token ids as it stands and with a leading space (how it reads mid-text),
        each once and only when not empty."""
        if not text.strip():
            raise InvalidRequestError(f"bad_words holds {text!r}, which has no word in it; each bad word needs "
                                      f"at least one non-space character")
        found = []
        for variant in (text, " " + text.lstrip()):
            ids = tuple(self.ctx.encode(variant))
            bad = _outside(ids, self.ctx.vocab_size)
            if bad is not None:
                raise InvalidRequestError(f"bad word {variant!r} encodes to token id {bad}, outside the model's "
                                          f"vocabulary [0, {self.ctx.vocab_size})")
            if ids and ids not in found:
                found.append(ids)
        return found

    def apply(self, logits: torch.Tensor, rows: ProcessorRows) -> None:
        row_ids: list[int] = []
        col_ids: list[int] = []
        for row, seq, args, drafts in zip(rows.rows, rows.seqs, rows.args, rows.drafts):
            banned = set(args.banned)
            if args.sequences:
                tail = self.tail(seq, drafts, max(len(w) for w in args.sequences) - 1)
                for word in args.sequences:
                    before = len(word) - 1
                    if before <= len(tail) and tail[len(tail) - before:] == word[:-1]:
                        banned.add(word[-1])
            row_ids.extend([row] * len(banned))
            col_ids.extend(banned)
        ban_tokens(logits, row_ids, col_ids)

    @staticmethod
    def tail(seq: Sequence, drafts: tuple[int, ...], length: int) -> tuple[int, ...]:
        """The last ``length`` tokens (fewer if it holds fewer) of the row's prompt, output, drafts."""
        if len(drafts) >= length:
            return tuple(drafts[len(drafts) - length:])
        return tuple(seq.token_ids[-(length - len(drafts)):]) + tuple(drafts)


# ---------------------------------------------------------------------- allowed_token_ids


class AllowedTokensArgs(PluginOptions):
    token_ids: tuple[int, ...] = ()
    """The only ids the row may pick, sorted, each once."""


class AllowedTokenIds(LogitsProcessor):
    """vLLM's ``allowed_token_ids``: every other token's logit is -inf. It reads no token values,
    so it runs in the overlapped step; the ids of each live sequence wait on the device."""

    name = "allowed_token_ids"
    api_version = PLUGIN_API_VERSION
    order = 40
    overlap_safe = True
    fields = ("allowed_token_ids",)
    Args = AllowedTokensArgs

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.on_device: dict[int, torch.Tensor] = {}  # seq_id -> its allowed ids on the device

    def request_args(self, params: SamplingParams) -> Optional[AllowedTokensArgs]:
        if params.allowed_token_ids is None:
            return None
        bad = _outside(params.allowed_token_ids, self.ctx.vocab_size)
        if bad is not None:
            raise InvalidRequestError(f"allowed_token_ids holds token id {bad}, outside the vocabulary "
                                      f"[0, {self.ctx.vocab_size})")
        return AllowedTokensArgs(token_ids=tuple(sorted(set(params.allowed_token_ids))))

    def add(self, seq: Sequence, args: AllowedTokensArgs) -> None:
        self.on_device[seq.seq_id] = to_device(list(args.token_ids), torch.long, self.ctx.device)

    def remove(self, seq: Sequence) -> None:
        self.on_device.pop(seq.seq_id, None)

    def apply(self, logits: torch.Tensor, rows: ProcessorRows) -> None:
        kept = [self.on_device.get(seq.seq_id) for seq in rows.seqs]
        kept = [ids if ids is not None else to_device(list(a.token_ids), torch.long, logits.device)
                for ids, a in zip(kept, rows.args)]
        counts = [len(a.token_ids) for a in rows.args]
        device = logits.device
        col_ids = torch.cat(kept)
        which = torch.repeat_interleave(torch.arange(len(rows), device=device), to_device(counts, torch.long, device),
                                        output_size=sum(counts))  # [allowed] its row's place in rows
        row_ids = rows.index.index_select(0, which)
        values = logits[row_ids, col_ids]
        # a row none of whose allowed tokens is finite keeps its logits (the contract: it keeps one)
        finite = torch.zeros(len(rows), dtype=logits.dtype, device=device).index_add_(
            0, which, values.isfinite().to(logits.dtype)) > 0
        banned = logits.index_select(0, rows.index).masked_fill_(finite[:, None], float("-inf"))
        logits.index_copy_(0, rows.index, banned)
        logits[row_ids, col_ids] = values


# ---------------------------------------------------------------------- no_repeat_ngram_size


class NoRepeatNGramArgs(PluginOptions):
    size: int = Field(1, ge=1, le=1024)
    """The n of the n-grams that may not occur twice."""


class _NGrams:
    """A sequence's n-grams so far: for each (n-1)-gram, the tokens that followed it, and the
    last n-1 tokens, so each new token adds its n-gram without a rescan."""

    __slots__ = ("n", "following", "tail")

    def __init__(self, n: int):
        self.n = n
        self.following: dict[tuple[int, ...], set[int]] = {}
        self.tail: list[int] = []  # the last n - 1 tokens (fewer while the sequence is shorter)

    def push(self, tokens: Iterable[int]) -> None:
        n, tail, following = self.n, self.tail, self.following
        for token in tokens:
            if len(tail) == n - 1:
                following.setdefault(tuple(tail), set()).add(token)
            tail.append(token)
            if len(tail) > n - 1:
                del tail[0]

    def banned(self, drafts: tuple[int, ...]) -> set[int]:
        """The tokens that would complete an n-gram already held, past ``drafts`` (whose own
        n-grams count, without entering the state)."""
        n = self.n
        tokens = self.tail + list(drafts)
        if len(tokens) < n - 1:
            return set()
        prefix = tuple(tokens[len(tokens) - (n - 1):])
        banned = set(self.following.get(prefix, ()))
        for end in range(max(len(self.tail), n - 1), len(tokens)):  # the n-grams ending in a draft
            if tuple(tokens[end - n + 1:end]) == prefix:
                banned.add(tokens[end])
        return banned


class NoRepeatNGram(LogitsProcessor):
    """transformers' ``NoRepeatNGramLogitsProcessor``: no n-gram of the prompt, output and
    drafts occurs twice (a token that would complete one held already is banned). It keeps each
    sequence's n-grams on the host, so it does not run in the overlapped step."""

    name = "no_repeat_ngram"
    api_version = PLUGIN_API_VERSION
    order = 40
    fields = ("no_repeat_ngram_size",)
    Args = NoRepeatNGramArgs

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.ngrams: dict[int, _NGrams] = {}  # seq_id -> its n-grams

    def request_args(self, params: SamplingParams) -> Optional[NoRepeatNGramArgs]:
        if not params.no_repeat_ngram_size:
            return None
        return NoRepeatNGramArgs(size=params.no_repeat_ngram_size)

    def add(self, seq: Sequence, args: NoRepeatNGramArgs) -> None:
        state = _NGrams(args.size)
        state.push(seq.token_ids)
        self.ngrams[seq.seq_id] = state

    def accept(self, updates: list[tuple[Sequence, list[int]]]) -> None:
        for seq, tokens in updates:
            self.ngrams[seq.seq_id].push(tokens)

    def remove(self, seq: Sequence) -> None:
        self.ngrams.pop(seq.seq_id, None)

    def apply(self, logits: torch.Tensor, rows: ProcessorRows) -> None:
        row_ids: list[int] = []
        col_ids: list[int] = []
        vocab = logits.shape[-1]
        for row, seq, drafts in zip(rows.rows, rows.seqs, rows.drafts):
            banned = [t for t in self.ngrams[seq.seq_id].banned(drafts) if t < vocab]
            row_ids.extend([row] * len(banned))
            col_ids.extend(banned)
        ban_tokens(logits, row_ids, col_ids)


@tessellm.hookimpl
def register_logits(register):
    register(BadWords)
    register(AllowedTokenIds)
    register(NoRepeatNGram)
