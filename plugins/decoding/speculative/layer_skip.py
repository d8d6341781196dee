"""Proposer `layer-skip`: the target model with some layers skipped drafts for itself
(self-speculative decoding: Zhang et al. 2023, "Draft & Verify"; LayerSkip, Elhoushi et al.
2024, is the early-exit case of keeping a prefix of the layers).

No second model and no second cache: the draft forward reads the context's K/V from the
target's own cache for the layers it runs, and writes its draft tokens' K/V into the slots
the scheduler reserved past the sequence's end (its lookahead). Verification then runs every
layer over those same positions and overwrites them, so nothing the draft wrote survives.
"""

from __future__ import annotations

from tessellm.core.errors import ConfigError
from tessellm.core.interfaces.decoder import DecoderContext
from tessellm.core.interfaces.sequence import Sequence

from .proposer import Draft, DraftView, Proposer, draft_rounds


def default_draft_layers(num_layers: int) -> list[int]:
    """Every layer but a band of about 15% of them starting an eighth of the way in: early
    and late layers matter most to the output. On SmolLM2-135M (bench/spec_costs.py) the default,
    skipping layers 3-6, keeps 88% of greedy tokens; skipping 22-25, 60%; skipping 8 layers,
    28% to 48%."""
    width = max(1, round(0.15 * num_layers)) if num_layers > 1 else 0
    start = num_layers // 8
    return [i for i in range(num_layers) if not start <= i < start + width]


class LayerSkipProposer(Proposer):
    """Drafts with the target's forward over ``layers`` only (default: ``default_draft_layers``)."""

    name = "layer-skip"

    def __init__(self, layers: list[int] | None):
        self.requested = layers
        self.layers: list[int] = []

    def attach(self, ctx: DecoderContext) -> None:
        total = ctx.model.num_layers
        layers = default_draft_layers(total) if self.requested is None else sorted(set(self.requested))
        bad = [i for i in layers if not 0 <= i < total]
        if bad or not layers:
            raise ConfigError(f"decoding.options.draft_layers: {self.requested} must name layers in [0, {total}) "
                              f"of this model, at least one")
        self.layers, self.total = layers, total
        self.run = ctx.run

    @property
    def cost(self) -> float:
        return len(self.layers) / self.total

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Draft]:
        views = [DraftView(seq) for seq in seqs]
        return draft_rounds(views, seqs, budgets, lambda items: self.run(items, self.layers))
