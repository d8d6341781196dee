"""Proposer `ngram`: prompt lookup decoding (Saxena 2023; vLLM's n-gram speculator).

Match the sequence's last n tokens (n from ``ngram_max`` down to ``ngram_min``) against an
earlier place in its prompt and output; propose the tokens that followed there. It costs no
forward, and pays off where the output copies its input: summaries, code edits, answers
quoted from a passage.

Each sequence keeps an index from every n-gram to where it last ended, extended by the new
tokens each step (O(new tokens x ngram_max)), so a lookup never rescans the context.
"""

from __future__ import annotations

from tessellm.core.interfaces.sequence import Sequence

from .proposer import Draft, Proposer


class _Index:
    """n-gram -> end position of its most recent occurrence, for n in [lo, hi], over the
    tokens [0, indexed)."""

    def __init__(self) -> None:
        self.last: dict[tuple[int, ...], int] = {}
        self.indexed = 0

    def extend(self, tokens: list[int], upto: int, lo: int, hi: int) -> None:
        for end in range(self.indexed, upto):
            for n in range(lo, min(hi, end + 1) + 1):
                self.last[tuple(tokens[end - n + 1:end + 1])] = end
        self.indexed = max(self.indexed, upto)


class NgramProposer(Proposer):
    """Drafts by copying what followed the most recent earlier occurrence of the longest
    matching suffix (at least ``ngram_min`` tokens)."""

    name = "ngram"

    def __init__(self, ngram_min: int, ngram_max: int):
        self.lo, self.hi = ngram_min, ngram_max
        self._index: dict[int, _Index] = {}

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Draft]:
        return [Draft(self._lookup(seq, budget) if budget > 0 else []) for seq, budget in zip(seqs, budgets)]

    def _lookup(self, seq: Sequence, budget: int) -> list[int]:
        tokens = seq.token_ids
        last = len(tokens) - 1
        index = self._index.setdefault(seq.seq_id, _Index())
        index.extend(tokens, last, self.lo, self.hi)  # every n-gram ending before the last token
        for n in range(min(self.hi, last), self.lo - 1, -1):
            end = index.last.get(tuple(tokens[last - n + 1:]))
            if end is not None:
                # what followed may run into the suffix itself (a repeating pattern): copy on
                # through the proposal so far, as the pattern would continue
                out: list[int] = []
                src = end + 1
                while len(out) < budget:
                    out.append(tokens[src] if src <= last else out[src - last - 1])
                    src += 1
                return out
        return []

    def finish(self, seq: Sequence) -> None:
        self._index.pop(seq.seq_id, None)
