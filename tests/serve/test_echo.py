"""Completions with ``echo``: the prompt before the completion, the prompt tokens'
log-probabilities from the forward that prefills (the first is null), ``max_tokens: 0``
scoring without generating, batches, streaming, the openai client; and prompt logprobs
offline through chunked prefill, preemption and a warm prefix cache."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tessellm import LLM
from tessellm.serve.app import build_app
from tessellm.testing.serving import serving

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


@pytest.fixture(scope="module")
def llm(cpu_config, tiny_model):
    # a 5-token step budget: every prompt here is prefilled in several chunks
    return LLM(cpu_config(tiny_model("llama"), max_model_len=256, decoding={"name": "greedy"},
                          scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 5}},
                          cache={"name": "paged", "options": {"block_size": 4, "num_blocks": 128,
                                                              "prefix_caching": True}}))


@pytest.fixture(scope="module")
def server(llm):
    with serving(build_app(llm, model_name="tiny", api_key=None)) as url:
        yield url


def reference(llm, ids: list[int]) -> torch.Tensor:
    """Log-softmax of a teacher-forced scoring run: row i predicts token i + 1."""
    return llm.engine.score(ids).double().log_softmax(-1)


def post(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny", "temperature": 0.0, **body}, timeout=60)


def test_offline_prompt_logprobs_equal_a_scoring_run_through_chunks_and_a_warm_prefix_cache(llm):
    ref = reference(llm, PROMPT)
    expected = [ref[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]
    llm.generate([PROMPT], {"max_tokens": 1})  # warm the prefix cache with these blocks
    outs = llm.generate([PROMPT, PROMPT], {"max_tokens": 2, "prompt_logprobs": 3})
    for out in outs:
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
        assert [p.logprob for p in out.prompt_logprobs[1:]] == pytest.approx(expected, abs=1e-4)
        top = out.prompt_logprobs[1].top
        assert len(top) == 3 and top[0][1] == pytest.approx(ref[0].max().item(), abs=1e-4)
        assert out.num_cached_tokens == 0  # a request scoring its prompt reads nothing from the prefix cache
    assert llm.generate([PROMPT], {"max_tokens": 1})[0].num_cached_tokens > 0  # but its blocks were indexed


def test_one_token_prompt_has_only_the_null_first_entry(llm):
    assert llm.generate([[7]], {"max_tokens": 1, "prompt_logprobs": 0})[0].prompt_logprobs == [None]


def test_prompt_logprobs_survive_preemption(cpu_config, tiny_model):
    # 6 blocks of 4 slots: two 17-token prompts cannot both stay, so one is preempted and recomputed
    small = LLM(cpu_config(tiny_model("llama"), max_model_len=64, decoding={"name": "greedy"},
                           scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 8}},
                           cache={"name": "paged", "options": {"block_size": 4, "num_blocks": 7}}))
    ref = reference(small, PROMPT)
    outs = small.generate([PROMPT, PROMPT[::-1]], {"max_tokens": 8, "prompt_logprobs": 0, "ignore_eos": True})
    assert small.engine.stats.preemptions > 0
    assert [p.logprob for p in outs[0].prompt_logprobs[1:]] == pytest.approx(
        [ref[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))], abs=1e-4)
    assert len(outs[1].prompt_logprobs) == len(PROMPT)


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt(server, llm):
    r = post(server, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    ref = reference(llm, PROMPT)
    assert choice["text"] == llm.tokenizer.decode(PROMPT) and choice["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(PROMPT) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([ref[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))],
                                                     abs=1e-4)
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert r.json()["usage"]["completion_tokens"] == 0


def test_echo_puts_the_prompt_before_the_completion(server, llm):
    text = "The quick brown fox"
    plain = post(server, prompt=text, max_tokens=3).json()["choices"][0]
    echoed = post(server, prompt=text, max_tokens=3, echo=True, logprobs=0).json()["choices"][0]
    assert echoed["text"] == text + plain["text"]
    ids = llm.encode(text)
    assert len(echoed["logprobs"]["tokens"]) == len(ids) + 3
    assert echoed["logprobs"]["token_logprobs"][0] is None and None not in echoed["logprobs"]["token_logprobs"][1:]


def test_lm_eval_style_batch_of_token_lists(server, llm):
    """What lm-evaluation-harness's local-completions sends for loglikelihood."""
    prompts = [PROMPT[:6], PROMPT[3:12], PROMPT]
    r = post(server, prompt=prompts, max_tokens=1, echo=True, logprobs=1, seed=1234)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for ids, choice in zip(prompts, choices):
        ref = reference(llm, ids)
        got = choice["logprobs"]["token_logprobs"]
        assert len(got) == len(ids) + 1
        assert got[1:len(ids)] == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4)


def test_streamed_echo_sends_the_prompt_first(server, llm):
    text = "Once upon a time"
    with httpx.stream("POST", f"{server}/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": text, "max_tokens": 3, "temperature": 0.0, "echo": True,
                            "stream": True, "logprobs": 0}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["text"].startswith(text) and first["logprobs"]["token_logprobs"][0] is None
    whole = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert whole == text + post(server, prompt=text, max_tokens=3).json()["choices"][0]["text"]


def test_max_tokens_0_without_echo_is_a_400(server):
    r = post(server, prompt=PROMPT, max_tokens=0)
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


def test_openai_client_echo(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    out = client.completions.create(model="tiny", prompt=["Hello there", "The sky"], max_tokens=0, echo=True,
                                    logprobs=2, temperature=0.0)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == ["Hello there", "The sky"]
    assert out.choices[0].logprobs.token_logprobs[0] is None


@pytest.mark.parametrize("ids", [[5, -3], [5, 10 ** 9]])
def test_echo_of_an_id_outside_the_vocabulary_is_a_400(server, ids):
    r = post(server, prompt=ids, max_tokens=0, echo=True)
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
