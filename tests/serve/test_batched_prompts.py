"""Completions take every prompt form of the OpenAI API: a text, a list of texts, token ids
and a list of token-id lists; a batch answers with choice ``prompt_index * n + sample``,
streamed or not, each equal to that prompt sent alone, and one usage over all of them."""

from __future__ import annotations

import time

import pytest

from tessellm import LLM
from tessellm.serve.app import build_app
from tessellm.testing.serving import serving

TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def client(cpu_config, tiny_model):
    from openai import OpenAI

    llm = LLM(cpu_config(tiny_model("llama"), max_model_len=256, scheduler={"name": "continuous"},
                         cache={"name": "paged", "options": {"block_size": 8, "num_blocks": 256}}))
    with serving(build_app(llm, model_name="tiny", api_key=None, max_request_bytes=64 * 1024)) as url:
        yield OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), llm


def alone(client, prompt) -> str:
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0.0).choices[0].text


@pytest.mark.parametrize("as_ids", [False, True])
def test_a_batch_answers_each_prompt_as_alone_in_order(client, as_ids):
    c, llm = client
    prompts = [llm.encode(t) for t in TEXTS] if as_ids else TEXTS
    out = c.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0.0)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert [ch.text for ch in out.choices] == [alone(c, p) for p in prompts]
    assert out.usage.prompt_tokens == sum(len(llm.encode(t)) for t in TEXTS)
    assert out.usage.completion_tokens == 3 * 6


def test_n_samples_per_prompt_are_indexed_prompt_times_n_plus_sample(client):
    c, _ = client
    out = c.completions.create(model="tiny", prompt=TEXTS[:2], max_tokens=4, temperature=0.9, n=2, seed=5)
    assert sorted(ch.index for ch in out.choices) == [0, 1, 2, 3]
    single = c.completions.create(model="tiny", prompt=TEXTS[1], max_tokens=4, temperature=0.9, n=2, seed=5)
    by_index = {ch.index: ch.text for ch in out.choices}
    assert [by_index[2], by_index[3]] == [ch.text for ch in sorted(single.choices, key=lambda ch: ch.index)]


def test_a_streamed_batch_concatenates_to_the_unstreamed_one(client):
    c, _ = client
    whole = c.completions.create(model="tiny", prompt=TEXTS, max_tokens=6, temperature=0.0)
    texts: dict[int, str] = {}
    usage = None
    for chunk in c.completions.create(model="tiny", prompt=TEXTS, max_tokens=6, temperature=0.0, stream=True,
                                      stream_options={"include_usage": True}):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
        usage = chunk.usage or usage
    assert texts == {ch.index: ch.text for ch in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_a_bad_prompt_of_a_batch_is_a_400_naming_it(client):
    from openai import BadRequestError

    c, llm = client
    with pytest.raises(BadRequestError, match="prompt 1"):
        c.completions.create(model="tiny", prompt=[[5, 6], [10**9]], max_tokens=2)
    with pytest.raises(BadRequestError, match="empty list"):
        c.completions.create(model="tiny", prompt=[], max_tokens=2)
    deadline = time.time() + 20  # the batch's good prompt was admitted: it is aborted, nothing leaks
    cache = llm.pipeline.cache
    while llm.engine.requests or cache.num_free_blocks != cache.num_blocks:
        assert time.time() < deadline, f"{len(llm.engine.requests)} requests left"
        time.sleep(0.05)
