"""A tiny random Llama pipeline and its float64 transformers twin, shared by the eval tests."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_llm(tiny_model, cpu_config):
    from tessellm import LLM

    return LLM(cpu_config(tiny_model("llama"), decoding={"name": "greedy"}))


@pytest.fixture(scope="module")
def tiny_config_file(tiny_model, cpu_config, tmp_path_factory):
    path = tmp_path_factory.mktemp("eval-config") / "tiny.json"
    path.write_text(json.dumps(cpu_config(tiny_model("llama"), decoding={"name": "greedy"})))
    return path


@pytest.fixture(scope="module")
def reference_logprobs(tiny_model):
    """fn(token_ids) -> float64 log-softmax [len, vocab] of the tiny model in transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float64).eval()

    @torch.no_grad()
    def logprobs(token_ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([token_ids])).logits[0].log_softmax(-1)

    return logprobs
