"""Structured outputs and tool calling over HTTP with the real SmolLM2 model on the CPU:
JSON-schema answers parse and fit their schema on every prompt at temperature 0.8 (plain,
streamed, through the openai client), json_object, vLLM's structured_outputs (regex, choice,
EBNF), tool calls under required, a named function and auto (whole and streamed), a second
turn carrying the call and its result, and the 400s for what cannot work."""

from __future__ import annotations

import json
import re

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tessellm.serve.app import build_app
from tessellm.testing.serving import serving

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

pytestmark = pytest.mark.slow

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Tokyo", "Lima", "Oslo"]},
                         "hobbies": {"type": "array", "items": {"enum": ["chess", "music", "running"]},
                                     "maxItems": 3}},
          "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
PROMPTS = ["Describe a person as JSON.", "Invent a character who lives in a big city.",
           "Who is your favourite neighbour?", "Give me a JSON record of a chess player.",
           "Tell me about an old sailor.", "Make up a student.", "Name someone who loves music.",
           "A runner from Lima."]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"]}}}


@pytest.fixture(scope="module")
def server():
    """The server's default plugins (paged cache, continuous batching): requests sent at once
    share their steps. (Behind the session's static batches, a request that arrived a moment
    after the first waited for that whole batch to finish: nearly twice the steps.)"""
    from tessellm import LLM

    llm = LLM({"model": "smollm2-135m", "device": "cpu", "dtype": "float32",
               "cache": {"name": "paged", "options": {"num_blocks": 256}},
               "scheduler": {"name": "continuous", "options": {"max_num_seqs": 16}}})
    with serving(build_app(llm, model_name="smol")) as url:
        yield url


def chat(url: str, content: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=300,
                      json={"model": "smol", "messages": [{"role": "user", "content": content}], **body})


def chat_all(url: str, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    """Send the requests at once (the server batches them: one model pass per step for all)."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: chat(url, r[0], **r[1]), requests))


def schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


@pytest.mark.extended
def test_json_schema_answers_fit_on_every_prompt_at_temperature_0_8(server):
    answers = chat_all(server, [(prompt, dict(temperature=0.8, seed=i, max_tokens=100,
                                              response_format=schema_format(PERSON)))
                                for i, prompt in enumerate(PROMPTS)])
    for r in answers:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_streamed_json_schema_answer_fits(server):
    with httpx.stream("POST", f"{server}/v1/chat/completions", timeout=120, json={
            "model": "smol", "messages": [{"role": "user", "content": PROMPTS[0]}], "stream": True,
            "temperature": 0.8, "seed": 7, "max_tokens": 120, "response_format": schema_format(PERSON)}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    jsonschema.validate(json.loads(text), PERSON)


def test_openai_client_json_object_and_structured_outputs(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    out = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "A JSON object, please."}],
                                         response_format={"type": "json_object"}, max_tokens=40, temperature=0.8,
                                         seed=1)
    if out.choices[0].finish_reason == "stop":  # any object: it may run past max_tokens
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    cases = [({"regex": r"[A-Z][a-z]{2,8} [0-9]{1,2}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,2}", t)),
             ({"choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative")),
             ({"grammar": 'root ::= "yes" | "no" | "maybe"'}, lambda t: t in ("yes", "no", "maybe")),
             ({"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None)]
    def complete(structured: dict) -> str:
        return client.completions.create(model="smol", prompt="The answer:", max_tokens=100, temperature=0.8, seed=2,
                                         extra_body={"structured_outputs": structured}).choices[0].text

    with ThreadPoolExecutor(len(cases)) as pool:
        texts = list(pool.map(complete, [structured for structured, _ in cases]))
    for (structured, fits), text in zip(cases, texts):
        assert fits(text), (structured, text)


def test_bad_schema_and_conflicts_are_400s(server):
    r = chat(server, "hi", structured_outputs={"regex": "(unclosed"})
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"]
    r = chat(server, "hi", response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert r.status_code == 400 and "schema" in r.json()["error"]["message"]
    r = chat(server, "hi", response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}})
    assert r.status_code == 400 and "json_schema" in r.json()["error"]["message"]
    r = chat(server, "hi", structured_outputs={"regex": "a", "choice": ["b"]})
    assert r.status_code == 400 and "exactly one" in r.json()["error"]["message"]
    r = chat(server, "hi", response_format={"type": "json_object"}, structured_outputs={"regex": "a"})
    assert r.status_code == 400 and "both" in r.json()["error"]["message"]
    r = chat(server, "hi", guided_regex="a+")
    assert r.status_code == 400 and "structured_outputs" in r.json()["error"]["message"]
    r = chat(server, "hi", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


def check_calls(calls: list[dict], allowed: dict[str, dict]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        schema = allowed[call["function"]["name"]]["function"]["parameters"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


@pytest.mark.parametrize("tool_choice", ["required", pytest.param({"type": "function", "function": {"name": "get_time"}},
                                                                   marks=pytest.mark.extended)])
def test_required_and_named_tool_calls_always_fit(server, tool_choice):
    prompts = ["What's the weather in Paris?", "What time is it in Tokyo?", "Hello!"]
    answers = chat_all(server, [(prompt, dict(tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0.8, seed=i,
                                              max_tokens=100)) for i, prompt in enumerate(prompts)])
    for r in answers:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
        check_calls(choice["message"]["tool_calls"], {"get_weather": WEATHER, "get_time": TIME})
        if isinstance(tool_choice, dict):
            assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]


def test_streamed_tool_call_and_a_second_turn(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    messages = [{"role": "user", "content": "What's the weather in Oslo?"}]
    stream = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER], tool_choice="required",
                                            stream=True, max_tokens=120, temperature=0.0)
    calls, reasons = {}, []
    for chunk in stream:
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                entry["arguments"] += tc.function.arguments or ""
    assert reasons[-1] == "tool_calls" and calls
    call = calls[0]
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])
    messages += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "12 degrees and rain"}]
    out = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER], max_tokens=30,
                                         temperature=0.0)
    message = out.choices[0].message
    assert message.content or message.tool_calls


def test_auto_tool_choice_returns_calls_or_content(server):
    r = chat(server, "What's the weather in Lima? Call the function.", tools=[WEATHER], max_tokens=40, temperature=0.0)
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "tool_calls":
        check_calls(choice["message"]["tool_calls"], {"get_weather": WEATHER})
    else:
        assert isinstance(choice["message"]["content"], str)
