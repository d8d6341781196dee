"""The tessellm model plugin for Toyformer: the spec from its config, a decoder layer that
runs attention and the MLP in parallel from one norm, and its checkpoint's names mapped onto
the blocks' (``blocks.{i}.wq`` -> ``model.layers.{i}.self_attn.q_proj``, ...)."""

from __future__ import annotations

import re

import tessellm
from tessellm import DecoderForCausalLM, DecoderLayer, ModelArchitecture, decoder_spec

from tessellm_model_example import reference  # noqa: F401  (registers the transformers classes)

NAMES = {"ln": "input_layernorm.weight", "wq.weight": "self_attn.q_proj.weight",
         "wk.weight": "self_attn.k_proj.weight", "wv.weight": "self_attn.v_proj.weight",
         "wo.weight": "self_attn.o_proj.weight", "w_gate.weight": "mlp.gate_proj.weight",
         "w_up.weight": "mlp.up_proj.weight", "w_down.weight": "mlp.down_proj.weight"}
TOP = {"embed.weight": "model.embed_tokens.weight", "final_ln": "model.norm.weight", "head.weight": "lm_head.weight"}


class ParallelLayer(DecoderLayer):
    """x + attention(norm(x)) + mlp(norm(x)): the decoder layer with one norm."""

    def __init__(self, spec, layer):
        super().__init__(spec, layer)
        del self.post_attention_layernorm

    def forward(self, x, cos, sin, backend, cache, plan):
        h = self.input_layernorm(x)
        return x + self._reduce(self.self_attn(h, cos, sin, backend, cache, plan)) + self._reduce(self.mlp(h))


class ToyformerForCausalLM(DecoderForCausalLM):
    layer_cls = ParallelLayer


class Toyformer(ModelArchitecture):
    """Toyformer: attention and MLP in parallel from one norm (GPT-J's layout)."""

    name = "toyformer"
    api_version = "1.6"
    model_types = ("toyformer",)

    def spec(self, hf_config):
        return decoder_spec(hf_config)

    def build(self, spec):
        return ToyformerForCausalLM(spec)

    def checkpoint_name(self, name):
        match = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
        if match:
            return f"model.layers.{match[1]}.{NAMES[match[2]]}"
        return TOP.get(name)


@tessellm.hookimpl
def register_model(register):
    register(Toyformer)
