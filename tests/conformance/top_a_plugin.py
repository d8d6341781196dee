"""A top-a sampler, as a third-party author would write it: the standard filters, then the
tokens whose probability is below ``top_a * p_max ** 2`` are cut and the rest renormalised.
``top_a`` is a per-request setting (``extra_args``, declared by ``RequestArgs``), and the
sampler declares its distribution through ``target_probs``, which the decoding suite checks
its draws against."""

from __future__ import annotations

import torch
from pydantic import Field

import tessellm
from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.decoder import Decoder, slot_logits
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.core.plugin import PluginOptions
from tessellm.plugins.decoding.sample import filter_logits, sampling_tensors
from tessellm.testing import reference_probs


class TopAArgs(PluginOptions):
    """The per-request settings of `top-a`."""

    top_a: float = Field(0.0, ge=0.0, le=1.0)
    """Keep tokens with probability at least top_a * p_max ** 2 (p_max: the most likely
    token's probability after the other filters); 0 keeps all."""


def top_a_cut(probs: torch.Tensor, top_a: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (rows summing to 1), top_a [R]: each row without the tokens below
    top_a * p_max ** 2, renormalised. The most likely token always stays (p_max >= p_max ** 2)."""
    floor = top_a[:, None] * probs.max(dim=-1, keepdim=True).values ** 2
    kept = probs.masked_fill(probs < floor, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


class TopADecoder(Decoder):
    """Temperature, top-k, top-p and min-p as `sample` does, then the top-a cut; a generator
    per request; temperature 0 is greedy."""

    name = "top-a"
    api_version = "1.6"
    description = "sample with a top-a cut (extra_args.top_a; a conformance-suite test plugin)"
    auto_priority = None
    RequestArgs = TopAArgs

    def target_probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
        top_a = self.request_args(params).top_a
        if top_a == 0 or params.greedy:
            return None  # the standard rule
        return top_a_cut(reference_probs(logits, params)[None], torch.tensor([top_a], dtype=torch.float64))[0]

    def decode(self, logits: torch.Tensor, batch: BatchMetadata) -> list[list[int]]:
        logits = slot_logits(logits, batch)  # [R, vocab]
        params = [s.seq.params for s in batch.samples]
        tokens = logits.argmax(dim=-1).tolist()
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        if sampled:
            chosen = [params[i] for i in sampled]
            rows = torch.tensor(sampled, device=logits.device)
            probs = filter_logits(logits[rows], *sampling_tensors(chosen, logits.device)).softmax(dim=-1)
            top_a = torch.tensor([self.request_args(p).top_a for p in chosen], dtype=probs.dtype, device=probs.device)
            probs = top_a_cut(probs, top_a).cpu()
            for row, i in enumerate(sampled):
                tokens[i] = int(torch.multinomial(probs[row], 1, generator=batch.samples[i].seq.generator))
        return [[t] for t in tokens]


@tessellm.hookimpl
def register_decoding(register):
    register(TopADecoder)
