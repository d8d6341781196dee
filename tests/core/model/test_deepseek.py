"""DeepSeek-V2 and V3 (MLA + MoE) against transformers on tiny random checkpoints made with
transformers' own config and model classes: the spec, the rotary embedding with YaRN, the
router, prefill logits, and greedy generation through the paged latent cache, continuous
batching, the prefix cache, chunked prefill, preemption and n-gram speculative decoding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tessellm import LLM
from tessellm.core.errors import ConfigError
from tessellm.core.model.decoder import RotaryEmbedding, rotate_half
from tessellm.core.model.mla import deinterleave
from tessellm.core.model.moe import MoE, Router
from tessellm.core.model.spec import ModelSpec
from tessellm.testing.models import build_tiny_deepseek

VOCAB = 512


@pytest.fixture(scope="module", params=[2, 3])
def deepseek(request, tmp_path_factory):
    """(version, folder, transformers model in float64)."""
    from transformers import AutoModelForCausalLM

    folder = build_tiny_deepseek(tmp_path_factory.mktemp(f"deepseek-v{request.param}"), request.param,
                                 vocab_size=VOCAB)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, experts_implementation="eager").eval()
    return request.param, folder, hf


def _prompts(n: int, seed: int, low: int = 1, high: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for length in lengths]


_REFERENCE: dict[tuple, list[int]] = {}


def _reference(hf, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy tokens (float64), computed once per model and prompt."""
    out = []
    for prompt in prompts:
        # by model type (one model each here), not id(hf): a freed model's id may be reused by the next
        key = (hf.config.model_type, tuple(prompt), new)
        if key in _REFERENCE:
            out.append(_REFERENCE[key])
            continue
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0)
        out.append(_REFERENCE.setdefault(key, ids[0, len(prompt):].tolist()))
    return out


def _config(folder, **overrides) -> dict:
    config = {"model": str(folder), "device": "cpu", "dtype": "float32", "attention": {"name": "mla"},
              "cache": {"name": "paged", "options": {"block_size": 8}}}
    config.update(overrides)
    return config


# ---------------------------------------------------------------- pieces


def test_spec_reads_mla_and_moe(deepseek):
    version, folder, hf = deepseek
    spec = ModelSpec.from_hf_config(hf.config)
    assert spec.mla.latent_dim == 32 + 16 and spec.kv_shape.format == "latent"
    assert spec.kv_shape.values_per_token == 48 and spec.head_dim == 32 and spec.num_kv_heads == 4
    assert (spec.mla.q_lora_rank is None) == (version == 2)
    assert spec.moe.scoring == ("softmax" if version == 2 else "sigmoid")
    assert spec.moe.topk_method == ("group_limited_greedy" if version == 2 else "noaux_tc")
    # YaRN's mscale_all_dim scales the softmax (V3 tiny config) exactly as transformers does
    assert spec.attention_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)


def test_yarn_rope_matches_transformers(tmp_path):
    """Our rotation of DeepSeek's interleaved rope dims (de-interleave, then rotate_half with
    YaRN's frequencies and attention factor) equals transformers' up to the same reordering."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RotaryEmbedding, apply_rotary_emb
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3RotaryEmbedding,
                                                                        apply_rotary_pos_emb_interleave)
    from transformers import DeepseekV3Config

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
    shapes = dict(hidden_size=64, num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                  v_head_dim=16, max_position_embeddings=4096, rope_parameters=yarn, n_routed_experts=4,
                  num_experts_per_tok=2, n_group=2, topk_group=1)
    positions = torch.tensor([0, 1, 63, 64, 1000, 4095])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, len(positions), 16, generator=g)  # [B, H, T, rope]
    k = torch.randn(1, 1, len(positions), 16, generator=g)
    for config in (DeepseekV3Config(**shapes), DeepseekV2Config(**shapes)):
        spec = ModelSpec.from_hf_config(config)
        cos, sin = RotaryEmbedding(spec)(positions, torch.float32)
        ours_q = deinterleave(q) * cos + rotate_half(deinterleave(q)) * sin
        ours_k = deinterleave(k) * cos + rotate_half(deinterleave(k)) * sin
        if config.model_type == "deepseek_v3":
            theirs_cos, theirs_sin = DeepseekV3RotaryEmbedding(config)(q, positions[None])
            ref_q, ref_k = apply_rotary_pos_emb_interleave(q, k, theirs_cos, theirs_sin)
        else:
            freqs = DeepseekV2RotaryEmbedding(config)(q, positions[None])
            ref_q, ref_k = apply_rotary_emb(q, k, freqs)
            ref_q, ref_k = deinterleave(ref_q), deinterleave(ref_k)  # V2 returns the interleaved layout
        assert torch.allclose(ours_q, ref_q, atol=1e-5) and torch.allclose(ours_k, ref_k, atol=1e-5)
        scale = spec.attention_scale * spec.head_dim ** 0.5
        assert scale == pytest.approx((0.1 * 0.707 * torch.log(torch.tensor(40.0)).item() + 1) ** 2, rel=1e-6)


def test_router_matches_transformers(deepseek):
    version, folder, hf = deepseek
    spec = ModelSpec.from_hf_config(hf.config)
    theirs = hf.model.layers[1].mlp.gate
    ours = Router(spec).double()
    ours.load_state_dict({k: v.double() for k, v in theirs.state_dict().items()})
    x = torch.randn(64, spec.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ids, weights = ours(x)
    _, ref_weights, ref_ids = theirs(x)
    order, ref_order = ids.argsort(dim=-1), ref_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    assert torch.allclose(weights.gather(1, order), ref_weights.gather(1, ref_order).to(weights.dtype), atol=1e-6)


@settings(max_examples=15, deadline=None)
@given(tokens=st.integers(1, 40), seed=st.integers(0, 2**16), top_k=st.integers(1, 4))
def test_grouped_experts_match_the_reference(tokens, seed, top_k):
    """The batched path over stacked expert weights equals the per-expert loop."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=top_k,
                              n_group=4, topk_group=2, n_shared_experts=1, num_attention_heads=4, kv_lora_rank=16,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    spec = ModelSpec.from_hf_config(config)
    g = torch.Generator().manual_seed(seed)
    moe = MoE(spec).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    x = torch.randn(tokens, 32, generator=g, dtype=torch.float64)
    reference = moe(x)
    moe.stack_experts()
    assert moe.grouped
    assert torch.allclose(moe(x), reference, atol=1e-12)


# ---------------------------------------------------------------- whole model


def test_prefill_logits_match_transformers(deepseek):
    """float64: any difference beyond transformers' own float32 rotary (V2 rotates in
    complex64) is a bug."""
    version, folder, hf = deepseek
    for form in ("auto", "naive", "absorbed"):
        llm = LLM(_config(folder, dtype="float64", attention={"name": "mla", "options": {"form": form}}))
        for prompt in _prompts(3, seed=1):
            ours = llm.engine.score(prompt).double()
            with torch.no_grad():
                ref = hf(torch.tensor([prompt])).logits[0]
            assert (ours - ref).abs().max().item() < 1e-5, (version, form)


@pytest.mark.parametrize("form", ["auto", "naive", "absorbed"])
def test_greedy_generation_matches_transformers_batched(deepseek, form):
    """Paged latent cache + continuous batching, float32, in each form."""
    version, folder, hf = deepseek
    prompts = _prompts(5, seed=2)
    ref = _reference(hf, prompts, 12)
    llm = LLM(_config(folder, attention={"name": "mla", "options": {"form": form}}))
    outs = llm.generate(prompts, {"max_tokens": 12, "ignore_eos": True})
    assert [o.token_ids for o in outs] == ref, (version, form)


def test_prefix_cache_chunked_prefill_and_preemption_keep_tokens(deepseek):
    """Prompts sharing a long prefix, run twice (the second run hits the cache), prefilled in
    chunks of 16 tokens, in a cache small enough that sequences are preempted and resumed."""
    version, folder, hf = deepseek
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, VOCAB, (37,), generator=g).tolist()
    prompts = [shared + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 17, 1)]
    ref = _reference(hf, prompts, 16)
    llm = LLM(_config(folder, cache={"name": "paged", "options": {"block_size": 8, "num_blocks": 12}},
                      scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 16,
                                                                   "chunked_prefill": True}}))
    for _ in range(2):
        outs = llm.generate(prompts, {"max_tokens": 16, "ignore_eos": True})
        assert [o.token_ids for o in outs] == ref, version
    stats = llm.pipeline.cache.prefix_cache_stats()
    assert stats.hit_tokens >= 32, stats
    assert llm.engine.stats.preemptions > 0, "the cache was meant to be too small"
    assert llm.pipeline.cache.pool.num_used == 0, "a finished request left blocks referenced"


def test_ngram_speculative_decoding_keeps_tokens(deepseek):
    """Drafts verified over the latent cache, rejected ones rolled back."""
    version, folder, hf = deepseek
    g = torch.Generator().manual_seed(4)
    motif = torch.randint(3, VOCAB, (6,), generator=g).tolist()
    prompts = [motif * 4, motif * 2 + [7, 8, 9], _prompts(1, seed=5)[0]]
    ref = _reference(hf, prompts, 20)
    llm = LLM(_config(folder, decoding={"name": "speculative", "options": {"proposer": "ngram", "k": 3,
                                                                           "adaptive_k": False}}))
    outs = llm.generate(prompts, {"max_tokens": 20, "ignore_eos": True, "temperature": 0.0})
    assert [o.token_ids for o in outs] == ref, version


# ---------------------------------------------------------------- selection


def test_auto_picks_mla_and_others_refuse_latent_caches(deepseek, tiny_model, cpu_config):
    version, folder, hf = deepseek
    llm = LLM({"model": str(folder), "device": "cpu", "dtype": "float32"})
    assert llm.pipeline.resolved.choices["attention"].cls.name == "mla"
    assert llm.pipeline.cache.layout.format == "latent"
    for name in ("sdpa", "flash", "cascade"):
        with pytest.raises(ConfigError, match="latent"):
            LLM({"model": str(folder), "device": "cpu", "dtype": "float32", "attention": {"name": name}})
    with pytest.raises(ConfigError, match="int8"):
        LLM({"model": str(folder), "device": "cpu", "dtype": "float32",
             "cache": {"name": "paged", "options": {"kv_dtype": "int8"}}})


def test_mla_refuses_models_without_latent_attention(tiny_model, cpu_config):
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        LLM(cpu_config(tiny_model("llama"), attention={"name": "mla"}))
