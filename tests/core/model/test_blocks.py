"""The blocks a model author builds a non-Llama family from (LayerNorm, the plain MLP, the
parallel-residual layer, partial rotary) against transformers' and torch's own modules, and
``decoder_spec``'s reading of a config: every field it reads can be given instead (never read
then), partial_rotary_factor is read, a missing field names how to pass it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tessellm
from tessellm.core.errors import ModelLoadError


def neox_config(**fields):
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(**{"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
                            "num_hidden_layers": 2, "vocab_size": 128, **fields})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_equals_torchs(dtype, bias):
    g = torch.Generator().manual_seed(0)
    ours, theirs = tessellm.LayerNorm(48, 1e-5, bias=bias), nn.LayerNorm(48, eps=1e-5, bias=bias)
    with torch.no_grad():
        for module in (ours, theirs):
            module.weight.copy_(torch.randn(48, generator=g.manual_seed(1)))
            if bias:
                module.bias.copy_(torch.randn(48, generator=g.manual_seed(2)))
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (torch.randn(7, 48, generator=g, dtype=torch.float64) * 3 + 1).to(dtype)
    assert torch.equal(ours(x), theirs(x))
    assert [n for n, _ in ours.named_parameters()] == (["weight", "bias"] if bias else ["weight"])


def test_decoder_spec_reads_a_gpt_neox_config():
    spec = tessellm.decoder_spec(neox_config(), gated_mlp=False, mlp_bias=True)
    assert (spec.norm, spec.parallel_residual, spec.mlp_activation, spec.gated_mlp) == \
        ("layer_norm", True, "gelu", False)
    assert spec.rms_norm_eps == 1e-5 and spec.head_dim == 16 and spec.rotary_dim == 4 and spec.rope_dim == 4
    assert spec.qkv_bias and spec.o_bias and spec.mlp_bias and not spec.tie_word_embeddings
    sequential = tessellm.decoder_spec(neox_config(use_parallel_residual=False, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}))
    assert not sequential.parallel_residual and sequential.rotary_dim is None


def test_decoder_spec_takes_every_field_it_reads_without_reading_it():
    """A config lacking what Llama's has (no rms_norm_eps, no num_hidden_layers under that
    name): the fields passed are used and never looked up, as the docstring says."""

    class Bare:  # a config with none of the fields decoder_spec reads
        model_type = "bare"

    given = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=256, mlp_activation="silu")
    spec = tessellm.decoder_spec(Bare(), **given)
    assert {k: getattr(spec, k) for k in given} == given
    assert (spec.norm, spec.rotary_dim, spec.sliding_window, spec.rope_type) == ("rms_norm", None, None, "default")
    with pytest.raises(ModelLoadError, match=r"bare config has no rms_norm_eps or layer_norm_eps.*"
                                             r"decoder_spec\(hf_config, rms_norm_eps=\.\.\.\)"):
        tessellm.decoder_spec(Bare(), **{k: v for k, v in given.items() if k != "rms_norm_eps"})


def test_decoder_spec_overrides_an_unreadable_field():
    """The issue's case: a config with no rms_norm_eps raised AttributeError even when the
    field was passed."""
    from transformers import GPTNeoXConfig

    config = GPTNeoXConfig(hidden_size=64, num_attention_heads=4, intermediate_size=96, num_hidden_layers=2)
    del config.layer_norm_eps
    spec = tessellm.decoder_spec(config, rms_norm_eps=1e-5, norm="layer_norm", mlp_activation="gelu")
    assert spec.rms_norm_eps == 1e-5 and spec.norm == "layer_norm"


@pytest.mark.parametrize("factor, head_dim, expected", [(0.25, 16, 4), (0.5, 16, 8), (0.4, 80, 32), (1.0, 16, None)])
def test_partial_rotary_factor_is_read(factor, head_dim, expected):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor})
    assert tessellm.decoder_spec(config).rotary_dim == expected


def test_an_odd_rotary_count_is_refused():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.2})
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor 0.2 rotates 3 of 16 head dims; allowed: an even"):
        tessellm.decoder_spec(config)


def test_the_blocks_follow_the_spec():
    spec = tessellm.decoder_spec(neox_config(), gated_mlp=False, mlp_bias=True)
    layer = tessellm.DecoderLayer(spec, 0)
    assert isinstance(layer.input_layernorm, tessellm.LayerNorm) and layer.input_layernorm.bias is not None
    mlp = layer.mlp
    assert not hasattr(mlp, "gate_proj") and mlp.up_proj.bias is not None
    x = torch.randn(5, 64, dtype=torch.float64)
    mlp.double()
    assert torch.allclose(mlp(x), mlp.down_proj(torch.nn.functional.gelu(mlp.up_proj(x))))
    mlp.fuse_projections()  # nothing to stack without a gate
    assert mlp.gate_up_proj is None
    model = tessellm.DecoderForCausalLM(spec)
    assert isinstance(model.model.norm, tessellm.LayerNorm) and not model.supports_fused
    llama = tessellm.decoder_spec(neox_config(), norm="rms_norm", parallel_residual=False,
                                  rotary_dim=None, mlp_activation="silu")
    assert tessellm.DecoderForCausalLM(llama).supports_fused


def test_the_parallel_residual_adds_both_branches_to_the_input():
    spec = tessellm.decoder_spec(neox_config(), gated_mlp=False, mlp_bias=True)
    layer = tessellm.DecoderLayer(spec, 0).double()
    calls = []

    class Doubling(nn.Module):  # attention's stand-in: records what it sees (norm1(x))
        def forward(self, h, *args):
            calls.append(h)
            return h * 2

    layer.self_attn = Doubling()
    x = torch.randn(3, 64, dtype=torch.float64)
    out = layer(x, None, None, None, None, None)
    torch.testing.assert_close(out, x + 2 * layer.input_layernorm(x) + layer.mlp(layer.post_attention_layernorm(x)))
    torch.testing.assert_close(calls[0], layer.input_layernorm(x))


def test_make_norm_names_what_it_builds():
    spec = tessellm.decoder_spec(neox_config(), norm="group_norm")
    with pytest.raises(ValueError, match="ModelSpec.norm 'group_norm' is not a norm core builds; allowed: rms_norm, "
                                         "layer_norm"):
        tessellm.make_norm(spec)
