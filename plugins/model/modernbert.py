"""ModernBERT encoders (Answer.AI's; gte-modernbert, modernbert-embed, gte-reranker-modernbert).

Pre-norm layers without biases by default: LayerNorm (none before the first layer's
attention), attention from one fused ``Wqkv`` with RoPE, both ways; global layers every
``global_attn_every_n_layers`` (their own RoPE theta), the others local: a symmetric window
of ``local_attention // 2`` tokens each way; then LayerNorm and a GeGLU MLP (``Wi`` gives
input and gate, ``Wo`` projects back). The embedding is the token embedding, normalised; the
last layer's output goes through ``final_norm``. A ``ModernBertForSequenceClassification``
checkpoint's head (dense, activation, norm, over [CLS] or the mean as
``classifier_pooling`` says, then ``classifier``) is built too.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

import tessellm
from tessellm.core.errors import ModelLoadError
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.model.decoder import Attention, RotaryEmbedding
from tessellm.core.model.encoder import ENCODER_ACTIVATIONS, EncoderModel
from tessellm.core.model.spec import LayerAttention, ModelSpec, refuse_quantized

LAYER_TYPES = ("full_attention", "sliding_attention")


class ModernBertAttention(Attention):
    """Core's attention block with q/k/v stacked from the start (the checkpoint's ``Wqkv``
    holds them in that order), so every layer takes the stacked path."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__(spec, layer)
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = nn.Linear(spec.hidden_size, 3 * spec.num_heads * spec.head_dim, bias=spec.qkv_bias)


class ModernBertMLP(nn.Module):
    """GeGLU: Wo(act(input) * gate), with input and gate the two halves of Wi(x)."""

    def __init__(self, spec: ModelSpec, act: Any):
        super().__init__()
        self.Wi = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.Wo = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.act = act

    def forward(self, x):
        value, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(value) * gate)


class ModernBertLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, act: Any, norm: Any):
        super().__init__()
        self.attn_norm = nn.Identity() if layer == 0 else norm()
        self.attn = ModernBertAttention(spec, layer)
        self.mlp_norm = norm()
        self.mlp = ModernBertMLP(spec, act)

    def forward(self, x, cos, sin, backend, cache, plan):
        x = x + self.attn(self.attn_norm(x), cos, sin, backend, cache, plan)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertEmbeddings(nn.Module):
    def __init__(self, spec: ModelSpec, norm: Any):
        super().__init__()
        self.tok_embeddings = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.norm = norm()

    def forward(self, input_ids):
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertHead(nn.Module):
    """dense, activation, norm: what the classifier reads."""

    def __init__(self, spec: ModelSpec, config: Any, norm: Any):
        super().__init__()
        self.dense = nn.Linear(spec.hidden_size, spec.hidden_size, bias=bool(getattr(config, "classifier_bias", False)))
        self.act = ENCODER_ACTIVATIONS[getattr(config, "classifier_activation", "gelu")]
        self.norm = norm()

    def forward(self, x):
        return self.norm(self.act(self.dense(x)))


class ModernBertEncoder(EncoderModel):
    """ModernBERT, with its classification head when the checkpoint has one."""

    def __init__(self, spec: ModelSpec, head: bool):
        super().__init__()
        config = spec.hf_config
        self.spec = spec

        def norm() -> nn.LayerNorm:
            return nn.LayerNorm(spec.hidden_size, eps=spec.rms_norm_eps, bias=bool(getattr(config, "norm_bias", False)))

        act = ENCODER_ACTIVATIONS[getattr(config, "hidden_activation", "gelu")]
        self.embeddings = ModernBertEmbeddings(spec, norm)
        self.layers = nn.ModuleList(ModernBertLayer(spec, i, act, norm) for i in range(spec.num_layers))
        self.final_norm = norm()
        self.has_classifier = head
        if head:
            self.head = ModernBertHead(spec, config, norm)
            self.classifier = nn.Linear(spec.hidden_size, int(getattr(config, "num_labels", 1) or 1))
            self.classify_rows = "all" if getattr(config, "classifier_pooling", "cls") == "mean" else "first"
        self.reset_rotary(None)

    def reset_rotary(self, device: torch.device | None) -> None:
        """The rotary tables of the two layer types (their buffers are not in the checkpoint)."""
        self.rotaries = {name: RotaryEmbedding(self.spec, name).to(device) for name in self.spec.rope_table_names()}

    def embed(self, input_ids, positions, token_type_ids):
        return self.embeddings(input_ids)

    def layer_inputs(self, positions, dtype):
        tables = {name: rotary(positions, dtype) for name, rotary in self.rotaries.items()}
        return [tables[self.spec.attention_of(i).rope] for i in range(len(self.layers))]

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head(pooled))


class ModernBertArchitecture(ModelArchitecture):
    """ModernBERT: pre-norm, RoPE, GeGLU, alternating global and symmetric-window layers, both ways."""

    name = "modernbert"
    api_version = "1.19"
    model_types = ("modernbert",)

    def spec(self, hf_config: Any) -> ModelSpec:
        refuse_quantized(hf_config)
        layer_types = list(hf_config.layer_types)
        rope = {}
        for kind in LAYER_TYPES:
            params = dict((hf_config.rope_parameters or {}).get(kind) or {})
            if (params.get("rope_type") or "default") != "default":
                raise ModelLoadError(f"modernbert with {kind} rope_type {params.get('rope_type')!r} is not supported; "
                                     f"supported: default")
            rope[kind] = {"rope_type": "default", "rope_theta": float(params["rope_theta"])}
        for field in ("hidden_activation", "classifier_activation"):
            if getattr(hf_config, field, "gelu") not in ENCODER_ACTIVATIONS:
                raise ModelLoadError(f"modernbert with {field} {getattr(hf_config, field)!r} is not supported; "
                                     f"supported: {', '.join(ENCODER_ACTIVATIONS)}")
        window = hf_config.sliding_window + 1  # |p - k| <= local_attention // 2
        heads = hf_config.num_attention_heads
        layers = tuple(LayerAttention(sliding_window=window if t == "sliding_attention" else None, rope=t, causal=False)
                       for t in layer_types)
        bias = bool(getattr(hf_config, "attention_bias", False))
        return ModelSpec(
            model_type="modernbert", vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size, num_layers=hf_config.num_hidden_layers, num_heads=heads,
            num_kv_heads=heads, head_dim=hf_config.hidden_size // heads, rms_norm_eps=hf_config.norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings, tie_word_embeddings=False, qkv_bias=bias,
            o_bias=bias, mlp_bias=bool(getattr(hf_config, "mlp_bias", False)), sliding_window=None,
            rope_type="default", hf_config=hf_config, layer_attention=layers,
            rope_tables=tuple((kind, params) for kind, params in rope.items()))

    def build(self, spec: ModelSpec) -> nn.Module:
        head = any(a.endswith("ForSequenceClassification") for a in getattr(spec.hf_config, "architectures", None) or [])
        return ModernBertEncoder(spec, head)

    def checkpoint_name(self, name: str) -> str | None:
        name = re.sub(r"^model\.", "", name)
        return name.replace(".attn.Wqkv.", ".attn.qkv_proj.").replace(".attn.Wo.", ".attn.o_proj.")


@tessellm.hookimpl
def register_model(register):
    register(ModernBertArchitecture)
