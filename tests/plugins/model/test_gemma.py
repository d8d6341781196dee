"""The gemma model plugin: Gemma 1, Gemma 2, Gemma 3 (text) and a multimodal Gemma 3 checkpoint's
language model through the model conformance suite against transformers, on tiny checkpoints
whose every Gemma feature binds (windows shorter than the suite's prompts, softcaps small
enough to change the logits, two RoPE tables that differ, norm weights away from zero); the
features are shown to matter, and a backend that cannot serve them is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessellm.core.errors import ConfigError, ModelLoadError
from tessellm.plugins.model.gemma import GemmaArchitecture
from tessellm.testing.conformance import ModelConformance
from tessellm.testing.conformance.pipeline import registry_for

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-6)
WINDOW = 8  # the suite's prompts run to 40 tokens and more: sliding layers see a fraction of them

SHAPES = {
    # Llama's block with Gemma's norms, scaled embedding and GeGLU; GQA 4:1, tied
    "gemma": dict(TINY, num_key_value_heads=1, head_dim=16, num_hidden_layers=2),
    # sliding/full layers, both softcaps binding, scale 1/sqrt(24) (not head_dim's). Untied,
    # as is gemma3_text: tied, these tiny models repeat their last token (the embedding,
    # scaled by 8, dominates the residual), and greedy decoding would test little
    "gemma2": dict(TINY, head_dim=16, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0, tie_word_embeddings=False,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]),
    # five sliding layers then a global one (Gemma 3's pattern), q/k norms, a local RoPE base
    # of 100 and a global one of 10,000 scaled linearly by 4, a final softcap
    "gemma3_text": dict(TINY, head_dim=32, num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=32,
                        final_logit_softcapping=3.0, tie_word_embeddings=False,
                        layer_types=["sliding_attention"] * 5 + ["full_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 10000.0}}),
}


def save_random(model: torch.nn.Module, folder: Path, vocab_size: int) -> Path:
    """``model`` (transformers') with seeded weights, saved in ``folder`` with a word-level
    tokenizer: matrices N(0, 0.15) as ``build_tiny`` draws them, and every vector (the norms'
    weights, which Gemma stores as offsets from one) N(0, 0.5), so that ``1 + weight`` is
    exercised rather than all ones."""
    from tessellm.testing.models import save_word_tokenizer

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * (0.15 if p.dim() >= 2 else 0.5))
    model.eval().save_pretrained(folder)
    save_word_tokenizer(folder, vocab_size)
    return folder


NEUTRAL = {
    # each feature switched off in the reference; the logits must move for each
    "gemma2": {"attn_logit_softcapping": None, "final_logit_softcapping": None, "sliding_window": 4096},
    "gemma3_text": {"final_logit_softcapping": None, "sliding_window": 4096,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
}


class TestGemma(ModelConformance):
    plugin_class = GemmaArchitecture
    model_types = ("gemma", "gemma2", "gemma3_text")
    shapes = SHAPES

    @classmethod
    def build_checkpoint(cls, model_type, folder):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model(model_type, vocab_size=cls.vocab_size, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0, **SHAPES[model_type])
        return save_random(AutoModelForCausalLM.from_config(config), folder, cls.vocab_size)

    def test_each_feature_changes_the_reference_logits(self, checkpoint) -> None:
        """Softcaps, windows and RoPE tables bind on these checkpoints: switched off one at a
        time in transformers' model, the logits of a 40-token prompt move by over 1e-2."""
        from transformers import AutoModelForCausalLM

        if checkpoint.model_type not in NEUTRAL:
            pytest.skip("Gemma 1 has no window, softcap or second RoPE table")
        prompt = torch.tensor(checkpoint.prompts(3, [40]))
        with torch.no_grad():
            logits = checkpoint.reference(torch.float64)(prompt).logits
            for field, value in NEUTRAL[checkpoint.model_type].items():
                other = AutoModelForCausalLM.from_pretrained(checkpoint.folder, dtype=torch.float64, **{field: value})
                moved = (other(prompt).logits - logits).abs().max().item()
                assert moved > 1e-2, f"{checkpoint.model_type}: {field}={value!r} moves the logits by only {moved:.3g}"

    def test_spec_declares_the_layer_features(self, checkpoint) -> None:
        """The windows (on the sliding layers only) and Gemma 2's softcap reach the spec,
        where the attention backends read them."""
        from tessellm.core.model.loader import load_hf_config

        spec = GemmaArchitecture().load_spec(load_hf_config(checkpoint.folder))
        features = spec.attention_features()
        if checkpoint.model_type == "gemma":
            assert features == {}
            return
        types = SHAPES[checkpoint.model_type]["layer_types"]
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        assert features["per_layer_window"] == sliding
        assert all(spec.attention_of(i).sliding_window == WINDOW for i in sliding)
        if checkpoint.model_type == "gemma2":
            assert features["softcap"] == list(range(len(types)))
            assert spec.attention_of(0).softcap == 2.0
        else:
            assert "softcap" not in features  # transformers applies none in Gemma 3
            assert spec.rope_table_names() == ["sliding_attention", "full_attention"]
            assert spec.qk_norm
        assert spec.attention_scale == SHAPES[checkpoint.model_type]["query_pre_attn_scalar"] ** -0.5

    def test_a_backend_without_the_features_is_refused_by_name(self, checkpoint) -> None:
        """`attention: quest` serves no layer feature: resolution refuses it for Gemma 2 and
        3, naming one, and takes it for Gemma 1, which needs none."""
        from tessellm.core.engine.pipeline import Pipeline

        config = {"model": str(checkpoint.folder), "device": "cpu", "dtype": "float32",
                  "architecture": {"name": "gemma"}, "attention": {"name": "quest"}}
        if checkpoint.model_type == "gemma":
            assert Pipeline.from_config(config, registry=registry_for(TestGemma)).attention.name == "quest"
            return
        with pytest.raises(ConfigError, match="per_layer_window|softcap") as raised:
            Pipeline.from_config(config, registry=registry_for(TestGemma))
        if checkpoint.model_type == "gemma2":
            assert "softcap" in str(raised.value)


class TestGemma3Multimodal(ModelConformance):
    """A Gemma3ForConditionalGeneration checkpoint (hub layout: ``language_model.model.*``,
    a vision tower and projector) served as its language model on text prompts, against
    transformers' multimodal model given the same text."""

    plugin_class = GemmaArchitecture
    model_types = ("gemma3",)

    @classmethod
    def build_checkpoint(cls, model_type, folder):
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration

        # gemma3_text's shapes; its final softcap stays in the text config, which transformers'
        # multimodal model ignores (and so must the plugin); the RoPE tables in the hub's older
        # spelling: a local base and a global rope_scaling
        text = {k: v for k, v in SHAPES["gemma3_text"].items() if k != "rope_parameters"}
        text["tie_word_embeddings"] = True  # the multimodal model's LM head is its text embedding
        text.update(rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
                    rope_theta=10000.0, vocab_size=cls.vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                      patch_size=16)
        config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                              boi_token_index=cls.vocab_size - 3, eoi_token_index=cls.vocab_size - 2,
                              image_token_index=cls.vocab_size - 1)
        return save_random(Gemma3ForConditionalGeneration(config), folder, cls.vocab_size)

    def test_spec_and_weights_describe_the_checkpoint(self, checkpoint) -> None:
        """The spec is the text config's; every language-model tensor loads, the vision
        tower's and projector's are left out, none is missing."""
        self.case()
        from tessellm.core.model.loader import checkpoint_state, load_hf_config, load_state_dict

        config = load_hf_config(checkpoint.folder)
        spec = GemmaArchitecture().load_spec(config)
        text = config.text_config
        assert (spec.model_type, spec.num_layers, spec.vocab_size) == ("gemma3_text", text.num_hidden_layers,
                                                                     text.vocab_size)
        assert spec.rope_tables[0][1]["rope_theta"] == 100.0 and spec.rope_tables[1][1]["rope_type"] == "linear"
        stored = load_state_dict(checkpoint.folder)
        names = set(checkpoint_state(GemmaArchitecture(), stored))
        with torch.device("meta"):
            expected = set(GemmaArchitecture().build(spec).state_dict()) - {"lm_head.weight"}
        assert names == expected
        assert any(name.startswith("vision_tower.") for name in stored)


@pytest.mark.parametrize("change, named", [({"layer_types": ["sliding_attention", "chunked_attention"]},
                                              "chunked_attention"),
                                             ({"use_bidirectional_attention": True}, "use_bidirectional_attention")])
def test_what_the_plugin_cannot_serve_is_refused_by_name(change, named):
    """A layer type other than sliding/full attention, or a bidirectional (embedding) Gemma."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("gemma2", vocab_size=64, num_hidden_layers=2, **TINY, head_dim=16)
    for field, value in change.items():
        setattr(config, field, value)
    with pytest.raises(ModelLoadError, match=named):
        GemmaArchitecture().load_spec(config)
