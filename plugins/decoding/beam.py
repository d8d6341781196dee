"""Decoding `beam`: beam search over copy-on-write forks, as transformers' ``generate(num_beams=k,
do_sample=False)`` runs it, beside greedy and sampled requests in the same batch.

A request asking for ``num_beams`` k > 1 (its ``extra_args``, or the plugin's option for every
greedy request) runs as k sequences once its prompt is done, stepped together (``joint``).
Each step the decoder scores every beam's continuations (the beam's sum of log-probabilities
plus the token's), keeps the best ``max(2, 1 + number of EOS ids) * k``, moves those that end
(an EOS, or the last token ``max_tokens`` allows) into the finished hypotheses (scored over
their length to the power ``length_penalty``; the k best kept) and continues with the k best
that do not. The engine regroups the beams (``DecoderContext.reassign``): a beam that
continues another's tokens takes over that beam's cache blocks by reference, so beams share
every block but the ones they write. The search stops as transformers' does (``early_stopping``
True, False or "never"), and the request returns the ``n`` best hypotheses with their scores
(``Sequence.score``). Requests without beams sample as the `sample` decoder does.

Not combined with beams (refused at admission, with the reason): sampling (temperature > 0),
logits processors and penalties, ``logit_bias``, ``min_tokens``, stop strings and stop ids,
structured outputs, per-token ``logprobs``, and ``n`` above ``num_beams``.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
from pydantic import Field

import tessellm
from tessellm.core.errors import ConfigError, InvalidRequestError
from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.decoder import DecoderContext, slot_logits
from tessellm.core.interfaces.logits import PROCESSOR_FIELDS
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.core.plugin import PluginOptions
from tessellm.plugins.decoding.sample import SampleDecoder

NEG = -1.0e9  # transformers' "impossible" score offset, kept bit for bit so ties break alike
EarlyStopping = bool | Literal["never"]


class BeamOptions(PluginOptions):
    """Defaults for requests that do not set their own (``extra_args``)."""

    num_beams: int = Field(1, ge=1, le=64)
    """Beams of a greedy request (temperature 0) that names none; 1: such requests decode greedily."""
    length_penalty: float = 1.0
    """Finished hypotheses score their log-probability over length ** length_penalty (> 0 favours long ones)."""
    early_stopping: EarlyStopping = False
    """transformers' meaning: True stops once num_beams hypotheses are finished; False when no running
    beam can beat them at its current length (a heuristic); "never" only when none can at any length."""


class BeamArgs(PluginOptions):
    """Per request, in ``SamplingParams.extra_args``; unset: the plugin's options."""

    num_beams: int | None = Field(None, ge=1, le=64)
    length_penalty: float | None = None
    early_stopping: EarlyStopping | None = None


class BeamState:
    """One request's search: running beam scores, finished hypotheses (k best), and the
    early-stop heuristic, updated as transformers' vectorized beam search updates them."""

    def __init__(self, num_beams: int, length_penalty: float, early_stopping: EarlyStopping):
        k = num_beams
        self.k, self.length_penalty, self.early_stopping = k, length_penalty, early_stopping
        self.running = torch.full((k,), NEG, dtype=torch.float32)
        self.running[0] = 0.0  # the first step expands one beam: the others start impossible
        self.finished_scores = torch.full((k,), NEG, dtype=torch.float32)
        self.is_finished = torch.zeros(k, dtype=torch.bool)
        self.finished: list[tuple[list[int], str] | None] = [None] * k
        self.improvable = True  # no running beam can beat the finished ones: False, for good

    def step(self, log_probs: torch.Tensor, outputs: Callable[[int], list[int]], generated: int, left: int,
             eos: frozenset[int]) -> tuple[list[int], list[int], bool]:
        """One step over ``log_probs`` [k, V] (float32): the parent and token of each new
        running beam, and whether the search is over. ``outputs(b)``: beam b's generated
        tokens (read only for the beams a finished hypothesis continues); ``generated``: their
        count; ``left``: tokens still allowed, this one included."""
        k, vocab = self.k, log_probs.shape[1]
        scores = (log_probs + self.running[:, None]).reshape(-1)
        top_scores, top_index = scores.topk(max(2, 1 + len(eos)) * k)
        beams, tokens = (top_index // vocab).tolist(), (top_index % vocab).tolist()
        ends = torch.tensor([left <= 1 or t in eos for t in tokens])
        running = top_scores + ends.to(torch.float32) * NEG
        chosen = running.topk(k).indices
        self._finish(top_scores, ends, beams, tokens, outputs, generated, eos)
        self.running = running[chosen]
        self._update_improvable(generated + 1, generated + left)
        over = not (self.improvable and not (bool(self.is_finished.all()) and self.early_stopping is True)
                    and not bool(ends.all()))
        return [beams[i] for i in chosen.tolist()], [tokens[i] for i in chosen.tolist()], over

    def _finish(self, top_scores: torch.Tensor, ends: torch.Tensor, beams: list[int], tokens: list[int],
                outputs: Callable[[int], list[int]], generated: int, eos: frozenset[int]) -> None:
        """Merge the candidates that end among the first k into the k best finished."""
        k = self.k
        just = ends & (torch.arange(len(tokens)) < k)
        scored = top_scores / ((generated + 1) ** self.length_penalty)
        scored += float(bool(self.is_finished.all()) and self.early_stopping is True) * NEG
        scored += float(not self.improvable) * NEG
        scored += (~just).to(torch.float32) * NEG
        merged = torch.cat((self.finished_scores, scored))
        order = merged.topk(k).indices.tolist()
        merged_finished = torch.cat((self.is_finished, just))
        entries = []
        for i in order:
            if i < k:
                entries.append(self.finished[i])
            else:
                c = i - k
                entries.append((outputs(beams[c]) + [tokens[c]], "stop" if tokens[c] in eos else "length"))
        self.finished_scores, self.is_finished, self.finished = merged[order], merged_finished[order], entries

    def _update_improvable(self, length: int, longest: int) -> None:
        """Whether the best running beam could still beat the worst finished hypothesis."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = longest
        best_possible = self.running[:1] / (length ** self.length_penalty)
        worst = torch.where(self.is_finished, self.finished_scores.min(), torch.tensor(NEG))
        self.improvable = self.improvable and bool((best_possible > worst).any())

    def results(self, n: int) -> list[tuple[list[int], float, str]]:
        out = []
        for i in range(n):
            tokens, reason = self.finished[i]
            out.append((tokens, float(self.finished_scores[i]), reason))
        return out


class BeamDecoder(SampleDecoder):
    """Beam search for requests with num_beams > 1; the `sample` decoder's rules for the rest."""

    name = "beam"
    api_version = "1.19"
    description = "beam search over copy-on-write forks (transformers' semantics), sampling for other requests"
    Options = BeamOptions
    RequestArgs = BeamArgs
    auto_priority = None  # not `sample`'s: only when named

    def __init__(self, options: BeamOptions, model, device):
        super().__init__(options, model, device)
        self._searches: dict[str, BeamState] = {}
        self.ctx: DecoderContext | None = None

    def attach(self, ctx: DecoderContext) -> None:
        if ctx.reassign is None or ctx.end_group is None:
            raise ConfigError("decoding 'beam' needs an engine that regroups sequences (plugin API 1.12's "
                              "DecoderContext.reassign and end_group)")
        self.ctx = ctx

    # ------------------------------------------------------------------ what a request asks

    def _setting(self, params: SamplingParams, name: str):
        args = self.request_args(params)
        value = getattr(args, name) if args is not None else None
        return getattr(self.options, name) if value is None else value

    def num_beams(self, params: SamplingParams) -> int:
        args = self.request_args(params)
        if args is not None and args.num_beams is not None:
            return args.num_beams
        return self.options.num_beams if params.temperature == 0 else 1

    def joint(self, params: SamplingParams) -> bool:
        return self.num_beams(params) > 1

    def sequences_per_request(self, params: SamplingParams) -> int:
        return self.num_beams(params) if self.joint(params) else params.n

    def samples_on_device(self, params: SamplingParams) -> bool:
        return not self.joint(params) and super().samples_on_device(params)

    def check(self, params: SamplingParams) -> None:
        super().check(params)
        k = self.num_beams(params)
        if k == 1:
            return
        defaults = SamplingParams.model_fields
        refused = [name for name in ("temperature", "min_tokens", "stop", "stop_token_ids", "logprobs",
                                     "structured_output", "logit_bias", "logits_processors", *PROCESSOR_FIELDS)
                   if getattr(params, name) != defaults[name].get_default(call_default_factory=True)]
        if refused:
            raise InvalidRequestError(f"beam search (num_beams {k}) does not combine with {', '.join(refused)}; "
                                      f"leave {'it' if len(refused) == 1 else 'them'} unset, or decode without "
                                      f"beams (num_beams 1)", field=refused[0])
        if params.n > k:
            raise InvalidRequestError(f"n ({params.n}) asks for more results than num_beams ({k}) keeps; "
                                      f"raise num_beams or lower n", field="n")

    # ------------------------------------------------------------------ a step

    def decode(self, logits: torch.Tensor, batch: BatchMetadata) -> list[list[int]]:
        tokens = super().decode(logits, batch)  # every slot; beams' rows are overwritten below
        groups: dict[str, list[int]] = {}
        for i, slot in enumerate(batch.samples):
            if slot.seq.joint:
                groups.setdefault(slot.seq.request_id, []).append(i)
        if groups:
            rows = slot_logits(logits, batch)
            for request_id, slots in groups.items():
                self._step(request_id, sorted(slots, key=lambda i: batch.samples[i].seq.sample_index),
                           rows, batch, tokens)
        return tokens

    def _step(self, request_id: str, slots: list[int], rows: torch.Tensor, batch: BatchMetadata,
              tokens: list[list[int]]) -> None:
        group = [batch.samples[i].seq for i in slots]
        params = group[0].params
        search = self._searches.get(request_id)
        first = search is None
        if first:  # the prompt's step: every beam reads the prompt's last row
            search = self._searches[request_id] = BeamState(
                len(group), self._setting(params, "length_penalty"), self._setting(params, "early_stopping"))
        if len(group) != search.k:
            raise RuntimeError(f"beam search of request {request_id!r} got {len(group)} of its {search.k} beams in "
                               f"one step; a joint request's beams must step together")
        log_probs = torch.log_softmax(rows[slots].float(), dim=-1).cpu()
        eos = frozenset() if params.ignore_eos else self.ctx.eos_token_ids
        head = group[0]
        parents, chosen, over = search.step(log_probs, lambda b: group[b].output_token_ids, head.num_output_tokens,
                                            self.ctx.tokens_left(head), eos)
        if over:
            del self._searches[request_id]
            self.ctx.end_group(group, search.results(params.n))
            return
        if not first:
            self.ctx.reassign(group, parents)
        for i, token in zip(slots, chosen):
            tokens[i] = [token]

    def finish(self, seq: Sequence) -> None:
        if seq.joint:
            self._searches.pop(seq.request_id, None)  # aborted, or ended: either way the search is over
        super().finish(seq)


@tessellm.hookimpl
def register_decoding(register):
    register(BeamDecoder)
