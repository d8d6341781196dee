"""transformers' continuous-batching baseline (``run_hf_generate_batch``, ``model.generate_batch``):
exact output lengths with EOS ignored, and the same greedy tokens as the padded ``generate``
baseline and as ``generate`` on each prompt alone, on a tiny random Llama on the CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.generation.continuous_batching")

from tessellm.bench.workloads import BenchRequest  # noqa: E402
from tessellm.bench.hf_baseline import (greedy_kwargs, hf_generate_batch_outputs, run_hf_baseline,  # noqa: E402
                                        run_hf_generate_batch)

VOCAB = 256
PAD = 0


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=PAD)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the init's std 0.02 make logits far from ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 1, 24)]


def alone(model, prompt: list[int], n: int) -> list[int]:
    """Greedy ``generate`` on one unpadded prompt, exactly ``n`` new tokens."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             **greedy_kwargs(n, PAD))
    return out[0, len(prompt):].tolist()


def requests_of(prompts, lens) -> list[BenchRequest]:
    return [BenchRequest(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, lens))]


def test_same_greedy_tokens_as_padded_generate_and_exact_counts(model, prompts):
    n = 7
    reference = [alone(model, p, n) for p in prompts]
    assert len({tuple(r) for r in reference}) > 1  # the outputs tell the prompts apart
    # a token greedy emits mid-run becomes the model's EOS: it must not stop any row
    eos = reference[0][2]
    model.generation_config.eos_token_id = model.config.eos_token_id = eos
    try:
        requests = requests_of(prompts, [n] * len(prompts))
        padded = run_hf_baseline(model, requests, pad_id=PAD, batch_size=2, warmup=False)
        batched = run_hf_generate_batch(model, requests, pad_id=PAD, warmup=False)
    finally:
        model.generation_config.eos_token_id = model.config.eos_token_id = 2
    assert padded.outputs == reference
    assert batched.outputs == reference
    assert all(len(o) == n for o in batched.outputs)
    m = batched.metrics()
    assert m["num_requests"] == len(prompts) and m["total_output_tokens"] == n * len(prompts)
    assert m["total_prompt_tokens"] == sum(map(len, prompts)) and m["max_new_tokens"] == n
    assert m["output_tokens_per_s"] > 0 and m["setup_s"] >= 0 and m["attn_implementation"]
    for t in batched.requests:
        assert 0 <= t.ttft_s <= t.e2e_s <= batched.elapsed_s + 1e-6
        assert t.tpot_s is not None and t.tpot_s >= 0


def test_differing_output_lens_run_to_the_longest_and_count_their_own(model, prompts):
    lens = [4, 9, 1, 6]
    requests = requests_of(prompts, lens)
    result = run_hf_generate_batch(model, requests, pad_id=PAD, warmup=False)
    assert [len(o) for o in result.outputs] == lens
    assert [t.output_tokens for t in result.requests] == lens
    assert result.outputs == [alone(model, p, n) for p, n in zip(prompts, lens)]
    assert result.metrics()["max_new_tokens"] == max(lens)
    assert result.requests[2].tpot_s is None  # a single output token has no TPOT


def test_pinned_attention_is_used_and_restored(model, prompts):
    original = model.config._attn_implementation
    outputs, info = hf_generate_batch_outputs(model, prompts[:2], 5, pad_id=PAD, attn_impl="eager")
    assert info["attn_implementation"] == "paged|eager"
    assert model.config._attn_implementation == original
    assert [o.generated_tokens for o in outputs] == [alone(model, p, 5) for p in prompts[:2]]


def test_warmup_and_empty_workload(model, prompts):
    result = run_hf_generate_batch(model, requests_of(prompts[:1], [3]), pad_id=PAD)  # warmup=True path
    assert result.outputs == [alone(model, prompts[0], 3)]
    with pytest.raises(ValueError, match="at least one request"):
        run_hf_generate_batch(model, [], pad_id=PAD)
