"""Pooler `classify`: a sequence-classification head's scores (cross-encoder rerankers: BGE
reranker and ms-marco MiniLM on BERT and XLM-RoBERTa, gte-reranker on ModernBERT). The model
plugin builds the head (``classify``) and says which rows it reads (``classify_rows``: BERT's
and RoBERTa's [CLS], ModernBERT's [CLS] or mean); the scores then go through the
activation sentence-transformers' CrossEncoder applies: the one the checkpoint names, else a
sigmoid for one label and none for more."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

import tessellm
from tessellm.core.errors import ConfigError
from tessellm.core.interfaces.pooling import DENSE_ACTIVATIONS, Pooler, PoolingContext, PoolingParams
from tessellm.core.plugin import PluginOptions
from tessellm.plugins.pooling.common import accumulation_dtype

ACTIVATIONS = {**DENSE_ACTIVATIONS, "softmax": lambda x: torch.softmax(x, dim=-1)}
"""The activations a checkpoint's ``activation_fn`` may name for its scores: a Dense module's
(torch.nn's Identity, Tanh, ReLU, GELU, Sigmoid, SiLU) and Softmax over the labels."""


class ClassifyOptions(PluginOptions):
    """Options of the `classify` pooler."""

    activation: Literal["auto", "sigmoid", "identity", "softmax", "tanh", "relu", "gelu", "silu"] = Field("auto")
    """What the head's logits go through: ``auto`` is the checkpoint's (config.json's
    ``sentence_transformers.activation_fn``), else a sigmoid for one label and none for more,
    as sentence-transformers' CrossEncoder does. A request's ``use_activation`` false skips it."""


class ClassifyPooler(Pooler):
    """The model's sequence-classification head over its [CLS] (or mean, or last) row."""

    name = "classify"
    api_version = "1.19"
    description = "scores: a sequence-classification head (cross-encoder rerankers)"
    Options = ClassifyOptions
    task = "score"
    modes = frozenset({"classify"})
    auto_priority = 10

    def __init__(self, options: ClassifyOptions, ctx: PoolingContext):
        super().__init__(options, ctx)
        if ctx.classify is None:
            raise ConfigError(f"pooling.name: 'classify' needs a sequence-classification head, and this "
                              f"{ctx.model.model_type!r} model has none (its checkpoint's pooling: "
                              f"{ctx.checkpoint.source}); name an embedding pooler instead")
        self.rows = ctx.classify_rows
        said = ctx.checkpoint
        chosen = options.activation if options.activation != "auto" else said.activation
        self.activation = chosen or ("sigmoid" if said.num_labels == 1 else "identity")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"pooling: the checkpoint names activation {self.activation!r} for its scores; "
                              f"set pooling.options.activation to one of {', '.join(ACTIVATIONS)}")

    @property
    def width(self) -> int:
        return self.ctx.checkpoint.num_labels

    def pool(self, hidden: list[torch.Tensor], params: list[PoolingParams]) -> list[torch.Tensor]:
        # a mean is summed and divided in the accumulation dtype, as the mean pooler's, then
        # handed to the head in the model's dtype
        pooled = torch.stack([(rows.sum(dim=0, dtype=accumulation_dtype(rows.dtype)) / rows.shape[0]).to(rows.dtype)
                              if self.rows == "all" else rows[0 if self.rows == "first" else -1] for rows in hidden])
        logits = self.ctx.classify(pooled).float()  # [B, labels]
        act = ACTIVATIONS[self.activation]
        return [act(row) if p.use_activation is not False else row for row, p in zip(logits, params)]


@tessellm.hookimpl
def register_pooling(register):
    register(ClassifyPooler)
