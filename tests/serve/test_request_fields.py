"""No request field is silently ignored: fields that would change the result and are not
implemented are a 400 naming them; fields that cannot change it are accepted; logprobs go up
to 20; logit_bias forces and bans tokens (offline and over HTTP); vLLM's min_tokens reaches
the engine."""

from __future__ import annotations

import httpx
import pytest

from tessellm import LLM
from tessellm.serve.app import build_app
from tessellm.testing.serving import serving


@pytest.fixture(scope="module")
def served(cpu_config, tiny_model):
    llm = LLM(cpu_config(tiny_model("llama"), max_model_len=256, scheduler={"name": "continuous"},
                         cache={"name": "paged", "options": {"block_size": 8, "num_blocks": 256}}))
    with serving(build_app(llm, model_name="tiny", api_key=None, max_request_bytes=64 * 1024)) as url:
        yield url, llm


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def post(url: str, path: str, **body) -> httpx.Response:
    base = {"model": "tiny", "max_tokens": 4, "temperature": 0.0}
    base.update({"prompt": [5, 6, 7]} if path == "completions" else {"messages": [{"role": "user", "content": "hi"}]})
    return httpx.post(f"{url}/v1/{path}", json={**base, **body}, timeout=60)


@pytest.mark.parametrize("path, field, value", [
    ("completions", "suffix", "end"), ("completions", "best_of", 3),
    ("completions", "prediction", {"type": "content", "content": "x"}),
    ("chat/completions", "functions", [{"name": "f", "parameters": {}}]),
    ("chat/completions", "tool_choice", "required"), ("chat/completions", "modalities", ["audio"]),
    ("completions", "guided_regex", "a+"),
])
def test_unimplemented_fields_that_change_the_result_are_400_naming_them(server, path, field, value):
    r = post(server, path, **{field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path, extra", [
    ("completions", {"echo": False, "suffix": None, "best_of": 1, "logit_bias": {}, "presence_penalty": 0}),
    ("chat/completions", {"presence_penalty": None, "frequency_penalty": None, "logits_processors": None}),
    ("chat/completions", {"response_format": {"type": "text"}, "tool_choice": "none", "tools": []}),
    ("completions", {"user": "u1", "metadata": {"a": "b"}, "store": False, "some_vendor_field": 1}),
])
def test_fields_that_cannot_change_the_result_are_accepted(server, path, extra):
    assert post(server, path, **extra).status_code == 200


def test_twenty_top_logprobs_and_min_tokens(server):
    r = post(server, "completions", logprobs=20)
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 20
    r = post(server, "chat/completions", logprobs=True, top_logprobs=20)
    assert r.status_code == 200
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20
    assert post(server, "completions", logprobs=21).status_code == 400
    r = post(server, "completions", max_tokens=6, min_tokens=6)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6


def test_logit_bias_forces_and_bans_tokens(served):
    url, llm = served
    greedy = llm.generate([[5, 6, 7]], {"max_tokens": 5})[0].token_ids

    assert llm.generate([[5, 6, 7]], {"max_tokens": 5, "logit_bias": {1234: 100}})[0].token_ids == [1234] * 5
    assert llm.generate([[5, 6, 7]], {"max_tokens": 1, "logit_bias": {greedy[0]: -100}})[0].token_ids != greedy[:1]
    r = post(url, "completions", max_tokens=5, logit_bias={"1234": 100})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == llm.tokenizer.decode([1234] * 5)
    r = post(url, "chat/completions", max_tokens=3, logit_bias={"1234": 100})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == llm.tokenizer.decode([1234] * 3)


@pytest.mark.parametrize("bias, words", [({"abc": 1}, "token ids"), ({"5": 101}, "-100, 100"),
                                         ({"999999999": 1}, "outside the vocabulary")])
def test_bad_logit_bias_is_a_400(server, bias, words):
    r = post(server, "completions", logit_bias=bias)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_a_malformed_earlier_tool_call_is_a_400_naming_the_field(server):
    r = post(server, "chat/completions", messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [{"bad": 1}]}])
    assert r.status_code == 400 and "tool_calls" in r.json()["error"]["message"], r.text
