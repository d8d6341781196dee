"""The tessellm model plugin for GPT-NeoX (model_type "gpt_neox").

What differs from Llama, and where it is said:

- LayerNorm with a bias instead of RMSNorm: ``decoder_spec`` reads it from the config
  (``layer_norm_eps`` and no ``rms_norm_eps``), and the blocks build it;
- a parallel residual, x + attn(norm1(x)) + mlp(norm2(x)) (``use_parallel_residual``; False
  gives the sequential layer): read by ``decoder_spec`` too;
- RoPE on the first quarter of each head (``partial_rotary_factor`` 0.25): read too;
- a plain MLP, dense_4h_to_h(gelu(dense_h_to_4h(x))), with biases: ``gated_mlp=False`` and
  ``mlp_bias=True`` (the config says neither);
- q, k and v in one ``query_key_value`` projection whose rows are grouped per head
  ([head 0: q k v][head 1: q k v]...), and ``dense`` after attention: the one module written
  here, ``NeoXAttention``.
"""

from __future__ import annotations

import re

from torch import nn

import tessellm
from tessellm import Attention, DecoderForCausalLM, DecoderLayer, ModelArchitecture, decoder_spec

LAYER = {"attention.query_key_value": "self_attn.query_key_value", "attention.dense": "self_attn.dense",
         "mlp.dense_h_to_4h": "mlp.up_proj", "mlp.dense_4h_to_h": "mlp.down_proj",
         "input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm"}
TOP = {"gpt_neox.embed_in.weight": "model.embed_tokens.weight", "gpt_neox.final_layer_norm.weight": "model.norm.weight",
       "gpt_neox.final_layer_norm.bias": "model.norm.bias", "embed_out.weight": "lm_head.weight"}


class NeoXAttention(Attention):
    """Attention over GPT-NeoX's fused projection: per head, q, k and v side by side."""

    def __init__(self, spec, layer):
        super().__init__(spec, layer)
        del self.q_proj, self.k_proj, self.v_proj, self.o_proj
        h = spec.hidden_size
        self.query_key_value = nn.Linear(h, 3 * self.num_heads * self.head_dim, bias=spec.qkv_bias)
        self.dense = nn.Linear(self.num_heads * self.head_dim, h, bias=spec.o_bias)

    def forward(self, x, cos, sin, backend, cache, plan, fused=False):
        t = x.shape[0]
        qkv = self.query_key_value(x).view(t, self.num_heads, 3 * self.head_dim)  # [T, H, (q k v) D]
        q, k, v = (part.contiguous() for part in qkv.split(self.head_dim, dim=-1))  # [T, H, D] each
        return self.dense(self.attend(q, k, v, cos, sin, backend, cache, plan).reshape(t, -1))


class NeoXLayer(DecoderLayer):
    """The decoder layer with GPT-NeoX's attention; its norms, MLP and residual (parallel or
    not) come from the spec."""

    def make_attention(self, spec, layer):
        return NeoXAttention(spec, layer)


class NeoXForCausalLM(DecoderForCausalLM):
    layer_cls = NeoXLayer


class GPTNeoX(ModelArchitecture):
    """GPT-NeoX / Pythia: LayerNorm, parallel residual, partial rotary, a plain GELU MLP."""

    name = "gpt-neox"
    api_version = "1.15"
    model_types = ("gpt_neox",)
    # the suite's tiny checkpoint: 3 layers, and a rotary fraction that leaves dims unrotated
    tiny_config = {"gpt_neox": {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
                                "num_hidden_layers": 3, "max_position_embeddings": 512,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.25}}}

    def spec(self, hf_config):
        return decoder_spec(hf_config, gated_mlp=False, mlp_bias=True)

    def build(self, spec):
        return NeoXForCausalLM(spec)

    def checkpoint_name(self, name):
        match = re.fullmatch(r"gpt_neox\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
        if match and match[2] in LAYER:
            return f"model.layers.{match[1]}.{LAYER[match[2]]}.{match[3]}"
        return TOP.get(name)  # None: a tensor the module does not take (old checkpoints' mask buffers)


@tessellm.hookimpl
def register_model(register):
    register(GPTNeoX)
