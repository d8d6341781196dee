"""The pooling kind (plugin API 1.18): the step after the model in an embedding or scoring
pipeline, turning a sequence's final hidden states into what its request returns: an
embedding (a vector) or scores (one per label).

A pipeline with a pooler prefills each request's prompt and decodes nothing: once the
prompt's last chunk has run, the engine hands the pooler the sequence's final hidden states
(after the model's final norm; the rows ``rows`` names, gathered across chunks) and the
request is done. Which pooler serves a checkpoint: the one a config's ``pooling`` section
names, or under ``auto`` the one whose ``modes`` hold what the checkpoint's own files say
(``CheckpointPooling``: sentence-transformers' ``modules.json`` and ``1_Pooling/config.json``,
or a sequence-classification architecture); a checkpoint that says nothing gets none, and the
pipeline generates.

    class MaxPooling(tessellm.Pooler):
        name = "max"
        api_version = "1.18"
        modes = frozenset({"max"})
        rows = "all"

        def pool(self, hidden, params):
            return [self.finish_embedding(h.float().amax(dim=0), p) for h, p in zip(hidden, params)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.spec import ModelSpec
from tessellm.core.plugin import Plugin, PluginOptions, SelectionContext, reject_booleans_for_numbers

Rows = Literal["first", "last", "all"]
TASKS = ("embed", "score")


class PoolingParams(BaseModel):
    """How one pooling request's output is finished (the request's counterpart of
    ``SamplingParams``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    dimensions: Optional[int] = Field(None, ge=1)
    """Keep the embedding's first ``dimensions`` values (Matryoshka truncation), before it is
    normalised; None: all of them. Embeddings only."""
    normalize: Optional[bool] = None
    """Scale the embedding to unit length; None: as the pooler's options and the checkpoint
    say (sentence-transformers' ``Normalize`` module)."""
    use_activation: Optional[bool] = None
    """Apply the scores' activation (a sigmoid for one label, as sentence-transformers'
    CrossEncoder does); None: the pooler's default. Scores only."""

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        return reject_booleans_for_numbers(cls, data)


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers ``Dense`` module after pooling: ``activation(x @ weight.T + bias)``,
    weight [out, in]; ``activation`` one of ``DENSE_ACTIVATIONS``."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    activation: str = "identity"


DENSE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x, "tanh": torch.tanh, "relu": torch.relu, "gelu": torch.nn.functional.gelu,
    "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu}


@dataclass(frozen=True)
class CheckpointPooling:
    """What a checkpoint's own files say about pooling (read by
    ``tessellm.core.model.sentence_transformers``).

    ``mode``: sentence-transformers' pooling mode ("cls", "mean", "lasttoken", "max", ...),
    "classify" for a sequence-classification head (``*ForSequenceClassification``), or None
    (nothing said: the pipeline generates). ``source`` says which file decided it.
    Embeddings: ``normalize`` (a ``Normalize`` module follows), ``dense`` (``Dense`` modules
    after pooling, in order), ``include_prompt`` (False: a prompt's tokens are left out of
    the pooled rows), ``prompts`` and ``default_prompt_name`` (texts put before the input, by
    name), ``max_seq_length`` and ``do_lower_case`` (how sentence-transformers tokenizes),
    ``similarity`` (the score of two embeddings). Scores: ``num_labels`` and ``activation``
    ("sigmoid", "identity" or "softmax"; None: sigmoid for one label, identity for more)."""

    mode: str | None = None
    source: str = "nothing: no sentence-transformers files and no classification head"
    normalize: bool = False
    dense: tuple[DenseLayer, ...] = ()
    include_prompt: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None
    do_lower_case: bool = False
    similarity: str = "cosine"
    num_labels: int = 1
    activation: str | None = None


@dataclass
class PoolingContext:
    """What a pooler is built with: the ``model``'s spec, what the ``checkpoint`` says, the
    ``device`` and compute ``dtype``, and the model's heads it may read:

    - ``lm_head_rows(token_ids)``: those rows of the LM head's weight, [n, hidden] (None where
      the model has no LM head; a pooler with ``uses_lm_head`` gets it);
    - ``classify(x)``: the model's sequence-classification head, [B, hidden] -> [B, num_labels]
      (None where it has none), and ``classify_rows``, the rows it reads ("first", "last",
      or "all" averaged);
    - ``token_id(text)``: the vocabulary id of a one-token text (None if it is not one token).
    """

    model: ModelSpec
    checkpoint: CheckpointPooling
    device: torch.device
    dtype: torch.dtype
    lm_head_rows: Callable[[list[int]], torch.Tensor] | None = None
    classify: Callable[[torch.Tensor], torch.Tensor] | None = None
    classify_rows: Rows = "first"
    token_id: Callable[[str], int | None] = lambda text: None


class Pooler(Plugin):
    """Turns each finished sequence's hidden states into its output.

    Contract:
    - ``task``: "embed" (outputs are embeddings, 1-D float32) or "score" (one float32 score
      per label); ``modes``: the checkpoint pooling modes (``CheckpointPooling.mode``) it
      implements, which is how ``auto`` picks it; ``uses_lm_head``: it reads the LM head
      (``PoolingContext.lm_head_rows``; else a checkpoint without one loads).
    - ``__init__(options, ctx)`` with a ``PoolingContext``; ``rows``: which of a sequence's
      hidden states it reads ("first", "last", or "all" of them, in order).
    - ``pool(hidden, params)``: ``hidden[i]`` is sequence i's rows ([1, hidden] for first or
      last, [L, hidden] for all) in the compute dtype, ``params[i]`` its ``PoolingParams``;
      returns one 1-D float32 tensor per sequence. A sequence's output depends on its own
      rows only (never on the batch it ran in).
    - ``width``: an embedding's length (before ``dimensions`` cuts it) or the number of
      scores; ``check(params)`` refuses (``InvalidRequestError``) what it cannot serve.
    - ``encode_pair(tokenizer, query, document, max_length)``: how a scoring pipeline turns a
      (query, document) pair into one input, at most ``max_length`` tokens when it is given
      (a request asked for truncation): (token ids, token type ids or None).
    """

    kind: ClassVar[str] = "pooling"
    task: ClassVar[str] = "embed"
    modes: ClassVar[frozenset[str]] = frozenset()
    uses_lm_head: ClassVar[bool] = False
    rows: Rows = "last"
    required: ClassVar[tuple[str, ...]] = ("pool",)

    def __init__(self, options: PluginOptions, ctx: PoolingContext):
        self.options = options
        self.ctx = ctx

    @classmethod
    def unsupported_reasons(cls, ctx: SelectionContext) -> list[str]:
        """Under ``auto``, a pooler serves only the checkpoint whose pooling mode it implements."""
        reasons = super().unsupported_reasons(ctx)
        said = getattr(ctx, "pooling", None)
        mode = said.mode if said is not None else None
        if ctx.auto and mode not in cls.modes:
            reasons.append(f"implements pooling modes {', '.join(sorted(cls.modes)) or '(none)'}; the checkpoint's "
                           f"is {mode!r} ({said.source if said is not None else 'not read'})")
        return reasons

    def pool(self, hidden: list[torch.Tensor], params: list[PoolingParams]) -> list[torch.Tensor]:
        """One output per sequence (see the class contract)."""
        raise NotImplementedError

    @property
    def width(self) -> int:
        """An embedding's length before ``dimensions`` (the hidden size, or the last Dense
        module's output), or the number of scores."""
        dense = self.ctx.checkpoint.dense
        return int(dense[-1].weight.shape[0]) if dense else self.ctx.model.hidden_size

    def check(self, params: PoolingParams) -> None:
        """InvalidRequestError naming the field a request asks of this pooler beyond what it serves."""
        if self.task == "embed":
            if params.use_activation is not None:
                raise InvalidRequestError(f"use_activation applies to scores; pooling plugin {self.name!r} embeds")
            if params.dimensions is not None and params.dimensions > self.width:
                raise InvalidRequestError(f"dimensions: {params.dimensions} is more than the embedding's "
                                          f"{self.width} values; ask for at most {self.width}")
        else:
            for name in ("dimensions", "normalize"):
                if getattr(params, name) is not None:
                    raise InvalidRequestError(f"{name} applies to embeddings; pooling plugin {self.name!r} scores "
                                              f"(query, document) pairs")

    def encode_pair(self, tokenizer: Any, query: str, document: str,
                    max_length: int | None = None) -> tuple[list[int], list[int] | None]:
        """A (query, document) pair as one input, as a cross-encoder is trained: the
        tokenizer's pair encoding (``[CLS] query [SEP] document [SEP]``, with token types);
        ``max_length``: its own truncation (the longer text first, special tokens kept), as
        sentence-transformers' CrossEncoder truncates."""
        encoded = tokenizer(query, document, **({"truncation": True, "max_length": max_length} if max_length else {}))
        return list(encoded["input_ids"]), (list(encoded["token_type_ids"]) if "token_type_ids" in encoded else None)

    # ------------------------------------------------------------------ helpers for plugins

    def finish_embedding(self, pooled: torch.Tensor, params: PoolingParams, normalize: bool | None = None) -> torch.Tensor:
        """The contract's last steps of an embedding: the checkpoint's Dense modules, then
        ``params.dimensions`` (Matryoshka: the first values), then unit length when
        ``params.normalize`` asks (None: ``normalize``, else the checkpoint's Normalize)."""
        x = pooled.float() if pooled.dtype != torch.float64 else pooled
        for layer in self.ctx.checkpoint.dense:
            x = DENSE_ACTIVATIONS[layer.activation](torch.nn.functional.linear(
                x, layer.weight.to(x), None if layer.bias is None else layer.bias.to(x)))
        if params.dimensions is not None:
            x = x[..., :params.dimensions]
        unit = params.normalize if params.normalize is not None else (
            normalize if normalize is not None else self.ctx.checkpoint.normalize)
        if unit:
            x = torch.nn.functional.normalize(x, dim=-1)
        return x.float()
