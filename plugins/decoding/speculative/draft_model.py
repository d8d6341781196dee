"""Proposer `draft`: a second, smaller model with the same vocabulary drafts the tokens
(Leviathan et al. 2023; Chen et al. 2023).

The draft is a pipeline of its own, built from the target's config with ``model`` replaced
(and any ``draft_overrides`` applied): its own weights, cache and attention backend, on the
same device. Each target sequence has a shadow sequence in the draft's cache. A step first
brings the shadow level with the target (dropping draft tokens the target rejected, then
computing what the target accepted or resampled: one forward batched over all sequences, a
whole prompt the first time), then drafts one token per round.
"""

from __future__ import annotations

from tessellm.core.errors import ConfigError
from tessellm.core.interfaces.decoder import DecoderContext
from tessellm.core.interfaces.sequence import Sequence

from .proposer import Draft, Proposer, draft_rounds


def _common_prefix(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of a and b, knowing the first ``start`` tokens agree."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer(Proposer):
    """Drafts with a separate model; see the module docstring."""

    name = "draft"

    def __init__(self, model: str | None, overrides: list[str]):
        self.model_name = model
        self.overrides = overrides
        self._shadows: dict[int, Sequence] = {}
        self._synced: dict[int, int] = {}  # seq_id -> target tokens known equal to the shadow's

    def attach(self, ctx: DecoderContext) -> None:
        if not self.model_name:
            raise ConfigError("decoding.options.draft_model: proposer 'draft' needs a draft model (a name, "
                              "Hugging Face folder or .gguf sharing the target's tokenizer)")
        config = dict(ctx.config, model=self.model_name, decoding={"name": "sample", "options": {}})
        self.draft = ctx.build_pipeline(config, self.overrides)
        ours, theirs = ctx.model.vocab_size, self.draft.model.vocab_size
        if ours != theirs or ctx.vocab_size != self.draft.vocab_size:
            raise ConfigError(f"decoding.options.draft_model: {self.model_name!r} has a vocabulary of {theirs} "
                              f"({self.draft.vocab_size} tokenizer entries), the target {ours} "
                              f"({ctx.vocab_size}); a draft model must share the target's tokenizer")
        if self.draft.device != ctx.device:
            raise ConfigError(f"the draft model resolved to {self.draft.device}, the target to "
                              f"{ctx.device}; they must share a device")
        self._cost = self.draft.num_parameters / ctx.num_parameters

    @property
    def cost(self) -> float:
        return self._cost

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Draft]:
        cache = self.draft.cache
        views: list[Sequence] = []
        for seq, budget in zip(seqs, budgets):
            shadow = self._sync(seq) if budget > 0 else None
            if shadow is not None and not cache.can_reserve(shadow, shadow.num_tokens + budget - 1):
                self.finish(seq)  # no room in the draft's cache: this sequence goes undrafted
                shadow = None
            if shadow is not None:
                cache.reserve(shadow, shadow.num_tokens + budget - 1)
            views.append(shadow)
        live = [i for i, v in enumerate(views) if v is not None]
        drafts = draft_rounds([views[i] for i in live], [seqs[i] for i in live], [budgets[i] for i in live],
                              self.draft.run)
        out = [Draft([]) for _ in seqs]
        for i, draft in zip(live, drafts):
            out[i] = draft
            cache.commit(views[i])
        return out

    def _sync(self, seq: Sequence) -> Sequence:
        """The shadow of ``seq`` with the target's tokens, its KV kept where they agree."""
        cache = self.draft.cache
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Sequence(seq.request_id, seq.token_ids, seq.params, cache_salt=seq.cache_salt)
            shadow.num_computed_tokens = cache.match_prefix(shadow)
            self._shadows[seq.seq_id] = shadow
        else:
            same = _common_prefix(shadow.token_ids, seq.token_ids, self._synced.get(seq.seq_id, 0))
            del shadow.token_ids[same:]
            shadow.token_ids.extend(seq.token_ids[same:])
            if shadow.num_computed_tokens > same:
                shadow.num_computed_tokens = same
                cache.truncate(shadow, same)
        self._synced[seq.seq_id] = seq.num_tokens
        return shadow

    def finish(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq.seq_id, None)
        self._synced.pop(seq.seq_id, None)
        if shadow is not None:
            self.draft.cache.free(shadow)

