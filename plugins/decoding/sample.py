"""Decoding `sample`: temperature, top-k, top-p and min-p sampling with a generator per request.

Each sequence draws from its own ``torch.Generator`` (seeded from the request's ``seed``),
so a request's tokens do not depend on what else is in the batch. Temperature 0 is greedy.
"""

from __future__ import annotations

import torch

import tessellm
from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.decoder import Decoder, slot_logits
from tessellm.core.interfaces.sequence import SamplingParams


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Scale by temperature, then keep the top_k tokens (0: all), then the smallest set of
    those whose probability mass reaches top_p, and of those only the tokens at least min_p
    times as likely as the most likely one; everything else becomes -inf.

    logits [R, V] float; temperature [R] (> 0), top_k [R] int, top_p [R] in (0, 1], min_p [R]
    in [0, 1] (None: 0).
    """
    scaled = logits / temperature[:, None]
    kept = _top_k_top_p(scaled, top_k, top_p)
    if min_p is None or not bool((min_p > 0).any()):
        return kept
    # the min_p cut is relative to the most likely token, which every filter keeps: applied
    # last, as an intersection. p >= min_p * p_max <=> logit >= max logit + log(min_p).
    floor = scaled.max(dim=-1, keepdim=True).values + min_p.to(scaled.dtype).log()[:, None]
    return kept.masked_fill(scaled < floor, float("-inf"))


def _top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = scaled.shape[-1]
    if bool((top_p >= 1.0).all()):  # no nucleus: skip the full-vocabulary sort
        if not bool((top_k > 0).any()):
            return scaled
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        _, best = scaled.topk(int(k.max()), dim=-1)  # [R, max k], most likely first
        keep = torch.arange(best.shape[1], device=scaled.device)[None, :] < k[:, None]
        mask = torch.zeros_like(scaled, dtype=torch.bool).scatter(-1, best, keep)
        return scaled.masked_fill(~mask, float("-inf"))
    ordered, order = scaled.sort(dim=-1, descending=True)  # [R, V]
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    drop = ranks >= k[:, None]
    probs = ordered.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    drop |= mass_before >= top_p[:, None]  # already reached p without it
    drop[:, 0] = False  # the most likely token always stays
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, ordered.masked_fill(drop, float("-inf")))


def sampling_tensors(params: list[SamplingParams], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per-row temperature, top_k, top_p and min_p tensors for ``filter_logits``."""
    temperature = torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    return temperature, top_k, top_p, min_p


class SampleDecoder(Decoder):
    """Samples each sequence's next token from its filtered distribution with its own
    generator; rows with temperature 0 take the argmax. Reproducible: the same request
    (prompt, params, seed) gives the same tokens in any batch."""

    name = "sample"
    api_version = "1.19"
    description = "temperature / top-k / top-p / min-p sampling with per-request seeds (temperature 0: greedy)"
    auto_priority = 10
    request_fields = frozenset({"temperature", "top_k", "top_p", "min_p", "seed", "n"})
    device_tokens_any_dtype = True  # device_tokens serves temperature 0 only: an argmax

    def decode(self, logits: torch.Tensor, batch: BatchMetadata) -> list[list[int]]:
        # logits: [R, vocab] float32
        logits = slot_logits(logits, batch)
        params = [s.seq.params for s in batch.samples]
        tokens = logits.argmax(dim=-1).tolist()
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            filtered = filter_logits(logits[idx], *sampling_tensors([params[i] for i in sampled], logits.device))
            probs = filtered.softmax(dim=-1).cpu()
            for j, i in enumerate(sampled):
                gen = batch.samples[i].seq.generator
                tokens[i] = int(torch.multinomial(probs[j], 1, generator=gen))
        return [[t] for t in tokens]

    def samples_on_device(self, params: SamplingParams) -> bool:
        return params.temperature == 0  # seeded sampling draws from CPU generators

    def device_tokens(self, logits: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
        return slot_logits(logits, batch).argmax(dim=-1)


@tessellm.hookimpl
def register_decoding(register):
    register(SampleDecoder)
