"""The gpt-oss model plugin through the model conformance suite against transformers, on a
tiny checkpoint whose every GPT-OSS feature binds: windows of 8 tokens on alternate layers
(the suite's prompts run to 40 and more), random nonzero sinks, attention, router and expert
biases, a SwiGLU limit of 1.0 that clamps a good part of the gate and up activations
(their pre-activations have a std of about 1.2), top-2 of 8 experts and YaRN RoPE. Each
feature is shown to move transformers' logits; MXFP4 checkpoints and backends without sinks
are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tessellm.core.errors import ConfigError, ModelLoadError
from tessellm.plugins.model.gpt_oss import GptOssArchitecture
from tessellm.testing.conformance import ModelConformance
from tessellm.testing.conformance.pipeline import registry_for

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
SHAPES = {
    # hidden 64 = 2 x intermediate: the stacked gate_up_proj [E, 64, 64] is square, so only its
    # values (not its shape) tell a wrong de-interleaving or transposition
    "gpt_oss": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=WINDOW, layer_types=LAYER_TYPES, swiglu_limit=1.0,
                    max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}),
}
BIAS_STD = {"sinks": 1.0, "router.bias": 0.5}
"""The std of the 1-D parameters transformers initialises to zero or near it (default 0.2):
sinks of about a score's size, router biases that change which experts win."""


def _std(name: str) -> float:
    return next((std for suffix, std in BIAS_STD.items() if name.endswith(suffix)), 0.2)


class TestGptOss(ModelConformance):
    plugin_class = GptOssArchitecture
    shapes = SHAPES

    @classmethod
    def build_checkpoint(cls, model_type: str, folder: Path) -> Path:
        """transformers' GPT-OSS with every matrix from N(0, 0.15) and every bias and sink
        random too (transformers zero-initialises the biases, and its sinks are tiny)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from tessellm.testing.models import save_word_tokenizer

        config = AutoConfig.for_model(model_type, vocab_size=cls.vocab_size, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0, **cls.shapes[model_type])
        g = torch.Generator().manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.15)
                elif not name.endswith("norm.weight"):
                    p.copy_(torch.randn(p.shape, generator=g) * _std(name))
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder, safe_serialization=True)
        save_word_tokenizer(folder, cls.vocab_size)
        return folder

    def test_each_feature_changes_the_reference_logits(self, checkpoint) -> None:
        """Sinks, windows, the SwiGLU clamp and each kind of bias bind on this checkpoint:
        switched off one at a time in transformers' model, the logits of a 40-token prompt
        move by over 1e-2."""
        prompt = torch.tensor(checkpoint.prompts(3, [40]))
        with torch.no_grad():
            logits = checkpoint.reference(torch.float64)(prompt).logits
            for what, change in NEUTRAL.items():
                other = change(checkpoint.folder)
                moved = (other(prompt).logits - logits).abs().max().item()
                assert moved > 1e-2, f"switching off {what} moves the logits by only {moved:.3g}"

    def test_spec_declares_the_layer_features(self, checkpoint) -> None:
        """Sinks on every layer, the window on the sliding layers only, YaRN, top-k routing."""
        from tessellm.core.model.loader import load_hf_config

        spec = GptOssArchitecture().load_spec(load_hf_config(checkpoint.folder))
        sliding = [i for i, t in enumerate(LAYER_TYPES) if t == "sliding_attention"]
        assert spec.attention_features() == {"per_layer_window": sliding, "sinks": [0, 1, 2, 3]}
        assert [spec.attention_of(i).sliding_window for i in range(4)] == [WINDOW, None, WINDOW, None]
        assert spec.rope_type == "yarn" and spec.qkv_bias and spec.o_bias
        assert spec.moe.softmax_after_topk and spec.moe.top_k == 2 and spec.moe.num_experts == 8

    def test_a_backend_without_sinks_is_refused_by_name(self, checkpoint) -> None:
        """`attention: quest` serves no layer feature: resolution refuses it, naming sinks."""
        from tessellm.core.engine.pipeline import Pipeline

        config = {"model": str(checkpoint.folder), "device": "cpu", "dtype": "float32",
                  "architecture": {"name": "gpt-oss"}, "attention": {"name": "quest"},
                  "cache": {"name": "paged"}}
        with pytest.raises(ConfigError, match="sinks"):
            Pipeline.from_config(config, registry=registry_for(TestGptOss))

    def test_an_mxfp4_checkpoint_is_refused_with_the_way_out(self, checkpoint, tmp_path) -> None:
        """A checkpoint whose config says MXFP4 (the released gpt-oss weights) is refused
        before any weight is read, saying how to dequantize it."""
        from tessellm.core.engine.pipeline import Pipeline

        folder = tmp_path / "mxfp4"
        shutil.copytree(checkpoint.folder, folder)
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ModelLoadError, match=r"'mxfp4'.*not supported yet; dequantize it to bfloat16.*"
                                                 r"Mxfp4Config\(dequantize=True\)"):
            Pipeline.from_config({"model": str(folder), "device": "cpu", "dtype": "float32",
                                  "architecture": {"name": "gpt-oss"}}, registry=registry_for(TestGptOss))


def _reference(folder: Path, **fields) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, experts_implementation="eager",
                                                **fields).eval()


def _zeroed(*suffixes: str):
    """A change for NEUTRAL: the float64 reference with every parameter ending in one of
    ``suffixes`` set to zero (sinks to -inf: no sink at all)."""
    def change(folder: Path) -> torch.nn.Module:
        model = _reference(folder)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(suffixes):
                    p.fill_(float("-inf") if name.endswith("sinks") else 0.0)
        return model
    return change


NEUTRAL = {
    "the SwiGLU clamp": lambda folder: _reference(folder, swiglu_limit=1e9),
    "the windows": lambda folder: _reference(folder, sliding_window=4096),
    "the sinks": _zeroed("sinks"),
    "the router bias": _zeroed("router.bias"),
    "the gate/up biases": _zeroed("gate_up_proj_bias"),
    "the down biases": _zeroed("down_proj_bias"),
    "the attention biases": _zeroed("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias"),
}


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_tables_are_transformers(truncate):
    """The rotary cos/sin of the spec (YaRN, with or without ``truncate``) are those of
    transformers' GptOssRotaryEmbedding at every position up to the context length."""
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from tessellm.core.model.decoder import RotaryEmbedding

    shapes = dict(SHAPES["gpt_oss"])
    shapes["rope_parameters"] = dict(shapes["rope_parameters"], truncate=truncate)
    config = AutoConfig.for_model("gpt_oss", vocab_size=64, **shapes)
    positions = torch.arange(512)
    cos, sin = RotaryEmbedding(GptOssArchitecture().load_spec(config))(positions, torch.float32)
    their_cos, their_sin = GptOssRotaryEmbedding(config)(torch.zeros(1), positions[None])
    half = cos.shape[-1] // 2
    # the same formula written twice: equal within float32 rounding, not by construction bit for bit
    torch.testing.assert_close(cos[:, :half], their_cos[0], rtol=2e-6, atol=2e-7)
    torch.testing.assert_close(sin[:, :half], their_sin[0], rtol=2e-6, atol=2e-7)
    assert torch.equal(cos[:, half:], cos[:, :half])


def test_other_quantization_methods_and_unknown_layer_types_are_refused():
    from transformers import AutoConfig

    shapes = {k: v for k, v in SHAPES["gpt_oss"].items() if k != "layer_types"}
    config = AutoConfig.for_model("gpt_oss", vocab_size=64, **shapes, layer_types=LAYER_TYPES,
                                  quantization_config={"quant_method": "bitsandbytes"})
    with pytest.raises(ModelLoadError, match="'bitsandbytes' is not supported; fp8: quant_method 'bitsandbytes' is "
                                             "not one it reads .*; supported: unquantized"):
        GptOssArchitecture().load_spec(config)
    config = AutoConfig.for_model("gpt_oss", vocab_size=64, **shapes,
                                  layer_types=["sliding_attention", "chunked_attention"] * 2)
    with pytest.raises(ModelLoadError, match="chunked_attention"):
        GptOssArchitecture().load_spec(config)
