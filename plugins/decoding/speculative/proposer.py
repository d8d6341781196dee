"""Proposers: where draft tokens come from.

A proposer drafts up to ``budgets[i]`` tokens for each decoding sequence. A model-based
proposer (a draft model, or the target with layers skipped) also returns the distribution
q each draft token was drawn from, so verification stays exact for sampled requests; a
deterministic one (n-gram lookup) returns None, meaning one-hot drafts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tessellm.core.interfaces.batch import ScheduledSeq
from tessellm.core.interfaces.decoder import DecoderContext
from tessellm.core.interfaces.sequence import Sequence
from tessellm.plugins.decoding.sample import filter_logits, sampling_tensors


@dataclass
class Draft:
    """Draft tokens for one sequence; ``probs`` [len(tokens), V] on the CPU: the draft
    distribution of each (None: one-hot, or a greedy request, which needs none)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class Proposer(ABC):
    """Drafts tokens for decoding sequences.

    Contract: ``attach(ctx)`` once before use, with the target's ``DecoderContext``; ``propose(seqs, budgets)`` returns one
    Draft per sequence with at most ``budgets[i]`` tokens (fewer, or none, is fine) and
    must not change the sequences or their target-cache contents that verification relies
    on (positions below ``seq.num_computed_tokens``); ``finish(seq)`` drops its state for a
    finished sequence. ``cost`` is one draft token's time relative to one target decode step
    (adaptive k weighs it against the expected gain).
    """

    name: str = ""

    def attach(self, ctx: DecoderContext) -> None:
        """Take what the proposer needs of the target pipeline."""

    @property
    def cost(self) -> float:
        return 0.0

    @abstractmethod
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Draft]:
        """Drafts for ``seqs`` (decoding sequences of this step)."""

    def finish(self, seq: Sequence) -> None:
        """Forget per-sequence state."""


class DraftView:
    """What a forward reads of a sequence (``DecoderContext.run``), for a draft forward over
    the target's own cache: the target sequence's id (so its block table), its tokens plus the drafts so
    far, and how many of them have KV in the layers the draft runs."""

    def __init__(self, seq: Sequence):
        self.seq_id = seq.seq_id
        self.token_ids = list(seq.token_ids)
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.num_computed_tokens = seq.num_computed_tokens
        self.num_pending = 0  # speculative steps never leave tokens on the device
        self.lora_slot = seq.lora_slot  # a self-draft runs under the sequence's adapter

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def draft_rounds(views: list[Any], seqs: list[Sequence], budgets: list[int],
                 run: Callable[[list[ScheduledSeq]], torch.Tensor]) -> list[Draft]:
    """Autoregressive drafting, batched over sequences: each round runs ``run`` once over
    every view still drafting (its uncomputed tokens as the query: a catch-up on the first
    round, then the previous draft token), picks the next token per sequence and appends it.

    ``views[i]`` is what the draft forward sees of ``seqs[i]`` (a DraftView, or a Sequence in
    a draft model's cache); slots for ``num_tokens + budgets[i] - 1`` tokens must exist.
    Greedy requests take the argmax; sampled ones draw from the filtered draft distribution
    with the request's own generator, which is kept for verification.
    """
    drafts = [Draft([], None) for _ in views]
    rows: list[list[torch.Tensor]] = [[] for _ in views]
    active = [i for i, b in enumerate(budgets) if b > 0]
    while active:
        items = [ScheduledSeq(views[i], views[i].num_tokens - views[i].num_computed_tokens) for i in active]
        logits = run(items)  # [len(active), V]
        tokens = logits.argmax(dim=-1).tolist()
        sampled = [j for j, i in enumerate(active) if not seqs[i].params.greedy]
        if sampled:
            params = [seqs[active[j]].params for j in sampled]
            index = torch.tensor(sampled, device=logits.device)
            probs = filter_logits(logits[index], *sampling_tensors(params, logits.device)).softmax(dim=-1).cpu()
            for row, j in enumerate(sampled):
                i = active[j]
                tokens[j] = int(torch.multinomial(probs[row], 1, generator=seqs[i].generator))
                rows[i].append(probs[row])
        for j, i in enumerate(active):
            view = views[i]
            view.num_computed_tokens = view.num_tokens
            view.token_ids.append(tokens[j])
            drafts[i].tokens.append(tokens[j])
        active = [i for i in active if len(drafts[i].tokens) < budgets[i]]
    for i, r in enumerate(rows):
        if r:
            drafts[i].probs = torch.stack(r)
    return drafts
