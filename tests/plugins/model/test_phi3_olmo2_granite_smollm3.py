"""Phi-3/Phi-4, OLMo 2/3, Granite and SmolLM3 pass the model conformance suite on tiny
random checkpoints built with transformers' own classes, with each family's feature set so
that it binds: Phi-3 rotates half of each head under a window shorter than the prompts (and
LongRoPE's short factors, far from 1), OLMo 3 slides a window on three layers of four with
YaRN on the full one, Granite's multipliers are far from 1, SmolLM3 mixes RoPE and NoPE
layers, sliding and full. The other tests check that the features are in the spec and the
module, and that they matter (the reference changes without them)."""

from __future__ import annotations

import math

import pytest
import torch

from tessellm.core.errors import ConfigError, ModelLoadError
from tessellm.plugins.model.granite import GraniteArchitecture
from tessellm.plugins.model.olmo2 import Olmo2Architecture
from tessellm.plugins.model.phi3 import Phi3Architecture
from tessellm.plugins.model.smollm3 import SmolLM3Architecture
from tessellm.testing.conformance import ModelConformance

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, tie_word_embeddings=False)

PHI3 = dict(TINY, num_hidden_layers=2, sliding_window=8, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
PHI3_LONGROPE = dict(TINY, num_hidden_layers=2, rms_norm_eps=1e-5, tie_word_embeddings=True,
                     original_max_position_embeddings=128,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                      "short_factor": [1.0, 1.9, 3.7, 7.5], "long_factor": [2.0, 5.0, 11.0, 23.0]})
OLMO2 = dict(TINY, num_hidden_layers=3, rms_norm_eps=1e-6)
OLMO3 = dict(TINY, num_hidden_layers=4, rms_norm_eps=1e-6, sliding_window=8,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 128}})
GRANITE = dict(TINY, num_hidden_layers=2, rms_norm_eps=1e-6, embedding_multiplier=4.0, attention_multiplier=0.05,
               residual_multiplier=0.3, logits_scaling=2.5)
SMOLLM3 = dict(TINY, num_hidden_layers=4, rms_norm_eps=1e-6, no_rope_layers=[1, 0, 1, 0], use_sliding_window=True,
               sliding_window=8,
               layer_types=["sliding_attention", "sliding_attention", "full_attention", "full_attention"])


class TestPhi3(ModelConformance):
    plugin_class = Phi3Architecture
    shapes = {"phi3": PHI3}


class TestPhi3LongRope(ModelConformance):
    """LongRoPE within original_max_position_embeddings (128: every prompt and output fits)."""

    plugin_class = Phi3Architecture
    shapes = {"phi3": PHI3_LONGROPE}


class TestOlmo2(ModelConformance):
    plugin_class = Olmo2Architecture  # olmo2, olmo3
    shapes = {"olmo2": OLMO2, "olmo3": OLMO3}


class TestGranite(ModelConformance):
    plugin_class = GraniteArchitecture
    shapes = {"granite": GRANITE}


class TestSmolLM3(ModelConformance):
    plugin_class = SmolLM3Architecture
    shapes = {"smollm3": SMOLLM3}


# ---------------------------------------------------------------------------- helpers


def _config(model_type: str, **shapes):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, **shapes)


def _build(plugin, config):
    spec = plugin().load_spec(config)
    with torch.device("meta"):
        return spec, plugin().build(spec)


def _logits_with_and_without(model_type: str, shapes: dict, prompt: list[int], **changed) -> tuple:
    """float64 logits of transformers' model on seeded tiny weights, and of the same weights
    under the config with ``changed`` fields (the feature turned off)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(model_type, **shapes)).double().eval()
        other = AutoModelForCausalLM.from_config(_config(model_type, **{**shapes, **changed})).double().eval()
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
        other.load_state_dict(model.state_dict())
        ids = torch.tensor([prompt])
        return model(ids).logits[0], other(ids).logits[0]


PROMPT = list(range(5, 45))  # 40 tokens: longer than every window here


# ---------------------------------------------------------------------------- Phi-3


def test_phi3_spec_has_partial_rotary_and_the_window():
    spec, model = _build(Phi3Architecture, _config("phi3", **PHI3))
    assert spec.rotary_dim == 8 and spec.rope_dim == 8 and spec.head_dim == 16
    assert spec.sliding_window == 8 and spec.attention_features() == {"sliding_window": [0, 1]}
    assert spec.inv_freq()[0].shape == (4,)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_proj.weight.shape == (16 * (4 + 2 * 2), 64) and not hasattr(attn, "q_proj")
    assert mlp.gate_up_proj.weight.shape == (256, 64) and not hasattr(mlp, "gate_proj")
    assert model.supports_fused is False


def test_phi3_window_matters():
    base, full_context = _logits_with_and_without("phi3", PHI3, PROMPT, sliding_window=None)
    assert (base - full_context).abs().max() > 1e-3, "the window of 8 does not change a 40-token prompt's logits"


def test_phi3_longrope_is_served_within_its_original_context():
    config = _config("phi3", **PHI3_LONGROPE)
    spec, _ = _build(Phi3Architecture, config)
    assert spec.rope_type == "longrope" and spec.max_position_embeddings == 128
    inv_freq, scaling = spec.inv_freq()
    short = torch.tensor([1.0, 1.9, 3.7, 7.5])
    expected = 1.0 / (short * 10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    torch.testing.assert_close(inv_freq, expected)
    assert scaling == pytest.approx(math.sqrt(1 + math.log(512 / 128) / math.log(128)))  # LongRoPE's attention factor


def test_phi3_longrope_refuses_a_longer_context(tmp_path):
    from tessellm import LLM
    from tessellm.core.engine.pipeline import Pipeline
    from tessellm.testing.conformance.pipeline import registry_for
    from tessellm.testing.models import build_tiny

    folder = build_tiny("phi3", tmp_path / "phi3", **PHI3_LONGROPE)
    with pytest.raises(ConfigError, match="max_position_embeddings \\(128\\)"):
        LLM(pipeline=Pipeline.from_config({"model": str(folder), "device": "cpu", "max_model_len": 256,
                                           "architecture": {"name": "phi3"}}, registry=registry_for(TestPhi3)))


def test_phi3_longrope_without_factors_is_refused():
    config = _config("phi3", **PHI3_LONGROPE)
    del config.rope_parameters["long_factor"]
    with pytest.raises(ModelLoadError, match="long_factor"):
        Phi3Architecture().load_spec(config)


# ---------------------------------------------------------------------------- OLMo 2 / 3


def test_olmo2_norms_the_outputs_and_whole_projections():
    spec, model = _build(Olmo2Architecture, _config("olmo2", **OLMO2))
    layer = model.model.layers[0]
    assert not hasattr(layer, "input_layernorm") and hasattr(layer, "post_feedforward_layernorm")
    assert layer.self_attn.q_norm.weight.shape == (4 * 16,) and layer.self_attn.k_norm.weight.shape == (2 * 16,)
    assert not spec.qk_norm and model.supports_fused is False
    model.fuse_projections()  # its attention's own forward reads q_proj: kept apart; its MLP is core's
    assert layer.self_attn.qkv_proj is None and layer.mlp.gate_up_proj is not None


def test_olmo3_spec_has_windows_and_rope_per_layer_type():
    spec, model = _build(Olmo2Architecture, _config("olmo3", **OLMO3))
    assert [spec.attention_of(i).sliding_window for i in range(4)] == [8, 8, 8, None]
    assert [spec.attention_of(i).rope for i in range(4)] == ["sliding_attention"] * 3 + ["full_attention"]
    assert spec.attention_features() == {"per_layer_window": [0, 1, 2]}
    (sliding, _), (full, yarn_scaling) = spec.inv_freq("sliding_attention"), spec.inv_freq("full_attention")
    torch.testing.assert_close(sliding, 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert not torch.allclose(full, sliding) and yarn_scaling != 1.0


def test_olmo3_window_matters():
    base, full_context = _logits_with_and_without("olmo3", OLMO3, PROMPT, layer_types=["full_attention"] * 4)
    assert (base - full_context).abs().max() > 1e-3, "the window of 8 does not change a 40-token prompt's logits"


# ---------------------------------------------------------------------------- Granite


def test_granite_spec_and_module_carry_the_multipliers():
    spec, model = _build(GraniteArchitecture, _config("granite", **GRANITE))
    assert spec.attention_scale == 0.05
    assert (model.embedding_multiplier, model.logits_scaling) == (4.0, 2.5) and model.adjusts_logits
    assert model.model.layers[0].residual_multiplier == 0.3 and model.supports_fused is False
    assert model.adjust_logits(torch.tensor([5.0])).item() == 2.0


def test_granite_rejects_a_zero_logits_scaling():
    with pytest.raises(ModelLoadError, match="logits_scaling"):
        GraniteArchitecture().load_spec(_config("granite", **dict(GRANITE, logits_scaling=0.0)))


# ---------------------------------------------------------------------------- SmolLM3


def test_smollm3_skips_rope_where_no_rope_layers_is_zero():
    spec, model = _build(SmolLM3Architecture, _config("smollm3", **SMOLLM3))
    assert [spec.attention_of(i).rope for i in range(4)] == ["default", None, "default", None]
    assert [spec.attention_of(i).sliding_window for i in range(4)] == [8, 8, None, None]
    assert model.layer_rope == ["default", None, "default", None]
    assert model.supports_fused is False  # the fused kernels rotate every layer


def test_smollm3_nope_layers_matter():
    base, all_rope = _logits_with_and_without("smollm3", SMOLLM3, PROMPT, no_rope_layers=[1, 1, 1, 1])
    assert (base - all_rope).abs().max() > 1e-3, "RoPE on the NoPE layers does not change the logits"


def test_smollm3_without_windows_by_default():
    spec = SmolLM3Architecture().load_spec(_config("smollm3", **dict(TINY, num_hidden_layers=4)))
    assert [spec.attention_of(i).rope for i in range(4)] == ["default", "default", "default", None]
    assert spec.attention_features() == {}
