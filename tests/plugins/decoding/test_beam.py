"""`beam`: beam search equals transformers' ``generate(num_beams=k, do_sample=False)`` token for
token, scores within 1e-4, for k from 1 to 8 with length penalties and every early_stopping
mode, prompts of different lengths batched together, EOS and max_tokens endings; beside
greedy and sampled requests in the same batch (each gets what it gets alone), under chunked
prefill and preemption; beams share their prompt's blocks; what does not combine is refused.

The tiny model's vocabulary is 32 tokens with EOS's embedding scaled up, so hypotheses end
with EOS as often as by length."""

from __future__ import annotations

import random

import pytest
import safetensors.torch
import torch

from tessellm import LLM, SamplingParams
from tessellm.core.errors import InvalidRequestError, RequestRejectedError
from tessellm.testing.models import build_tiny_llama

EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = build_tiny_llama(tmp_path_factory.mktemp("beam") / "model", vocab_size=32)
    weights = safetensors.torch.load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"][EOS] *= 3  # tied: EOS's logit grows, so beams end with it often
    safetensors.torch.save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def hf(model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def config(model, blocks: int = 512, budget: int = 1024, **options) -> dict:
    return {"model": str(model), "device": "cpu", "dtype": "float32", "decoding": {"name": "beam", "options": options},
            "cache": {"name": "paged", "options": {"block_size": 4, "num_blocks": blocks}},
            "scheduler": {"name": "continuous", "options": {"max_num_batched_tokens": budget}}}


def beam_params(k: int, n: int = 1, max_tokens: int = 8, length_penalty: float = 1.0, early_stopping=False) -> dict:
    return {"max_tokens": max_tokens, "n": n, "extra_args": {"num_beams": k, "length_penalty": length_penalty,
                                                              "early_stopping": early_stopping}}


def reference(hf, prompt: list[int], p: dict) -> list[tuple[list[int], float | None]]:
    """transformers' n best: generated tokens (padding cut) and scores (None for k = 1)."""
    a = p["extra_args"]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), num_beams=a["num_beams"], do_sample=False,
                          max_new_tokens=p["max_tokens"], length_penalty=a["length_penalty"],
                          early_stopping=a["early_stopping"], num_return_sequences=p["n"], eos_token_id=[EOS],
                          pad_token_id=PAD, output_scores=True, return_dict_in_generate=True)
    scores = out.sequences_scores.tolist() if a["num_beams"] > 1 else [None] * p["n"]
    return [(out.sequences[i, len(prompt):].tolist(), scores[i]) for i in range(p["n"])]


def assert_equal(got, want) -> None:
    """tessellm's results equal transformers': the same tokens (transformers pads shorter
    ones with EOS, as its pad id is 0) and scores within 1e-4."""
    assert len(got.outputs) == len(want)
    for out, (tokens, score) in zip(got.outputs, want):
        assert tokens[:len(out.token_ids)] == out.token_ids and set(tokens[len(out.token_ids):]) <= {PAD, EOS}, \
            (out.token_ids, tokens)
        if score is not None:
            assert out.score == pytest.approx(score, abs=1e-4)
            assert out.finish_reason == ("stop" if out.token_ids[-1] == EOS else "length")


def cases(seed: int, count: int) -> list[tuple[list[int], dict]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        k = 1 + i % 8  # every k from 1 to 8
        p = beam_params(k, rng.randint(1, k), rng.randint(1, 12), rng.choice([1.0, 0.0, 2.0, -0.5]),
                        rng.choice([False, True, "never"]))
        out.append(([1] + [rng.randint(3, 31) for _ in range(rng.randint(1, 14))], p))
    return out


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async-scheduling"])
def test_batched_beams_equal_transformers(model, hf, overlapped):
    llm = LLM({**config(model), "async_scheduling": overlapped})
    batch = cases(0, 24)
    outs = llm.generate([p for p, _ in batch], [q for _, q in batch])
    for (prompt, p), got in zip(batch, outs):
        assert_equal(got, reference(hf, prompt, p))
    ends = [o.token_ids[-1] == EOS for r in outs for o in r.outputs]
    assert any(ends) and not all(ends)  # both endings met
    assert llm.pipeline.cache.num_free_blocks == llm.pipeline.cache.num_blocks


@pytest.mark.parametrize("blocks, budget", [(24, 1024), (512, 8)], ids=["preemption", "chunked"])
def test_beams_beside_greedy_and_sampled_requests(model, hf, blocks, budget):
    """24 blocks of 4 force preemption, which takes a beam group as one; a step budget of 8
    tokens chunks every prompt. Every request gets what it gets alone."""
    llm = LLM(config(model, blocks=blocks, budget=budget))
    batch = cases(1, 8)
    others = [([1, 5, 9, 12, 3], {"max_tokens": 8}), ([1, 7, 7, 20], {"max_tokens": 8, "temperature": 0.9, "seed": 4})]
    prompts = [p for p, _ in batch] + [p for p, _ in others]
    outs = llm.generate(prompts, [q for _, q in batch] + [q for _, q in others])
    for (prompt, p), got in zip(batch, outs):
        assert_equal(got, reference(hf, prompt, p))
    alone = LLM(config(model))
    for (prompt, p), got in zip(others, outs[len(batch):]):
        assert got.token_ids == alone.generate([prompt], p)[0].token_ids
    assert (llm.engine.stats.preemptions > 0) == (blocks == 24)
    assert llm.pipeline.cache.num_free_blocks == llm.pipeline.cache.num_blocks


def test_beams_share_their_prompts_blocks(model):
    """4 beams over a 64-token prompt (16 blocks) hold the prompt once: their peak is the
    prompt's blocks and a few of each beam's own, far below 4 separate sequences."""
    llm = LLM(config(model))
    prompt = [1] + [3 + i % 28 for i in range(63)]
    llm.generate([prompt], beam_params(4, max_tokens=8))
    peak = llm.engine.stats.peak_kv_blocks
    separate = 4 * -(-(64 + 8) // 4)
    assert peak <= 16 + 4 * 3 and peak < separate / 2


def test_the_options_set_beams_for_greedy_requests(model, hf):
    llm = LLM(config(model, num_beams=3, length_penalty=0.0))
    prompt = [1, 4, 8, 15, 16]
    got = llm.generate([prompt], {"max_tokens": 6})[0]
    assert_equal(got, reference(hf, prompt, beam_params(3, max_tokens=6, length_penalty=0.0)))
    sampled = llm.generate([prompt], {"max_tokens": 6, "temperature": 0.8, "seed": 1})[0]
    assert sampled.outputs[0].score is None  # a sampled request is not a beam search


@pytest.mark.parametrize("fields, words", [
    ({"temperature": 0.7}, "temperature"), ({"logprobs": 2}, "logprobs"), ({"stop": ["t5"]}, "stop"),
    ({"min_tokens": 2}, "min_tokens"), ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"n": 5}, "n \\(5\\) asks for more results than num_beams \\(4\\)"),
])
def test_what_beams_do_not_combine_with_is_refused_with_the_reason(model, fields, words):
    llm = LLM(config(model))
    with pytest.raises(InvalidRequestError, match=words):
        llm.generate([[1, 5, 6]], {**beam_params(4), **fields})


def test_more_beams_than_a_step_holds_is_rejected(model):
    llm = LLM(config(model, budget=3))
    with pytest.raises(RequestRejectedError, match="max_num_batched_tokens=3"):
        llm.generate([[1, 5]], beam_params(4))


def test_an_aborted_beam_search_frees_every_block(model):
    llm = LLM(config(model))
    engine = llm.engine
    engine.add_request("beams", [1] + list(range(3, 30)), SamplingParams(**beam_params(5, max_tokens=12)))
    for _ in range(4):
        engine.step()
    assert len(engine.requests["beams"].seqs) == 5
    engine.abort("beams")
    assert llm.pipeline.cache.num_free_blocks == llm.pipeline.cache.num_blocks and not engine.has_unfinished()


@pytest.mark.parametrize("k, n, length_penalty, early_stopping", [(4, 2, 1.0, False), (8, 3, 0.5, True),
                                                                  (2, 1, 2.0, "never")])
def test_smollm2_beams_equal_transformers(smollm2_llm_beam, k, n, length_penalty, early_stopping):
    llm, hf = smollm2_llm_beam
    tok = llm.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):")]
    eos = sorted(llm.pipeline.stop.eos_token_ids)
    p = beam_params(k, n=n, max_tokens=12, length_penalty=length_penalty, early_stopping=early_stopping)
    for prompt, got in zip(prompts, llm.generate(prompts, p)):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), num_beams=k, do_sample=False, max_new_tokens=12,
                              num_return_sequences=n, eos_token_id=eos, pad_token_id=eos[0], output_scores=True,
                              return_dict_in_generate=True, length_penalty=length_penalty,
                              early_stopping=early_stopping)
        for i, o in enumerate(got.outputs):
            want = out.sequences[i, len(prompt):].tolist()
            assert want[:len(o.token_ids)] == o.token_ids and set(want[len(o.token_ids):]) <= set(eos)
            assert o.score == pytest.approx(out.sequences_scores[i].item(), abs=1e-4)


@pytest.fixture(scope="module")
def smollm2_llm_beam(smollm2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return LLM({"model": str(smollm2_dir), "device": "cpu", "dtype": "float32", "decoding": {"name": "beam"}}), hf


def test_beam_requests_with_a_shared_prompt_share_its_cached_blocks(model, hf):
    llm = LLM(config(model))
    prompt = [1] + [4 + i % 27 for i in range(40)]
    first, second = (llm.generate([prompt], beam_params(3, n=2, max_tokens=6))[0] for _ in range(2))
    assert second.num_cached_tokens == 40 and first.num_cached_tokens == 0
    want = reference(hf, prompt, beam_params(3, n=2, max_tokens=6))
    assert_equal(first, want)
    assert_equal(second, want)


def test_beams_under_the_static_scheduler(model, hf):
    llm = LLM({**config(model, blocks=24), "scheduler": {"name": "static", "options": {"max_batch_size": 16}}})
    batch = cases(2, 6)
    for (prompt, p), got in zip(batch, llm.generate([p for p, _ in batch], [q for _, q in batch])):
        assert_equal(got, reference(hf, prompt, p))
    assert llm.pipeline.cache.num_free_blocks == llm.pipeline.cache.num_blocks
