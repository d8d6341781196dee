"""What the embedding poolers share: their options (the checkpoint's normalisation,
overridable) and the loop that reduces each sequence's rows and finishes the embedding
(Dense modules, Matryoshka ``dimensions``, unit length)."""

from __future__ import annotations

from typing import Optional

import torch

from tessellm.core.interfaces.pooling import Pooler, PoolingParams
from tessellm.core.plugin import PluginOptions


class EmbeddingOptions(PluginOptions):
    """Options of an embedding pooler."""

    normalize: Optional[bool] = None
    """Scale embeddings to unit length; None: as the checkpoint says (a sentence-transformers
    ``Normalize`` module). A request's ``normalize`` overrides both."""


class EmbeddingPooler(Pooler):
    """A pooler reducing a sequence's rows to one vector (``reduce``), then finishing it."""

    task = "embed"
    Options = EmbeddingOptions

    def reduce(self, rows: torch.Tensor) -> torch.Tensor:
        """The sequence's rows ([1, H] or [L, H], as the pooler's ``rows`` asks) -> one vector
        [H]; each embedding pooler overrides it with its reduction (first row, last row, mean)."""
        raise NotImplementedError

    def pool(self, hidden: list[torch.Tensor], params: list[PoolingParams]) -> list[torch.Tensor]:
        return [self.finish_embedding(self.reduce(rows), p, self.options.normalize) for rows, p in zip(hidden, params)]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums run in float32 at least (float64 stays float64), as sentence-transformers' do."""
    return torch.promote_types(dtype, torch.float32)
