"""Decoding `greedy`: the most likely token, every time."""

from __future__ import annotations

import torch

import tessellm
from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.decoder import Decoder, slot_logits
from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.sequence import SamplingParams


class GreedyDecoder(Decoder):
    """Argmax of each sequence's last logits row. Requests that ask for sampling are refused
    (not silently decoded greedily): pick `sample` for those."""

    name = "greedy"
    api_version = "1.19"
    description = "argmax decoding; refuses requests that ask for sampling"
    auto_priority = 5
    # the argmax is what every setting of these keeps; other temperatures are refused (check)
    request_fields = frozenset({"temperature", "top_k", "top_p", "min_p", "seed", "n"})
    device_tokens_any_dtype = True  # an argmax: bfloat16 logits give the same tokens

    def check(self, params: SamplingParams) -> None:
        if not params.greedy:
            raise InvalidRequestError(
                f"decoding plugin 'greedy' only decodes greedily, but the request asks for temperature="
                f"{params.temperature} (top_k={params.top_k}); set temperature 0 or use decoding.name=sample",
                field="temperature")

    def decode(self, logits: torch.Tensor, batch: BatchMetadata) -> list[list[int]]:
        # logits: [R, vocab] float32
        return [[t] for t in self.device_tokens(logits, batch).tolist()]

    def samples_on_device(self, params: SamplingParams) -> bool:
        return True

    def device_tokens(self, logits: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
        return slot_logits(logits, batch).argmax(dim=-1)


@tessellm.hookimpl
def register_decoding(register):
    register(GreedyDecoder)
