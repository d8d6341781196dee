"""The server's surface around generation, as clients meet it: the model list and
``GET /v1/models/{id}`` (the openai client's ``models.retrieve``, a stable ``created``, a 404
for an unknown id, on every route that takes a model), vLLM's /tokenize and /detokenize (text or chat messages in, the ids the
generating routes would use out), and OpenAI's error body for every failure of every route:
unknown routes, wrong methods, bodies that are not JSON or not sent as JSON, fields that fail
validation (named as the API names them, with ``param``), limits the engine sets."""

from __future__ import annotations

import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from tessellm import LLM  # noqa: E402
from tessellm.serve.app import build_app  # noqa: E402
from tessellm.serve.tools import render_chat  # noqa: E402
from tessellm.testing.serving import serving  # noqa: E402

MODEL = "tiny"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def served(cpu_config, tiny_model):
    """A live server (with one extra route that fails, to see a bug's 500); yields (url, app, llm)."""
    llm = LLM(cpu_config(tiny_model("llama"), max_model_len=256, scheduler={"name": "continuous"},
                         cache={"name": "paged", "options": {"block_size": 8, "num_blocks": 256}}))
    app = build_app(llm, model_name=MODEL)

    @app.get("/test-only/bug")
    async def bug():
        raise KeyError("a bug")

    with serving(app) as url:
        yield url, app, llm


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, *words: str) -> dict:
    """``r`` is ``status`` with exactly OpenAI's error body, ``param`` set, its message
    holding ``words`` and none of pydantic's own names for places (``body``, ``stop.str``)."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error"), err
    assert not err["message"].startswith("body") and ".str" not in err["message"] and "detail" not in body, err
    return err


# ---------------------------------------------------------------------------- models


def test_models_list_and_retrieve_share_a_stable_created(served, client):
    _, app, _ = served
    listed = client.models.list().data
    time.sleep(1.05)  # a clock that moved on changes nothing
    again, model = client.models.list().data, client.models.retrieve(MODEL)
    assert [m.id for m in listed] == [MODEL] and listed[0].created == again[0].created == model.created
    assert model.created == app.state.ctx.created <= time.time() and model.owned_by == "tessellm"
    assert model.object == "model"


@pytest.mark.parametrize("model_id", ["gpt-4o", "org/some-model"])
def test_retrieving_an_unknown_model_is_openai_not_found(client, served, model_id):
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve(model_id)
    assert caught.value.code == "model_not_found" and model_id in caught.value.message
    err = assert_openai_error(httpx.get(f"{served[0]}/v1/models/{model_id}"), 404, "model", model_id)
    assert err["code"] == "model_not_found"


# ---------------------------------------------------------------------------- tokenize, detokenize


def tokenize(url: str, **body) -> dict:
    r = httpx.post(f"{url}/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenize_a_prompt_and_detokenize_it_back(served):
    url, _, llm = served
    text = "The capital of France is Paris."
    out = tokenize(url, model=MODEL, prompt=text)
    ids = llm.tokenizer(text)["input_ids"]
    assert out == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    strs = tokenize(url, prompt=text, return_token_strs=True)["token_strs"]  # model is optional, as in vLLM
    assert strs == llm.tokenizer.convert_ids_to_tokens(ids)
    bare = tokenize(url, prompt=text, add_special_tokens=False)["tokens"]
    assert bare == llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    r = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": bare}, timeout=60)
    assert r.status_code == 200 and r.json() == {"prompt": text}


def test_tokenize_messages_counts_what_the_chat_route_prefills(served, client):
    """The ids of messages are the prompt the chat route runs: its usage counts as many."""
    url, _, llm = served
    out = tokenize(url, model=MODEL, messages=CHAT)
    answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0)
    assert out["count"] == len(out["tokens"]) == answer.usage.prompt_tokens
    text = render_chat(CHAT, llm.tokenizer)
    assert out["tokens"] == llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    without = tokenize(url, messages=CHAT, add_generation_prompt=False)["tokens"]
    assert len(without) < out["count"] and out["tokens"][:len(without)] == without
    prefill = CHAT + [{"role": "assistant", "content": "An apple"}]
    opened = tokenize(url, messages=prefill, continue_final_message=True)["tokens"]
    assert llm.tokenizer.decode(opened).rstrip().endswith("An apple")


@pytest.mark.parametrize("path, body, param, words", [
    ("/tokenize", {"model": MODEL}, None, ["exactly one of prompt", "messages"]),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, None, ["exactly one of prompt"]),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message", ["cannot both be true"]),
    ("/tokenize", {"messages": [{"role": "user"}]}, "messages[0]", ["needs content"]),
    ("/detokenize", {"tokens": [5, 10 ** 8]}, "tokens", ["100000000", "vocabulary"]),
    ("/detokenize", {"tokens": "abc"}, "tokens", ["valid list"]),
    ("/detokenize", {}, "tokens", ["Missing required parameter"]),
])
def test_tokenizer_routes_refuse_in_openai_shape(served, path, body, param, words):
    assert_openai_error(httpx.post(served[0] + path, json=body, timeout=60), 400, param, *words)


# ---------------------------------------------------------------------------- errors on every route


@pytest.mark.parametrize("method, path, status, words", [
    ("GET", "/v1/nothing-here", 404, ["Invalid URL (GET /v1/nothing-here)"]),
    ("POST", "/v1/completion", 404, ["Invalid URL (POST /v1/completion)"]),
    ("GET", "/v1/completions", 405, ["Invalid method for URL (GET /v1/completions)"]),
    ("DELETE", "/v1/chat/completions", 405, ["Invalid method"]),
    ("POST", "/v1/models", 405, ["Invalid method"]),
    ("GET", "/tokenize", 405, ["Invalid method"]),
])
def test_unknown_routes_and_wrong_methods(served, method, path, status, words):
    r = httpx.request(method, served[0] + path, json={"model": MODEL} if method == "POST" else None, timeout=60)
    assert_openai_error(r, status, None, *words)
    if status == 405:
        assert r.headers["allow"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("content, content_type, words", [
    (b'{"model": "tiny", "prompt": ', "application/json", ["not valid JSON"]),
    (b'{"model": "tiny", "prompt": "hi"}', "text/plain", ["must be JSON", "Content-Type: application/json",
                                                          "text/plain"]),
    (b"model=tiny&prompt=hi", "application/x-www-form-urlencoded", ["must be JSON"]),
    (b'["tiny", "hi"]', "application/json", ["must be a JSON object", "an array"]),
    (b"", "application/json", ["body is empty"]),
])
def test_a_body_that_is_not_a_json_object(served, path, content, content_type, words):
    r = httpx.post(served[0] + path, content=content, headers={"Content-Type": content_type}, timeout=60)
    assert_openai_error(r, 400, None, *words)


@pytest.mark.parametrize("path, fields, param, words", [
    ("completions", {"stop": 5}, "stop", ["stop: got 5", "valid string", "valid list"]),
    ("completions", {"prompt": [1, "a"]}, "prompt", ["prompt: got [1, 'a']"]),
    ("completions", {"n": 65}, "n", ["n:", "64", "65"]),
    ("chat/completions", {"n": 65}, "n", ["n:", "64"]),
    ("completions", {"n": 0}, "n", ["n:", "greater than or equal to 1"]),
    ("completions", {"temperature": "hot"}, "temperature", ["temperature:", "'hot'"]),
    ("completions", {"max_tokens": 10 ** 9}, "max_tokens", ["max_tokens:"]),
    ("completions", {"prompt": None}, "prompt", []),
    ("completions", {"model": None}, "model", []),
    ("completions", {"logit_bias": {"5": 300}}, "logit_bias", ["-100, 100"]),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias", ["token ids"]),
    ("completions", {"suffix": "!"}, "suffix", ["suffix is not supported"]),
    ("completions", {"best_of": 3}, "best_of", ["best_of"]),
    ("completions", {"prompt": "word " * 300}, "prompt", ["context window"]),
    ("completions", {"prompt": ["hi", "word " * 300]}, "prompt", ["prompt 1:", "context window"]),
    ("completions", {"prompt": [1, 2, 10 ** 8]}, "prompt", ["vocabulary"]),
    ("completions", {"max_tokens": 0}, "max_tokens", ["echo"]),
    ("completions", {"response_format": {"type": "xml"}}, "response_format.type", ["'xml'"]),
    ("chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", ["'bot'"]),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", ["got 5"]),
    ("chat/completions", {"messages": []}, "messages", ["at least 1"]),
    ("chat/completions", {"top_logprobs": 3}, "top_logprobs", ["logprobs: true"]),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", ["20"]),
    ("chat/completions", {"max_completion_tokens": 10 ** 9}, "max_completion_tokens", ["1000000"]),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice", ["declares no tools"]),
])
def test_validation_errors_name_the_field_as_the_api_does(served, path, fields, param, words):
    base = {"model": MODEL, "max_tokens": 4}
    base.update({"prompt": "hi"} if path == "completions" else {"messages": [{"role": "user", "content": "hi"}]})
    body = {k: v for k, v in {**base, **fields}.items() if v is not None}
    assert_openai_error(httpx.post(f"{served[0]}/v1/{path}", json=body, timeout=60), 400, param, *words)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi"}),
    ("/tokenize", {"prompt": "a"}),
    ("/detokenize", {"tokens": [5]}),
])
def test_an_unknown_model_is_a_404_on_every_route(served, path, body):
    """As ``GET /v1/models/{id}`` answers it (and OpenAI and vLLM do): ``model_not_found``."""
    r = httpx.post(served[0] + path, json={"model": "gpt-4", **body}, timeout=60)
    err = assert_openai_error(r, 404, "model", "'gpt-4'", "does not exist", f"'{MODEL}'")
    assert err["code"] == "model_not_found"


def test_the_openai_client_reads_the_field_of_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hi", n=65, max_tokens=2)
    assert caught.value.param == "n" and caught.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stop=5)
    assert caught.value.param == "stop"


def test_a_bug_in_a_route_is_a_500_in_openai_shape(served):
    assert_openai_error(httpx.get(served[0] + "/test-only/bug", timeout=60), 500, None, "KeyError")
