"""The fused CUDA decoder path is chosen by what a family overrides, never by a flag it must
remember: a layer, attention or MLP that keeps core's forward runs fused; one that overrides
its forward (or rotates part of each head) runs its own forward everywhere."""

from __future__ import annotations

import dataclasses

import torch
from transformers import LlamaConfig

from tessellm.core.model.decoder import Attention, DecoderForCausalLM, DecoderLayer, MLP
from tessellm.core.model.spec import decoder_spec
from tessellm.core.registry import get_registry

SHAPES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def build(cls: type[DecoderForCausalLM], **spec_fields) -> DecoderForCausalLM:
    spec = dataclasses.replace(decoder_spec(LlamaConfig(**SHAPES)), **spec_fields)
    with torch.device("meta"):
        return cls(spec)


class OwnLayer(DecoderLayer):
    def forward(self, x, cos, sin, backend, cache, plan):
        return x + self.self_attn(self.input_layernorm(x), cos, sin, backend, cache, plan)


class OwnAttention(Attention):
    def forward(self, x, cos, sin, backend, cache, plan, fused=False):
        return super().forward(x, cos, sin, backend, cache, plan, fused)


class OwnMLP(MLP):
    def forward(self, x, fused=False):
        return super().forward(x) * 2


class WithOwnAttention(DecoderLayer):
    def make_attention(self, spec, layer):
        return OwnAttention(spec, layer)


class WithOwnMLP(DecoderLayer):
    def make_mlp(self, spec, layer):
        return OwnMLP(spec)


class WithRenamedBlocks(DecoderLayer):  # subclasses of core's blocks that keep their forwards
    def make_attention(self, spec, layer):
        return type("Renamed", (Attention,), {})(spec, layer)


def model_of(layer: type[DecoderLayer]) -> type[DecoderForCausalLM]:
    return type(f"With{layer.__name__}", (DecoderForCausalLM,), {"layer_cls": layer})


def test_core_layers_and_blocks_run_fused():
    assert build(DecoderForCausalLM).supports_fused
    assert build(model_of(WithRenamedBlocks)).supports_fused


def test_an_overridden_forward_anywhere_in_a_layer_is_detected():
    for layer in (OwnLayer, WithOwnAttention, WithOwnMLP):
        assert build(model_of(layer)).supports_fused is False, layer.__name__


def test_partial_rotary_stays_unfused():
    assert build(DecoderForCausalLM, rotary_dim=4).supports_fused is False


def test_no_built_in_family_sets_the_old_flag():
    for entry in get_registry().entries("model"):
        module = __import__(entry.cls.__module__, fromlist=["_"])
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, DecoderForCausalLM) and value.__module__ == module.__name__:
                assert "supports_fused" not in vars(value), f"{value.__qualname__} sets supports_fused"
