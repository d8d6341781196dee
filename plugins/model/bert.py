"""BERT, RoBERTa and XLM-RoBERTa encoders: embedding models (all-MiniLM, BGE, E5, GTE,
multilingual-E5) and cross-encoder rerankers (ms-marco MiniLM, BGE reranker).

Post-norm layers: attention (q/k/v/o with biases, no RoPE, both ways) added to the input and
normalised, then the MLP (``hidden_act``, not gated) added and normalised. The embedding sums
word, learned absolute position and token-type (segment) embeddings, then normalises;
RoBERTa's positions start after its padding id (``pad_token_id + 1``), so its usable length
is ``max_position_embeddings - pad_token_id - 1``. A ``*ForSequenceClassification``
checkpoint's head is built too: BERT's pooler (dense + tanh over [CLS]) then a linear
classifier; RoBERTa's dense + tanh + ``out_proj``. The module's names follow core's
attention block (q_proj, ...); ``checkpoint_name`` maps Hugging Face's onto them.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

import tessellm
from tessellm.core.errors import ModelLoadError
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.model.decoder import Attention
from tessellm.core.model.encoder import ENCODER_ACTIVATIONS, EncoderModel
from tessellm.core.model.spec import LayerAttention, ModelSpec, refuse_quantized

ROBERTA_TYPES = ("roberta", "xlm-roberta")

# Hugging Face's names -> the module's, after the base-model prefix is dropped
RENAMES = [(re.compile(r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\."),
            lambda m: f"layers.{m[1]}.attention.{m[2][0]}_proj."),
           (re.compile(r"^encoder\.layer\.(\d+)\.attention\.output\.dense\."), lambda m: f"layers.{m[1]}.attention.o_proj."),
           (re.compile(r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\."), lambda m: f"layers.{m[1]}.attention_norm."),
           (re.compile(r"^encoder\.layer\.(\d+)\.intermediate\.dense\."), lambda m: f"layers.{m[1]}.intermediate."),
           (re.compile(r"^encoder\.layer\.(\d+)\.output\.dense\."), lambda m: f"layers.{m[1]}.output."),
           (re.compile(r"^encoder\.layer\.(\d+)\.output\.LayerNorm\."), lambda m: f"layers.{m[1]}.output_norm.")]


class BertLayer(nn.Module):
    """Post-norm: x = norm(x + attention(x)); x = norm(x + output(act(intermediate(x))))."""

    def __init__(self, spec: ModelSpec, layer: int, act: Any):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.attention = Attention(spec, layer)
        self.attention_norm = nn.LayerNorm(h, eps=eps)
        self.intermediate = nn.Linear(h, spec.intermediate_size)
        self.output = nn.Linear(spec.intermediate_size, h)
        self.output_norm = nn.LayerNorm(h, eps=eps)
        self.act = act

    def forward(self, x, cos, sin, backend, cache, plan):
        x = self.attention_norm(x + self.attention(x, None, None, backend, cache, plan))
        return self.output_norm(x + self.output(self.act(self.intermediate(x))))


class BertEmbeddings(nn.Module):
    """word + position (at ``position + offset``) + token type, then LayerNorm."""

    def __init__(self, spec: ModelSpec, config: Any, offset: int):
        super().__init__()
        h = spec.hidden_size
        self.word_embeddings = nn.Embedding(spec.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(max(int(getattr(config, "type_vocab_size", 1) or 1), 1), h)
        self.LayerNorm = nn.LayerNorm(h, eps=spec.rms_norm_eps)
        self.offset = offset

    def forward(self, input_ids, positions, token_type_ids):
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(types)
        return self.LayerNorm(x + self.position_embeddings(positions + self.offset))


class BertPooler(nn.Module):
    """BERT's pooler: dense + tanh over the [CLS] row."""

    def __init__(self, h: int):
        super().__init__()
        self.dense = nn.Linear(h, h)

    def forward(self, x):
        return torch.tanh(self.dense(x))


class RobertaClassificationHead(nn.Module):
    """RoBERTa's head: dense + tanh + out_proj over the [CLS] (<s>) row."""

    def __init__(self, h: int, num_labels: int):
        super().__init__()
        self.dense = nn.Linear(h, h)
        self.out_proj = nn.Linear(h, num_labels)

    def forward(self, x):
        return self.out_proj(torch.tanh(self.dense(x)))


class BertEncoder(EncoderModel):
    """BERT / RoBERTa / XLM-RoBERTa, with a classification head when the checkpoint has one."""

    uses_token_types = True

    def __init__(self, spec: ModelSpec, head: str | None, num_labels: int, offset: int, act: Any):
        super().__init__()
        self.spec = spec
        self.embeddings = BertEmbeddings(spec, spec.hf_config, offset)
        self.layers = nn.ModuleList(BertLayer(spec, i, act) for i in range(spec.num_layers))
        self.has_classifier = head is not None
        if head == "bert":
            self.pooler = BertPooler(spec.hidden_size)
            self.classifier = nn.Linear(spec.hidden_size, num_labels)
        elif head == "roberta":
            self.classifier = RobertaClassificationHead(spec.hidden_size, num_labels)

    def embed(self, input_ids, positions, token_type_ids):
        return self.embeddings(input_ids, positions, token_type_ids)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "pooler"):
            pooled = self.pooler(pooled)
        return self.classifier(pooled)


class BertArchitecture(ModelArchitecture):
    """BERT, RoBERTa and XLM-RoBERTa encoders (post-norm, learned positions, both ways)."""

    name = "bert"
    api_version = "1.19"
    model_types = ("bert", "roberta", "xlm-roberta")

    def spec(self, hf_config: Any) -> ModelSpec:
        refuse_quantized(hf_config)
        kind = getattr(hf_config, "position_embedding_type", "absolute") or "absolute"
        if kind != "absolute":
            raise ModelLoadError(f"{hf_config.model_type} with position_embedding_type {kind!r} is not supported; "
                                 f"supported: absolute")
        act = getattr(hf_config, "hidden_act", "gelu")
        if act not in ENCODER_ACTIVATIONS:
            raise ModelLoadError(f"{hf_config.model_type} with hidden_act {act!r} is not supported; supported: "
                                 f"{', '.join(ENCODER_ACTIVATIONS)}")
        heads = hf_config.num_attention_heads
        usable = hf_config.max_position_embeddings - _offset(hf_config)
        return ModelSpec(
            model_type=hf_config.model_type, vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size, num_layers=hf_config.num_hidden_layers, num_heads=heads,
            num_kv_heads=heads, head_dim=hf_config.hidden_size // heads, rms_norm_eps=hf_config.layer_norm_eps,
            max_position_embeddings=usable, tie_word_embeddings=False, qkv_bias=True, o_bias=True, mlp_bias=True,
            sliding_window=None, rope_type="default", hf_config=hf_config,
            layer_attention=tuple(LayerAttention(rope=None, causal=False) for _ in range(hf_config.num_hidden_layers)))

    def build(self, spec: ModelSpec) -> nn.Module:
        config = spec.hf_config
        head = None
        if any(a.endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or []):
            head = "roberta" if config.model_type in ROBERTA_TYPES else "bert"
        return BertEncoder(spec, head, int(getattr(config, "num_labels", 1) or 1), _offset(config),
                           ENCODER_ACTIVATIONS[getattr(config, "hidden_act", "gelu")])

    def checkpoint_name(self, name: str) -> str | None:
        name = re.sub(r"^(bert|roberta)\.", "", name)
        for pattern, rename in RENAMES:
            match = pattern.match(name)
            if match:
                return rename(match) + name[match.end():]
        return name


def _offset(config: Any) -> int:
    """Where position 0's embedding sits: RoBERTa's positions start after its padding id."""
    return int(config.pad_token_id) + 1 if config.model_type in ROBERTA_TYPES else 0


@tessellm.hookimpl
def register_model(register):
    register(BertArchitecture)
