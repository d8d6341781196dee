"""Tiny random-weight models that load like any Hugging Face folder, for plugin tests that
need a whole pipeline (schedulers, decoders, quantizers): a few layers of real architecture
and a word-level tokenizer over every id (``t0``, ``t1``, ...), so nothing is downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_LLAMA: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                                  tie_word_embeddings=True)


def build_tiny_llama(target: Path, *, seed: int = 0, vocab_size: int = 512, **shapes: Any) -> Path:
    """A random Llama of ``TINY_LLAMA``'s shapes (``shapes`` override them) saved in ``target``
    with its tokenizer; weights drawn with ``seed`` at a scale that keeps logits far from ties,
    so greedy outputs do not flip on rounding. Token 1 is BOS, 2 is EOS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         **{**TINY_LLAMA, **shapes})
    return _save_random(lambda: LlamaForCausalLM(config), target, seed, 0.15, vocab_size)


def save_word_tokenizer(target: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ids 0..vocab_size-1 (``t0``, ``t1``, ...; 1 is BOS, 2 EOS)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # a text is one token per word (t0 if unknown)

    def special(word: str) -> AddedToken:  # whole words only: "t17" is t17, not t1 and an unknown "7"
        return AddedToken(word, single_word=True, special=True)

    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=special("t0"), bos_token=special("t1"),
                            eos_token=special("t2"), pad_token=special("t0")).save_pretrained(target)


TINY_DEEPSEEK: dict[int, dict[str, Any]] = {
    # V2-Lite's layout: no query compression, softmax routing limited to the best groups
    2: dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, topk_method="group_limited_greedy",
            first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=1024, routed_scaling_factor=1.0),
    # V3's: query compression, sigmoid routing with the score-correction bias, YaRN
    3: dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=32,
            q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
            max_position_embeddings=1024, routed_scaling_factor=2.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0}),
}


def build_tiny_deepseek(target: Path, version: int = 2, *, seed: int = 0, vocab_size: int = 512,
                        weight_std: float = 0.15, **shapes: Any) -> Path:
    """A random DeepSeek-V2 or V3 (``version``) of ``TINY_DEEPSEEK``'s shapes (``shapes``
    override them), made with transformers' own config and model classes and saved in
    ``target`` with a word-level tokenizer. Weights are drawn with ``seed`` at std
    ``weight_std`` (logits far from ties); V3's score-correction bias is random too, so
    routing depends on it."""
    import transformers

    cls = "DeepseekV2" if version == 2 else "DeepseekV3"
    config = getattr(transformers, f"{cls}Config")(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2,
                                                   pad_token_id=0, **{**TINY_DEEPSEEK[version], **shapes})
    model_cls = getattr(transformers, f"{cls}ForCausalLM")
    return _save_random(lambda: model_cls(config), target, seed, weight_std, vocab_size)


TINY_SHAPES: dict[str, dict[str, Any]] = {
    # Llama's block; GQA 4:2, tied embeddings
    "llama": dict(TINY_LLAMA),
    # a sliding window of 8 tokens, untied
    "mistral": dict(TINY_LLAMA, sliding_window=8, tie_word_embeddings=False),
    # q/k/v biases, GQA 4:1
    "qwen2": dict(TINY_LLAMA, num_key_value_heads=1, use_sliding_window=False),
    # head_dim 24 with 4 heads over hidden 64 (not hidden / heads), GQA 4:1, untied
    "qwen3": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=24, max_position_embeddings=512, rms_norm_eps=1e-6,
                  tie_word_embeddings=False),
    # 8 experts of width 32, top-2 renormalised, the middle layer dense, GQA 4:2, tied
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rms_norm_eps=1e-6, tie_word_embeddings=True),
    # a gated shared expert; experts every second layer, top-4 of 6 not renormalised; MHA, untied
    "qwen2_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_experts=6,
                      num_experts_per_tok=4, norm_topk_prob=False, shared_expert_intermediate_size=48,
                      decoder_sparse_step=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # top-2 of 8 experts on every layer, GQA 4:2 with head_dim 32 over hidden 64 (not hidden / heads)
    "mixtral": dict(hidden_size=64, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False),
}
TINY_SHAPES["deepseek_v2"], TINY_SHAPES["deepseek_v3"] = TINY_DEEPSEEK[2], TINY_DEEPSEEK[3]

_TINY_64 = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, tie_word_embeddings=False)
TINY_SHAPES.update({
    # the families whose layers differ: windows of 8 tokens (shorter than test prompts),
    # softcaps and multipliers that bind
    # Gemma 1: Llama's block with Gemma's norms, scaled embedding and GeGLU
    "gemma": dict(_TINY_64, head_dim=16, num_hidden_layers=2),
    # OLMo 3: OLMo 2's block, three sliding layers of 8 tokens to one global
    "olmo3": dict(_TINY_64, num_hidden_layers=4, sliding_window=8,
                  layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "gemma2": dict(_TINY_64, head_dim=16, num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=24,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0, rms_norm_eps=1e-6,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]),
    "gemma3_text": dict(_TINY_64, head_dim=32, num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=32,
                        final_logit_softcapping=3.0, rms_norm_eps=1e-6,
                        layer_types=["sliding_attention"] * 5 + ["full_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 10000.0}}),
    "gpt_oss": dict(_TINY_64, intermediate_size=32, num_hidden_layers=4, head_dim=16, num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0, rms_norm_eps=1e-5,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}),
    "phi3": dict(_TINY_64, num_hidden_layers=2, sliding_window=8, rms_norm_eps=1e-5,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "olmo2": dict(_TINY_64, num_hidden_layers=3, rms_norm_eps=1e-6),
    "granite": dict(_TINY_64, num_hidden_layers=2, rms_norm_eps=1e-6, embedding_multiplier=4.0,
                    attention_multiplier=0.05, residual_multiplier=0.3, logits_scaling=2.5),
    "smollm3": dict(_TINY_64, num_hidden_layers=4, rms_norm_eps=1e-6, no_rope_layers=[1, 0, 1, 0],
                    use_sliding_window=True, sliding_window=8,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention", "full_attention"]),
})
"""Tiny shapes per Hugging Face model_type, each varying what its family varies."""

TINY_VECTORS: dict[str, dict[str, float]] = {
    # Gemma stores norm weights as offsets from one: random, so 1 + w is exercised
    "gemma": {"": 0.5}, "gemma2": {"": 0.5}, "gemma3_text": {"": 0.5},
    # sinks about a score's size, router biases that change which experts win, other biases
    "gpt_oss": {"sinks": 1.0, "router.bias": 0.5, "bias": 0.2},
}
"""Per model_type, the std of the 1-D parameters ``build_tiny`` draws at random (by name
suffix; "" matches every one), where transformers' zeros or ones would hide a feature."""


SIZE_CAPS: tuple[tuple[tuple[str, ...], int], ...] = (
    (("hidden_size", "n_embd", "d_model", "embed_dim", "model_dim", "dim"), 64),
    (("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "inner_hidden_size"), 128),
    (("num_hidden_layers", "n_layer", "n_layers", "num_layers"), 2),
    (("num_attention_heads", "n_head", "n_heads", "num_heads"), 4),
    (("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"), 512),
    (("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 8),
    (("num_experts_per_tok", "num_selected_experts", "moe_top_k"), 2),
    (("n_group", "num_expert_groups"), 4),
    (("topk_group",), 2),
)
"""Size fields a tiny checkpoint caps whatever its family (``tiny_fields``), by name, with
their cap; besides these, by pattern: any other ``*intermediate_size`` at 32, ``head_dim``
(unless derived from the hidden size and heads), any ``*_head_dim`` and ``rotary_dim`` at 16, ``*_lora_rank`` at 32, and key/value heads at the heads' cap
keeping the config's grouping (as many as the heads, else 2, or 1 for multi-query)."""

SUITE_BYTES_PER_PARAMETER = 32
"""What one parameter of a tiny checkpoint costs the model conformance suite at its peak: a
float64 reference and a float64 pipeline (8 bytes each), and up to four float32 models (the
reference and pipelines) alive at once."""

CHECKPOINT_MEMORY_LIMIT = 2 << 30
"""The bytes a tiny checkpoint may cost the suite (``SUITE_BYTES_PER_PARAMETER`` a
parameter) before ``build_tiny`` refuses to allocate it: 2 GiB, some 67 million parameters,
a thousand times what the suites' checkpoints have. ``TESSELLM_CHECKPOINT_MEMORY_LIMIT``
(bytes, or with a K/M/G suffix) sets another."""


class CheckpointTooLarge(ValueError):
    """A tiny checkpoint whose shapes would cost more memory than the limit (one line, raised
    before anything is allocated)."""


def _size_cap(name: str, default: Any, defaults: dict[str, Any]) -> Any:
    """The tiny value of config field ``name`` (whose default is ``default``), or None to keep it."""
    if not isinstance(default, int) or isinstance(default, bool) or default <= 0:
        return None
    for names, cap in SIZE_CAPS:
        if name in names:
            return cap if default > cap else None
    if name.endswith("intermediate_size"):
        cap = 32
    elif name == "head_dim" or name.endswith("_head_dim") or name in ("kv_channels", "rotary_dim"):
        hidden, heads = defaults.get("hidden_size"), defaults.get("num_attention_heads")
        if name == "head_dim" and isinstance(hidden, int) and isinstance(heads, int) and default == hidden // heads:
            return None  # derived from the hidden size and heads: the tiny ones derive it again
        cap = 16
    elif name.endswith("_lora_rank"):
        cap = 32
    elif name in ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"):
        heads = next((defaults[n] for n in SIZE_CAPS[3][0] if isinstance(defaults.get(n), int)), default)
        cap = 4 if default >= heads else (1 if default == 1 else 2)
        return cap if default != cap else None
    else:
        return None
    return cap if default > cap else None


def tiny_fields(model_type: str, vocab_size: int = 512, **shapes: Any) -> dict[str, Any]:
    """The config fields of ``model_type``'s tiny checkpoint: transformers' defaults for the
    type with every size field capped (``SIZE_CAPS``), then tessellm's ``TINY_SHAPES`` for
    the type, then ``shapes`` (a plugin's ``tiny_config``, a suite's ``shapes``), each over
    the one before; the vocabulary is ``vocab_size``, token 1 BOS, 2 EOS, 0 padding."""
    import dataclasses
    import inspect

    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    defaults = config_cls().to_dict()
    # only the config's own fields (not what it derives from them), under their own names
    own = set(inspect.signature(config_cls.__init__).parameters)
    if dataclasses.is_dataclass(config_cls):
        own |= {f.name for f in dataclasses.fields(config_cls)}
    aliases = getattr(config_cls, "attribute_map", {}) or {}
    given = {**TINY_SHAPES.get(model_type, {}), **shapes}
    named = {aliases.get(name, name) for name in given}
    capped = {name: cap for name, value in defaults.items() if name in own and name not in named
              and (cap := _size_cap(name, value, defaults)) is not None}
    return {**capped, **given, "vocab_size": vocab_size, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def memory_limit() -> int:
    """``CHECKPOINT_MEMORY_LIMIT``, or ``TESSELLM_CHECKPOINT_MEMORY_LIMIT`` when set."""
    import os

    text = os.environ.get("TESSELLM_CHECKPOINT_MEMORY_LIMIT", "").strip().upper().removesuffix("B")
    if not text:
        return CHECKPOINT_MEMORY_LIMIT
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    try:
        return int(float(text.rstrip("KMG")) * scale)
    except ValueError:
        raise ValueError(f"TESSELLM_CHECKPOINT_MEMORY_LIMIT={os.environ['TESSELLM_CHECKPOINT_MEMORY_LIMIT']!r} "
                         f"is not a number of bytes (e.g. 2G, 512M)") from None


def count_parameters(config: Any) -> int:
    """The parameters transformers' model for ``config`` has, counted on the meta device
    (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def check_checkpoint_size(model_type: str, config: Any, limit: int | None = None) -> int:
    """The parameter count of ``config``'s model; CheckpointTooLarge (one line naming the
    shapes and the ways to change them) when the suite would need more than ``limit``
    bytes (default ``memory_limit()``)."""
    limit = memory_limit() if limit is None else limit
    params = count_parameters(config)
    need = params * SUITE_BYTES_PER_PARAMETER
    if need > limit:
        shape = ", ".join(f"{k}={getattr(config, k)}" for k in ("hidden_size", "num_hidden_layers",
                                                              "num_attention_heads", "intermediate_size",
                                                              "vocab_size") if hasattr(config, k))
        raise CheckpointTooLarge(
            f"the tiny {model_type} checkpoint would have {params:,} parameters ({shape}): about "
            f"{need / 2**30:.1f} GiB for the model suite, over its {limit / 2**30:.3g} GiB limit; set smaller "
            f"shapes in the plugin's tiny_config, the suite's shapes, or `tessellm plugins --check model:NAME "
            f"--shapes '{{\"{model_type}\": {{\"hidden_size\": 64, ...}}}}'` (the limit: "
            f"TESSELLM_CHECKPOINT_MEMORY_LIMIT)")
    return params


def tiny_config(model_type: str, *, vocab_size: int = 512, **shapes: Any) -> Any:
    """transformers' config of ``model_type``'s tiny checkpoint (``tiny_fields``), checked
    against the memory limit (``check_checkpoint_size``) before any weight exists."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **tiny_fields(model_type, vocab_size, **shapes))
    check_checkpoint_size(model_type, config)
    return config


def build_tiny(model_type: str, target: Path, *, seed: int = 0, vocab_size: int = 512, weight_std: float = 0.15,
               **shapes: Any) -> Path:
    """A random checkpoint of ``model_type`` made with transformers' own config and model
    classes (AutoConfig.for_model, AutoModelForCausalLM.from_config) and saved in ``target``
    with a word-level tokenizer; weights drawn with ``seed`` at std ``weight_std``. Token 1
    is BOS, 2 is EOS. Its config is ``tiny_fields``': any model type gets small shapes
    (``TINY_SHAPES`` where tessellm has them, ``shapes`` over those), and shapes that would
    still cost more than the memory limit raise CheckpointTooLarge before allocating."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, vocab_size=vocab_size, **shapes)
    return _save_random(lambda: AutoModelForCausalLM.from_config(config), target, seed, weight_std, vocab_size,
                        TINY_VECTORS.get(model_type))


def _save_random(make_model: Any, target: Path, seed: int, weight_std: float, vocab_size: int,
                 vectors: dict[str, float] | None = None) -> Path:
    """Build a model with ``make_model`` under ``seed`` (the global generator restored after),
    draw its matrices from N(0, weight_std), any score-correction bias (DeepSeek-V3's) from
    N(0, 0.1) and the 1-D parameters ``vectors`` names (suffix -> std, the first match) from
    N(0, std), then save it in ``target`` with a word-level tokenizer."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = make_model().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0, weight_std)
                    continue
                std = next((v for suffix, v in (vectors or {}).items() if name.endswith(suffix)), None)
                if std is not None and (vectors.get("") is not None or not name.endswith("norm.weight")):
                    p.normal_(0, std)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0, 0.1)
    finally:
        torch.random.set_rng_state(generator_state)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    save_word_tokenizer(target, vocab_size)
    return target


def noisy_copy(source: Path, target: Path, *, scale: float = 0.03, seed: int = 5) -> Path:
    """A copy of the model folder ``source`` in ``target`` whose every weight has seeded
    Gaussian noise of std ``scale`` added: a draft model that agrees with its source only some
    of the time, so speculative verification both accepts and rejects."""
    import shutil

    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file():
            shutil.copy(f, target / f.name)
    g = torch.Generator().manual_seed(seed)
    for f in sorted(target.glob("*.safetensors")):
        state = load_file(f)
        save_file({k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in state.items()}, f,
                  metadata={"format": "pt"})
    return target


VISION_TOKENS = {"<|vision_start|>": 500, "<|vision_end|>": 501, "<|image_pad|>": 502, "<|video_pad|>": 503}
"""The ids the tiny vision checkpoints give their image tokens (inside a 512-id vocabulary)."""


def save_vision_tokenizer(target: Path, vocab_size: int, specials: dict[str, int], chat_template: str,
                          extra: dict[str, str] | None = None) -> None:
    """``save_word_tokenizer``'s vocabulary with ``specials`` (token -> id) taking those ids,
    and a chat template, so a processor expands image tokens as the checkpoint's own does;
    ``extra``: named special tokens (e.g. Gemma 3's ``boi_token``) the processor reads."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {i: w for w, i in specials.items()}
    vocab = {words.get(i, f"t{i}"): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(w, special=True, normalized=False) for w in specials])
    def word(w: str) -> AddedToken:  # whole words only: "t17" is t17, not t1 and an unknown "7"
        return AddedToken(w, single_word=True, special=True)

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=word("t0"), bos_token=word("t1"),
                                   eos_token=word("t2"), pad_token=word("t0"), **({"extra_special_tokens": extra} if extra else {}))
    fast.chat_template = chat_template
    fast.save_pretrained(target)


QWEN2_VL_TEMPLATE = (
    "{% for m in messages %}t3 {% if m.content is string %}{{ m.content }} {% else %}{% for c in m.content %}"
    "{% if c.type == 'image' or c.type == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|> "
    "{% elif c.type == 'text' %}{{ c.text }} {% endif %}{% endfor %}{% endif %}t4 {% endfor %}"
    "{% if add_generation_prompt %}t5 {% endif %}")
"""A word-level chat template that writes Qwen2-VL's image marker for an image part."""


def build_tiny_qwen2_vl(target: Path, *, model_type: str = "qwen2_vl", seed: int = 0, vocab_size: int = 512,
                        weight_std: float = 0.15) -> Path:
    """A random Qwen2-VL (or Qwen2.5-VL) made with transformers' own classes: a 2-layer decoder
    of width 64 with M-RoPE sections (2, 3, 3), a 2-block vision transformer over 14-pixel
    patches merged 2x2, its image processor sized for small images (56x56 to 112x112 pixels:
    4 to 16 image tokens), and a word tokenizer whose ``VISION_TOKENS`` are the image tokens."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    if model_type == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision,
                                  image_token_id=VISION_TOKENS["<|image_pad|>"],
                                  video_token_id=VISION_TOKENS["<|video_pad|>"],
                                  vision_start_token_id=VISION_TOKENS["<|vision_start|>"],
                                  vision_end_token_id=VISION_TOKENS["<|vision_end|>"], tie_word_embeddings=False)
    _save_random(lambda: AutoModelForImageTextToText.from_config(config), target, seed, weight_std, vocab_size)
    save_vision_tokenizer(target, vocab_size, VISION_TOKENS, QWEN2_VL_TEMPLATE)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2,
                          temporal_patch_size=2).save_pretrained(target)
    return target


GEMMA3_VISION_TOKENS = {"<start_of_image>": 504, "<end_of_image>": 505, "<image_soft_token>": 506}
"""The ids the tiny Gemma 3 checkpoint gives its image tokens (boi, eoi, placeholder)."""

GEMMA3_TEMPLATE = (
    "{% for m in messages %}t3 {% if m.content is string %}{{ m.content }} {% else %}{% for c in m.content %}"
    "{% if c.type == 'image' or c.type == 'image_url' %}<start_of_image> "
    "{% elif c.type == 'text' %}{{ c.text }} {% endif %}{% endfor %}{% endif %}t4 {% endfor %}"
    "{% if add_generation_prompt %}t5 {% endif %}")
"""A word-level chat template that writes Gemma 3's image marker for an image part."""


def build_tiny_gemma3_vision(target: Path, *, seed: int = 0, vocab_size: int = 512, weight_std: float = 0.15) -> Path:
    """A random Gemma3ForConditionalGeneration made with transformers' own classes: a 3-layer
    decoder of width 64 (two sliding layers with a window of 8 tokens, shorter than an image,
    then a global one), a 1-layer SigLIP tower over 64x64 images in 8-pixel patches whose 8x8
    grid the projector pools to 16 tokens an image, Gemma's norm offsets random; its
    Gemma3Processor (image processor, word tokenizer whose ``GEMMA3_VISION_TOKENS`` are the
    image tokens, ``image_seq_length``) saved so that transformers' AutoProcessor loads it."""
    from transformers import AutoModelForImageTextToText, Gemma3Config
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    text = dict(_TINY_64, head_dim=32, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=32,
                rms_norm_eps=1e-6, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                 "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
                vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=64,
                  patch_size=8)
    tokens = GEMMA3_VISION_TOKENS
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                          boi_token_index=tokens["<start_of_image>"], eoi_token_index=tokens["<end_of_image>"],
                          image_token_index=tokens["<image_soft_token>"], tie_word_embeddings=True)
    _save_random(lambda: AutoModelForImageTextToText.from_config(config), target, seed, weight_std, vocab_size,
                 {"": 0.5})
    save_vision_tokenizer(target, vocab_size, tokens, GEMMA3_TEMPLATE,
                          extra={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>"})
    from transformers import AutoTokenizer

    image_processor = Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
    Gemma3Processor(image_processor, AutoTokenizer.from_pretrained(target), chat_template=GEMMA3_TEMPLATE,
                    image_seq_length=16).save_pretrained(target)
    return target


IDEFICS3_VISION_TOKENS = {"<fake_token_around_image>": 470, "<image>": 471, "<end_of_utterance>": 472,
                          "<global-img>": 473,
                          **{f"<row_{i + 1}_col_{j + 1}>": 474 + 6 * i + j for i in range(6) for j in range(6)}}
"""The ids the tiny Idefics3 / SmolVLM checkpoints give their image tokens (470..509)."""

IDEFICS3_TEMPLATE = QWEN2_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
"""A word-level chat template that writes Idefics3's image marker for an image part."""


def build_tiny_idefics3(target: Path, *, model_type: str = "idefics3", seed: int = 0, vocab_size: int = 512,
                        weight_std: float = 0.15) -> Path:
    """A random Idefics3 (or SmolVLM) made with transformers' own classes: a 2-layer Llama
    decoder of width 64, a 1-layer SigLIP-style tower over 32x32 tiles in 8-pixel patches whose
    4x4 grid the connector pixel-shuffles by 2 into 4 tokens a tile; its image processor
    resizes an image's longer side to 96 pixels and cuts it into up to 3x3 tiles of 32 plus a
    global view, as the real processor does at 4x364 and 364; processor and word tokenizer
    (``IDEFICS3_VISION_TOKENS``) saved so that transformers' AutoProcessor loads them."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    if model_type == "smolvlm":
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as Images
    else:
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil as Images
        from transformers.models.idefics3.processing_idefics3 import Idefics3Processor as Processor
    tokens = IDEFICS3_VISION_TOKENS
    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, model_type="llama")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision, scale_factor=2,
                                  image_token_id=tokens["<image>"], tie_word_embeddings=False,
                                  pad_token_id=0)
    _save_random(lambda: AutoModelForImageTextToText.from_config(config), target, seed, weight_std, vocab_size,
                 {"": 0.1})
    save_vision_tokenizer(target, vocab_size, tokens, IDEFICS3_TEMPLATE,
                          extra={"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                                 "end_of_utterance_token": "<end_of_utterance>", "global_image_token": "<global-img>"})
    images = Images(size={"longest_edge": 96}, max_image_size={"longest_edge": 32}, do_image_splitting=True)
    if model_type == "smolvlm":  # its processor needs a video processor (torchvision): its files by hand
        import json

        images.save_pretrained(target)
        (target / "processor_config.json").write_text(json.dumps({"image_seq_len": 4,
                                                                  "processor_class": "SmolVLMProcessor"}))
        return target
    Processor(images, AutoTokenizer.from_pretrained(target), image_seq_len=4,
              chat_template=IDEFICS3_TEMPLATE).save_pretrained(target)
    return target
