"""The building block of encoder-only models (BERT, RoBERTa, ModernBERT): ``EncoderModel``,
the base their model plugins' modules share.

An encoder's layers attend both ways (``LayerAttention.causal`` False) through the same
attention backend and paged cache as a decoder's: its sequences run whole in one prefill
step, and the K/V stored there is freed when the step's requests finish. Its module keeps
``DecoderForCausalLM``'s forward signature and returns the final hidden states of the rows
asked for (a pooling pipeline's ``hidden_states=True``; it has no LM head, so it cannot
generate), optionally reading each token's type id (``uses_token_types``: BERT's segments
of a (query, document) pair). A checkpoint with a sequence-classification head gets
``classify`` (pooled rows [B, hidden] -> logits [B, num_labels]) and ``classify_rows``, the
rows the head reads ("first": [CLS]; "all": their mean; "last").
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tessellm.core.interfaces.attention import AttentionBackend
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.model.decoder import Attention

ENCODER_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                       "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                       "gelu_fast": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu,
                       "swish": F.silu, "tanh": torch.tanh}
"""Hugging Face ``hidden_act`` names an encoder's MLP and head serve ("gelu" is the exact,
erf form)."""


class EncoderModel(nn.Module):
    """Base of an encoder's module: ``embed`` the tokens, run ``layers``, apply
    ``final_norm`` (Identity where the layers end normalised), return the rows asked for.
    Subclasses build ``layers`` (each called as ``layer(x, backend, cache, plan)``) and may set
    ``classifier_head`` (with ``classify``)."""

    uses_token_types = False
    """Whether ``forward`` reads ``token_type_ids`` (BERT's segment embeddings)."""
    classify_rows = "first"
    """The rows the classification head reads: "first", "last", or "all" (their mean)."""
    has_classifier = False
    """Whether the module has a sequence-classification head (``classify``); set by a subclass
    that builds one."""
    supports_fused = False

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList()
        self.final_norm: nn.Module = nn.Identity()
        self.fused = False

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """[T] ids and positions (and type ids) -> [T, hidden]: each architecture's embeddings
        (word, position, token type, and the norm after them where it has one); every encoder
        module overrides it."""
        raise NotImplementedError

    def layer_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[Any, Any]]:
        """(cos, sin) per layer for RoPE, or (None, None) where a layer has none (BERT's)."""
        return [(None, None)] * len(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
                backend: AttentionBackend, cache: CacheManager, plan: Any, layers: Sequence[int] | None = None,
                logits_out: torch.Tensor | None = None, native_logits: bool = False, hidden_states: bool = True,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> the final hidden states of rows ``logits_indices``,
        [R, hidden] in the model's dtype (an encoder has no logits: ``hidden_states`` is
        implied)."""
        x = self.embed(input_ids, positions, token_type_ids)  # [T, hidden]
        rope = self.layer_inputs(positions, x.dtype)
        for i in range(len(self.layers)) if layers is None else layers:
            x = self.layers[i](x, *rope[i], backend, cache, plan)
        return self.final_norm(x[logits_indices])

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """The sequence-classification head: pooled rows [B, hidden] -> logits [B, num_labels]."""
        raise RuntimeError(f"this {type(self).__name__} has no classification head")

    def fuse_projections(self) -> None:
        """Stack each layer's q/k/v projections into one GEMM (after loading)."""
        for layer in self.layers:
            attention = getattr(layer, "attention", None) or getattr(layer, "attn", None)
            if isinstance(attention, Attention):
                attention.fuse_projections()

    def cuda_graphs_unsupported(self) -> str | None:
        return "an encoder runs prefills only (no decode steps to replay)"
