"""The model runner against transformers on tiny random-weight models of every supported
architecture, in float64 so any difference is a bug, not rounding."""

from __future__ import annotations

import pytest
import torch

from tessellm import LLM

ARCHS = ["llama", "llama3", "qwen2", "mistral"]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tiny_model, cpu_config):
    from transformers import AutoModelForCausalLM

    folder = tiny_model(request.param)
    llm = LLM(cpu_config(folder, dtype="float64"))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    return request.param, llm, hf


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(3, 49152, (length,), generator=g).tolist() for length in lengths]


def test_prefill_logits_match_transformers(pair):
    arch, llm, hf = pair
    for prompt in _prompts(4, seed=1):
        ours = llm.engine.score(prompt).double()
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert (ours - ref).abs().max().item() < 1e-9, arch


def test_greedy_generation_matches_transformers_alone_and_batched(pair):
    arch, llm, hf = pair
    prompts = _prompts(5, seed=2)
    params = {"max_tokens": 12, "ignore_eos": True}
    batched = llm.generate(prompts, params)
    for prompt, out in zip(prompts, batched):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              pad_token_id=2)[0, len(prompt):].tolist()
        assert out.token_ids == ref, arch
        assert llm.generate([prompt], params)[0].token_ids == ref, arch


# ---------------------------------------------------------------- the model plugins' families

FAMILIES = [
    # (model_type, shape overrides of TINY_SHAPES): each family's defaults, then what it varies
    ("qwen3", {}),  # head_dim 24 != hidden / heads, GQA 4:1, untied
    ("qwen3", dict(num_key_value_heads=4, head_dim=16, tie_word_embeddings=True)),  # MHA, tied
    ("qwen3_moe", {}),  # top-2 of 8 renormalised, layer 1 dense (mlp_only_layers), GQA 4:2, tied
    ("qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False, num_key_value_heads=1,
                       tie_word_embeddings=False)),
    ("qwen2_moe", {}),  # gated shared expert, experts every second layer, top-4 of 6 unnormalised, MHA
    ("qwen2_moe", dict(decoder_sparse_step=1, norm_topk_prob=True, num_key_value_heads=2, tie_word_embeddings=True)),
    ("mixtral", {}),  # top-2 of 8 every layer, head_dim 32 != hidden / heads, GQA 4:2, untied
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=1, num_key_value_heads=1, head_dim=16,
                     tie_word_embeddings=True)),
]
VOCAB = 512
# transformers computes MoE routing weights in float32 even in a float64 model: its logits
# then differ from exact float64 ones by about 1e-6; dense families must agree to rounding
MOE_TOLERANCE, DENSE_TOLERANCE = 1e-5, 1e-9


VARIED = [f for f in FAMILIES if f[1]]  # the default shapes' greedy tokens: tests/conformance/test_model_builtins.py


def family_id(family: tuple) -> str:
    return family[0] + "".join(f"-{k}={v}" for k, v in family[1].items())


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    """(model_type, folder, transformers' model in float64)."""
    from transformers import AutoModelForCausalLM

    from tessellm.testing.models import build_tiny

    model_type, shapes = request.param
    folder = build_tiny(model_type, tmp_path_factory.mktemp(model_type), vocab_size=VOCAB, **shapes)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, experts_implementation="eager").eval()
    return model_type, folder, hf


def _family_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(length),), generator=g).tolist()
            for length in torch.randint(1, 40, (n,), generator=g)]


def hf_greedy(hf, prompt: list[int], new: int) -> list[int]:
    """transformers' model's argmax tokens, EOS included (its generate's min_new_tokens would
    mask EOS, which ignore_eos does not)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("family", FAMILIES, ids=family_id, indirect=True)
def test_family_prefill_logits_match_transformers_in_float64(family, cpu_config):
    model_type, folder, hf = family
    llm = LLM(cpu_config(folder, dtype="float64"))
    assert llm.pipeline.spec.architecture == {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2-moe"}.get(model_type,
                                                                                                  model_type)
    tolerance = MOE_TOLERANCE if llm.pipeline.spec.moe else DENSE_TOLERANCE
    for prompt in _family_prompts(3, seed=1):
        ours = llm.engine.score(prompt).double()
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert (ours - ref).abs().max().item() < tolerance, model_type


@pytest.mark.parametrize("family", VARIED, ids=family_id, indirect=True)
def test_family_greedy_tokens_match_transformers_in_float32(family, cpu_config):
    """transformers' greedy tokens (float32), alone and batched, through the default paged
    cache and continuous batching, on the varied shapes (the model conformance suite covers
    each family's default shapes)."""
    model_type, folder, hf = family
    hf32 = hf.float()
    try:
        prompts = _family_prompts(4, seed=2)
        config = cpu_config(folder, cache={"name": "paged", "options": {"block_size": 8}},
                            scheduler={"name": "continuous"}, decoding={"name": "greedy"})
        llm = LLM(config)
        params = {"max_tokens": 10, "ignore_eos": True}
        batched = llm.generate(prompts, params)
        for prompt, out in zip(prompts, batched):
            assert out.token_ids == hf_greedy(hf32, prompt, 10), model_type
        assert llm.generate([prompts[0]], params)[0].token_ids == batched[0].token_ids
    finally:
        hf.double()
