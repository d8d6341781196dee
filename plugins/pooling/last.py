"""Pooler `last`: the last token's hidden state (decoder embedding models: Qwen3-Embedding,
gte-Qwen2, E5-Mistral; sentence-transformers' "lasttoken" mode). It reads one row per
sequence, so a cached prefix serves it as it serves generation."""

from __future__ import annotations

import torch

import tessellm
from tessellm.plugins.pooling.common import EmbeddingPooler


class LastTokenPooler(EmbeddingPooler):
    """The last token's final hidden state, then Dense modules, dimensions and normalisation."""

    name = "last"
    api_version = "1.19"
    description = "embedding: the last token's hidden state (sentence-transformers 'lasttoken')"
    modes = frozenset({"lasttoken"})
    auto_priority = 10
    rows = "last"

    def reduce(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[-1]


@tessellm.hookimpl
def register_pooling(register):
    register(LastTokenPooler)
