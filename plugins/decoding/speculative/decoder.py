"""Decoding `speculative`: draft k tokens cheaply, verify them in one target forward.

Each step, for every sequence that is decoding (one uncomputed token, some output already),
the proposer drafts up to k tokens; the engine appends them to the sequence's query, so the
target scores all k+1 positions of every sequence in the one packed forward it runs anyway
(sequences with different draft lengths side by side); ``decode`` accepts a prefix of the
drafts by exact rejection sampling (``rejection.py``) and the engine rolls the KV of the
rest back. Greedy output equals plain greedy decoding token for token; sampled output has
exactly the target's distribution.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from tessellm.core.interfaces.batch import BatchMetadata, SchedulerOutput
from tessellm.core.interfaces.decoder import Decoder, DecoderContext
from tessellm.core.plugin import PluginOptions
from tessellm.core.interfaces.sequence import Sequence
from tessellm.plugins.decoding.sample import filter_logits, sampling_tensors

from .adaptive import AdaptiveK
from .draft_model import DraftModelProposer
from .layer_skip import LayerSkipProposer
from .ngram import NgramProposer
from .proposer import Proposer
from .rejection import accept_greedy, accept_sampled


class SpeculativeOptions(PluginOptions):
    """Options of the `speculative` decoder."""

    proposer: Literal["ngram", "draft", "layer-skip"] = "ngram"
    """Where drafts come from: prompt lookup, a smaller draft model, or the target with layers skipped."""
    k: int = Field(4, ge=1, le=16)
    """Most draft tokens per sequence and step (the scheduler reserves this many extra slots)."""
    adaptive_k: bool = True
    """Choose each sequence's draft length (0 to k) from its acceptance rate and the draft's cost."""
    verify_cost: float = Field(0.1, ge=0.0, lt=1.0)
    """Adaptive k: time of one more query token in a one-sequence decode step, relative to that
    step (about 0.1 on a CPU, near 0 on a GPU); at batch B it is taken as this times sqrt(B)."""
    draft_cost: float | None = Field(None, ge=0.0, le=10.0)
    """Adaptive k: time of one draft token relative to a target decode step; None estimates it
    (ngram 0, layer-skip the share of layers run, draft the draft's share of parameters)."""
    ngram_min: int = Field(1, ge=1, le=64)
    """ngram: shortest suffix to match."""
    ngram_max: int = Field(4, ge=1, le=64)
    """ngram: longest suffix to match (longer matches are tried first)."""
    draft_model: str | None = None
    """draft: the draft model (a name, Hugging Face folder or .gguf) sharing the target's tokenizer."""
    draft_overrides: list[str] = Field(default_factory=list)
    """draft: ``key=value`` overrides of the draft pipeline's config (e.g. cache.options.num_blocks=512)."""
    draft_layers: list[int] | None = None
    """layer-skip: the layers the draft runs (default: all but a band of about 15% early on)."""

    @model_validator(mode="after")
    def _consistent(self):
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) is above ngram_max ({self.ngram_max})")
        if self.proposer != "draft" and (self.draft_model or self.draft_overrides):
            raise ValueError(f"draft_model and draft_overrides apply to proposer 'draft', not {self.proposer!r}")
        if self.proposer != "layer-skip" and self.draft_layers is not None:
            raise ValueError(f"draft_layers applies to proposer 'layer-skip', not {self.proposer!r}")
        return self


def make_proposer(options: SpeculativeOptions) -> Proposer:
    if options.proposer == "ngram":
        return NgramProposer(options.ngram_min, options.ngram_max)
    if options.proposer == "draft":
        return DraftModelProposer(options.draft_model, options.draft_overrides)
    return LayerSkipProposer(options.draft_layers)


class SpeculativeDecoder(Decoder):
    """Speculative decoding with exact verification; see the module docstring.

    Per sequence and step it drafts at most ``k`` tokens, never past the request's
    ``max_tokens`` or the context window. Sequences that draft nothing decode exactly as
    `sample` does (same generator draws), so a request's seeded output does not depend on
    whether speculation was on for it.
    """

    name = "speculative"
    api_version = "1.19"
    description = "speculative decoding (n-gram lookup, draft model or layer-skip) with exact rejection sampling"
    Options = SpeculativeOptions
    auto_priority = None  # trades work for latency: chosen by name only
    request_fields = frozenset({"temperature", "top_k", "top_p", "min_p", "seed", "n"})

    def __init__(self, options: SpeculativeOptions, model, device: torch.device):
        super().__init__(options, model, device)
        self.num_lookahead_tokens = options.k
        self.proposer = make_proposer(options)
        self._probs: dict[int, torch.Tensor] = {}  # seq_id -> this step's draft distributions
        self.tokens_left = None

    def attach(self, ctx: DecoderContext) -> None:
        self.tokens_left = ctx.tokens_left
        self.proposer.attach(ctx)
        cost = self.options.draft_cost if self.options.draft_cost is not None else self.proposer.cost
        self.adaptive = AdaptiveK(self.options.k, cost, self.options.verify_cost)

    # ------------------------------------------------------------------ drafting

    def propose(self, out: SchedulerOutput) -> dict[int, list[int]]:
        self._probs = {}  # decode may run more than once per step (the engine isolating a fault)
        seqs, budgets = [], []
        decoding = [item.seq for item in out.scheduled if item.num_query_tokens == 1
                    and item.seq.num_computed_tokens + 1 == item.seq.num_tokens and item.seq.num_output_tokens > 0]
        for seq in decoding:
            room = self.tokens_left(seq) - 1  # the last token is the target's own
            k = self.adaptive.k_for(seq.seq_id, len(decoding)) if self.options.adaptive_k else self.options.k
            budget = min(k, room)
            if budget > 0:
                seqs.append(seq)
                budgets.append(budget)
        if not seqs:
            return {}
        drafts: dict[int, list[int]] = {}
        for seq, draft in zip(seqs, self.proposer.propose(seqs, budgets)):
            if draft.tokens:
                drafts[seq.seq_id] = draft.tokens
                if draft.probs is not None:
                    self._probs[seq.seq_id] = draft.probs
        return drafts

    # ------------------------------------------------------------------ verification

    def decode(self, logits: torch.Tensor, batch: BatchMetadata) -> list[list[int]]:
        # logits: [R, vocab]; slot s owns rows [first_row, first_row + num_rows)
        argmax = logits.argmax(dim=-1).tolist()
        sampled = [s for s in batch.samples if not s.seq.params.greedy]
        probs = self._target_probs(logits, sampled)
        results = []
        for slot in batch.samples:
            seq, draft = slot.seq, slot.draft_tokens
            q = self._probs.get(seq.seq_id)
            if seq.params.greedy:
                accepted = accept_greedy(argmax[slot.first_row:slot.first_row + slot.num_rows], draft)
            else:
                accepted = accept_sampled(probs[id(slot)], draft, q, seq.generator)
            if draft:
                self.adaptive.observe(seq.seq_id, len(draft), len(accepted) - 1)
            results.append(accepted)
        return results

    @staticmethod
    def _target_probs(logits: torch.Tensor, slots: list) -> dict[int, torch.Tensor]:
        """Filtered target distributions of each sampled slot's rows, on the CPU, batched."""
        if not slots:
            return {}
        rows = torch.cat([torch.arange(s.first_row, s.first_row + s.num_rows) for s in slots]).to(logits.device)
        params = [s.seq.params for s in slots for _ in range(s.num_rows)]
        probs = filter_logits(logits[rows], *sampling_tensors(params, logits.device)).softmax(dim=-1).cpu()
        out, start = {}, 0
        for s in slots:
            out[id(s)] = probs[start:start + s.num_rows]
            start += s.num_rows
        return out

    def finish(self, seq: Sequence) -> None:
        self._probs.pop(seq.seq_id, None)
        self.adaptive.forget(seq.seq_id)
        self.proposer.finish(seq)

