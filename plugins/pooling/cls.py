"""Pooler `cls`: the first token's hidden state (BERT's [CLS]: BGE, Snowflake Arctic-Embed;
sentence-transformers' "cls" mode, and the default of an encoder checkpoint without
sentence-transformers files)."""

from __future__ import annotations

import torch

import tessellm
from tessellm.plugins.pooling.common import EmbeddingPooler


class ClsPooler(EmbeddingPooler):
    """The first token's final hidden state, then Dense modules, dimensions and normalisation."""

    name = "cls"
    api_version = "1.19"
    description = "embedding: the first ([CLS]) token's hidden state (sentence-transformers 'cls')"
    modes = frozenset({"cls"})
    auto_priority = 10
    rows = "first"

    def reduce(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[0]


@tessellm.hookimpl
def register_pooling(register):
    register(ClsPooler)
