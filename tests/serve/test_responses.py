"""POST /v1/responses driven by the official openai client against a live server (a tiny
random-weight Llama with SmolLM2's tokenizer and chat template): a text input and message
items with instructions answer as the chat route does for the same conversation (greedy);
max_output_tokens makes a response incomplete; a stream's typed events come in order and
build the final response; text.format json_schema gives JSON that fits; a required function
tool gives a function_call item whose follow-up (previous_response_id and its output)
continues as the chat route would; the openai library's pydantic models validate every
response and event as sent; stored responses are retrieved and deleted, store=false ones are
neither kept nor continued; an engine failure fails the response; a client that leaves
aborts its request; what is not served is a 400 naming the field (an unknown model, a 404
``model_not_found``: tests/serve/test_openai_surface.py)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from pydantic import BaseModel, TypeAdapter  # noqa: E402

from tessellm import LLM  # noqa: E402
from tessellm.serve.app import build_app  # noqa: E402
from tessellm.serve.responses import ResponseStore, Stored  # noqa: E402
from tessellm.testing.serving import serving  # noqa: E402

MODEL = "tiny"
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima", "Oslo"]},
                                         "warm": {"type": "boolean"}},
        "required": ["city", "warm"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}
AS_CHAT_TOOL = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


@pytest.fixture(scope="module")
def llm(cpu_config, tiny_model):
    return LLM(cpu_config(tiny_model("llama"), max_model_len=256, scheduler={"name": "continuous"},
                          cache={"name": "paged", "options": {"block_size": 16, "num_blocks": 512}}))


@pytest.fixture(scope="module")
def app(llm):
    return build_app(llm, model_name=MODEL)


@pytest.fixture(scope="module")
def server(app):
    with serving(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def chat_text(client, messages, max_tokens, **more):
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **more)
    return out.choices[0]


def test_a_text_input_answers_as_the_chat_route(client):
    r = client.responses.create(model=MODEL, input="What is the capital of France?", temperature=0,
                                max_output_tokens=12)
    choice = chat_text(client, [{"role": "user", "content": "What is the capital of France?"}], 12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == choice.message.content and len(r.output) == 1
    message = r.output[0]
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert r.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.usage.input_tokens_details.cached_tokens >= 0


def test_message_items_and_instructions_answer_as_the_chat_route(client):
    items = [{"role": "user", "content": "Hello!"},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hi, how can I help?"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a "},
                                                             {"type": "input_text", "text": "colour."}]}]
    r = client.responses.create(model=MODEL, input=items, instructions="Answer in one word.", temperature=0,
                                max_output_tokens=10)
    choice = chat_text(client, [{"role": "system", "content": "Answer in one word."},
                                {"role": "user", "content": "Hello!"},
                                {"role": "assistant", "content": "Hi, how can I help?"},
                                {"role": "user", "content": "Name a colour."}], 10)
    assert r.output_text == choice.message.content
    assert r.instructions == "Answer in one word."


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model=MODEL, input="Count to one hundred.", temperature=0, max_output_tokens=4,
                                extra_body={"seed": 1})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 4 and r.max_output_tokens == 4


def event_types_in_order(types: list[str], final: str) -> None:
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          final]


def test_a_stream_yields_the_typed_events_in_order(client):
    events = list(client.responses.create(model=MODEL, input="Tell me a story.", temperature=0,
                                          max_output_tokens=8, stream=True))
    event_types_in_order([e.type for e in events], "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == deltas == events[-4].text
    assert final.usage.output_tokens == 8 and events[0].response.id == final.id
    whole = client.responses.create(model=MODEL, input="Tell me a story.", temperature=0, max_output_tokens=8)
    assert whole.output_text == deltas


def test_the_stream_helper_builds_the_final_response(client):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    with client.responses.stream(model=MODEL, input="Pick a city.", temperature=0, text={"format": fmt}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    event_types_in_order([e.type for e in events], "response.completed")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.status == "completed" and final.output_text == deltas
    jsonschema.validate(json.loads(deltas), CITY)


def test_json_schema_format_gives_json_that_fits(client):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    for seed in range(3):
        r = client.responses.create(model=MODEL, input="Pick a city.", temperature=0.9, text={"format": fmt},
                                    extra_body={"seed": seed})
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), CITY)
        assert r.text.format.type == "json_schema" and r.text.format.name == "city"
    r = client.responses.create(model=MODEL, input="Some JSON, please.", temperature=0,
                                text={"format": {"type": "json_object"}}, max_output_tokens=60)
    if r.status == "completed":  # a random model may write an object longer than the limit
        assert isinstance(json.loads(r.output_text), dict)


def test_parse_with_a_pydantic_model(client):
    class City(BaseModel):
        city: str
        warm: bool

    r = client.responses.parse(model=MODEL, input="Pick a city.", temperature=0, text_format=City,
                               max_output_tokens=60)
    assert r.status == "completed" and isinstance(r.output_parsed, City)


def test_a_required_function_call_and_its_follow_up(client):
    question = "What is the weather in Oslo?"
    r = client.responses.create(model=MODEL, input=question, tools=[WEATHER], tool_choice="required", temperature=0,
                                parallel_tool_calls=False)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], temperature=0,
                                     max_output_tokens=10,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny, 21 C"}])
    assert follow.previous_response_id == r.id
    choice = chat_text(client, [{"role": "user", "content": question},
                                {"role": "assistant", "content": None, "tool_calls": [
                                    {"id": call.call_id, "type": "function",
                                     "function": {"name": call.name, "arguments": call.arguments}}]},
                                {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}],
                       10, tools=[AS_CHAT_TOOL])
    assert follow.output_text == choice.message.content
    # the same conversation sent whole, with the call as an input item, answers the same
    again = client.responses.create(model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=10, input=[
        {"role": "user", "content": question},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert again.output_text == follow.output_text


def test_a_streamed_function_call(client):
    with client.responses.stream(model=MODEL, input="Weather in Lima?", tools=[WEATHER], temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert final.output[0].type == "function_call" and isinstance(json.loads(final.output[0].arguments), dict)


def test_the_libraries_models_validate_what_is_sent(server):
    """``client.responses.create`` builds its objects without validating them; the models'
    own validation checks every required field and type of the JSON as the server sends it."""
    from openai.types.responses import Response, ResponseStreamEvent

    events = TypeAdapter(ResponseStreamEvent)
    for extra in ({"max_output_tokens": 3}, {"tools": [WEATHER], "tool_choice": "required", "metadata": {"a": "b"}}):
        body = {"model": MODEL, "input": "Hi", "instructions": "Be brief.", **extra}
        Response.model_validate(httpx.post(f"{server}/v1/responses", json=body, timeout=60).json())
        with httpx.stream("POST", f"{server}/v1/responses", json={**body, "stream": True}, timeout=60) as stream:
            lines = [line for line in stream.iter_lines() if line]
        assert all(a.startswith("event: ") and b.startswith("data: ") for a, b in zip(lines[::2], lines[1::2]))
        for kind, data in zip(lines[::2], lines[1::2]):
            event = events.validate_python(json.loads(data[len("data: "):]))
            assert event.type == kind[len("event: "):]


def test_stored_responses_are_retrieved_and_deleted(client):
    r = client.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=3, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"k": "v"}
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")


def test_store_false_is_neither_kept_nor_continued(client):
    r = client.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=3, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model=MODEL, input="And?", previous_response_id=r.id)
    assert exc.value.body["param"] == "previous_response_id" and r.id in exc.value.body["message"]


@pytest.mark.parametrize("field, value, param", [
    ("tools", [{"type": "web_search"}], "tools[0].type"),
    ("tools", [{"type": "file_search", "vector_store_ids": ["vs_1"]}], "tools[0].type"),
    ("background", True, "background"),
    ("reasoning", {"effort": "high"}, "reasoning"),
    ("truncation", "auto", "truncation"),
    ("include", ["message.output_text.logprobs"], "include"),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}],
     "input"),  # a text-only model
    ("input", [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}],
     "input[0].content[0].type"),
    ("input", [{"type": "item_reference", "id": "msg_1"}], "input[0].type"),
    ("tool_choice", {"type": "web_search_preview"}, "tool_choice"),
    ("tool_choice", "required", "tool_choice"),
    ("text", {"format": {"type": "json_schema", "name": "x"}}, "text.format"),
    ("text", {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}, "text.format"),
    ("text", {"verbosity": "low"}, "text.verbosity"),
    ("tools", [{"type": "function", "name": "bad name!"}], "tools[0].name"),
    ("input", [], "input"),
    ("input", ["Hi"], "input[0]"),
    ("input", [{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ("max_output_tokens", 0, "max_output_tokens"),
])
def test_what_is_not_served_is_a_400_naming_the_field(server, field, value, param):
    body = {"model": MODEL, "input": "Hi", field: value}
    r = httpx.post(f"{server}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    name = param.split("[")[0].split(".")[0]
    assert name in err["message"] or param in err["message"], err["message"]


def test_the_client_raises_bad_request_for_a_built_in_tool(client):
    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model=MODEL, input="Search the web", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model=MODEL, input="Hi", background=True)


def test_an_engine_failure_fails_the_response(llm, server, client):
    """A forward that raises on every decode step (after the first token): the stream ends
    with response.failed, a whole response is a 500, and the server keeps serving."""
    runner = llm.pipeline.runner
    forward = runner.forward

    def faulty(batch, *args, **kwargs):
        if batch.input_ids.numel() == 1:
            raise RuntimeError("injected fault")
        return forward(batch, *args, **kwargs)

    runner.forward = faulty
    try:
        events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=8, stream=True))
        with pytest.raises(openai.InternalServerError, match="injected fault"):
            client.responses.create(model=MODEL, input="Hi", max_output_tokens=8)
    finally:
        runner.forward = forward
    assert events[0].type == "response.created" and events[-1].type == "response.failed"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert "injected fault" in failed.error.message
    with pytest.raises(openai.NotFoundError):  # a failed response is not kept
        client.responses.retrieve(failed.id)
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).status == "incomplete"


def test_a_client_that_leaves_aborts_its_response(llm, app, server):
    """A streamed response whose client closes the connection mid-stream, and a whole one
    whose client times out: both engine requests are aborted, not run to their end."""
    runner = llm.pipeline.runner
    forward = runner.forward
    since = len(app.state.engine.aborts)

    def slow(*args, **kwargs):  # 200 tokens would take seconds
        time.sleep(0.02)
        return forward(*args, **kwargs)

    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 200}
    runner.forward = slow
    try:
        with httpx.stream("POST", f"{server}/v1/responses", json={**body, "stream": True}, timeout=60) as stream:
            for line in stream.iter_lines():
                if line == "event: response.output_text.delta":
                    break
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server}/v1/responses", json=body, timeout=0.5)
        deadline = time.time() + 15
        while llm.engine.requests or len(app.state.engine.aborts) < since + 2:  # the core's report arrives after
            assert time.time() < deadline, f"still running: {list(llm.engine.requests)}"
            time.sleep(0.05)
    finally:
        runner.forward = forward
    aborted = [request_id for request_id, *_ in list(app.state.engine.aborts)[-2:]]
    assert len(aborted) == 2 and all(r.startswith("resp_") for r in aborted)


def test_the_store_keeps_the_most_recent():
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put(f"resp_{i}", Stored({"id": f"resp_{i}"}, []))
    assert store.get("resp_0") is None and store.get("resp_1") is not None and store.get("resp_2") is not None
