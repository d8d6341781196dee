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
