"""Nothing silently ignored on the chat route: ``chat_template_kwargs`` reach the template,
``add_generation_prompt`` and ``continue_final_message`` shape the prompt as vLLM defines
them (on /v1/chat/completions and /tokenize alike), ``stream_options.continuous_usage_stats``
puts the usage so far in every chunk, and what cannot be served is a 400 naming the field;
/version and /ping answer."""

from __future__ import annotations

import json

import httpx
import pytest

from tessellm import LLM
from tessellm.serve.app import build_app
from tessellm.testing.models import build_tiny
from tessellm.testing.serving import serving

MODEL = "tiny"
# words joined by spaces; the generation prompt is "t7", and the template's own argument
# ``extra`` adds "t9" before it
TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
            "{% if extra %} t9{% endif %}{% if add_generation_prompt %} t7{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = build_tiny("llama", tmp_path_factory.mktemp("chat-fields") / "m")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    llm = LLM({"model": str(folder), "device": "cpu", "dtype": "float32", "max_model_len": 128,
               "cache": {"name": "paged", "options": {"block_size": 8, "num_blocks": 128}},
               "scheduler": {"name": "continuous"}, "decoding": {"name": "greedy"}})
    with serving(build_app(llm, model_name=MODEL)) as url:
        yield url, llm


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 3, "temperature": 0,
                                                           "messages": [{"role": "user", "content": "t5 t6"}], **body},
                      timeout=60)


def tokenize(url: str, **body) -> list[int]:
    r = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "t5 t6"}], **body})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_template_arguments_and_endings_shape_the_prompt(server):
    url, llm = server
    words = lambda ids: llm.tokenizer.decode(ids).split()  # noqa: E731
    assert words(tokenize(url)) == ["t5", "t6", "t7"]
    assert words(tokenize(url, chat_template_kwargs={"extra": True})) == ["t5", "t6", "t9", "t7"]
    assert words(tokenize(url, add_generation_prompt=False)) == ["t5", "t6"]
    for fields, expected in (({}, 3), ({"chat_template_kwargs": {"extra": True}}, 4),
                             ({"add_generation_prompt": False}, 2)):
        r = chat(url, **fields)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == expected, (fields, r.text)


def test_continue_final_message_continues_the_last_message(server):
    url, llm = server
    messages = [{"role": "user", "content": "t5"}, {"role": "assistant", "content": "t6 t8"}]
    ids = tokenize(url, messages=messages, continue_final_message=True)
    assert llm.tokenizer.decode(ids).split() == ["t5", "t6", "t8"]  # open: no generation prompt after it
    r = chat(url, messages=messages, continue_final_message=True)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
    expected = llm.generate([ids], {"max_tokens": 3})[0].text
    assert r.json()["choices"][0]["message"]["content"] == expected


@pytest.mark.parametrize("fields, param", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "extra"}, "chat_template_kwargs"),
    ({"stream": True, "stream_options": {"include_usage": True, "per_token": True}}, "stream_options.per_token"),
])
def test_what_cannot_be_served_is_a_400_naming_it(server, fields, param):
    r = chat(server[0], **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_continuous_usage_stats_put_the_usage_in_every_chunk(server):
    url = server[0]
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": [1, 5, 6], "max_tokens": 5, "temperature": 0, "stream": True,
                            "ignore_eos": True, "stream_options": {"continuous_usage_stats": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usages = [c["usage"] for c in chunks]
    assert all(u["prompt_tokens"] == 3 for u in usages) and usages[-1]["completion_tokens"] == 5
    assert [u["completion_tokens"] for u in usages] == sorted(u["completion_tokens"] for u in usages)
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "max_tokens": 3,
                            "temperature": 0, "stream": True, "ignore_eos": True,
                            "stream_options": {"continuous_usage_stats": True, "include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("usage" in c for c in chunks) and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_version_and_ping(server):
    url = server[0]
    from tessellm import __version__

    assert httpx.get(url + "/version").json() == {"version": __version__}
    assert httpx.get(url + "/ping").status_code == 200 and httpx.post(url + "/ping").status_code == 200
