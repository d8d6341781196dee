"""Pooler `mean`: the mean of every token's hidden state (most BERT-family embedding models:
all-MiniLM, E5, GTE; sentence-transformers' "mean" mode). It reads every row, so its requests
reuse no cached prefix."""

from __future__ import annotations

import torch

import tessellm
from tessellm.plugins.pooling.common import EmbeddingPooler, accumulation_dtype


class MeanPooler(EmbeddingPooler):
    """The mean of the tokens' final hidden states (summed in float32 at least), then Dense
    modules, dimensions and normalisation."""

    name = "mean"
    api_version = "1.19"
    description = "embedding: the mean of the tokens' hidden states (sentence-transformers 'mean')"
    modes = frozenset({"mean"})
    auto_priority = 10
    rows = "all"

    def reduce(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.sum(dim=0, dtype=accumulation_dtype(rows.dtype)) / rows.shape[0]


@tessellm.hookimpl
def register_pooling(register):
    register(MeanPooler)
