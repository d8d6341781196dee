"""A deliberately broken sampler for checking the decoding conformance suite's power: it
samples as if every request's top_p were 1, so it draws tokens top_p should have removed."""

from __future__ import annotations

import torch

import tessellm
from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.decoder import slot_logits
from tessellm.plugins.decoding.sample import SampleDecoder, filter_logits, sampling_tensors


class BrokenTopPDecoder(SampleDecoder):
    """`sample` with top_p ignored: temperature and top_k honoured, the nucleus never cut.
    Not a plugin to use: the decoding suite must fail it on its top_p cases."""

    name = "broken-top-p"
    api_version = "1.1"
    description = "sample, ignoring top_p (a conformance-suite test fixture)"
    auto_priority = None

    def decode(self, logits: torch.Tensor, batch: BatchMetadata) -> list[list[int]]:
        logits = slot_logits(logits, batch)
        tokens = logits.argmax(dim=-1).tolist()
        sampled = [i for i, s in enumerate(batch.samples) if s.seq.params.temperature > 0]
        if sampled:
            params = [batch.samples[i].seq.params for i in sampled]
            temperature, top_k, top_p, min_p = sampling_tensors(params, logits.device)
            index = torch.tensor(sampled, device=logits.device)
            kept = filter_logits(logits[index], temperature, top_k, torch.ones_like(top_p), min_p)  # top_p ignored
            probs = kept.softmax(dim=-1).cpu()
            for row, i in enumerate(sampled):
                tokens[i] = int(torch.multinomial(probs[row], 1, generator=batch.samples[i].seq.generator))
        return [[t] for t in tokens]


@tessellm.hookimpl
def register_decoding(register):
    register(BrokenTopPDecoder)
