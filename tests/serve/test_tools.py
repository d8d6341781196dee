"""Tool calling's pieces without a model: the grammar that enforces required and named
calls, parsing answers into OpenAI tool_calls, the two ways a conversation is rendered
(a template with its own tool format, and one without), and what a stream holds back."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from tessellm.core.errors import InvalidRequestError
from tessellm.serve.tools import NamedToolChoice, StreamedChoice, Tool, ToolCalling, render_chat

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}})
TIME = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})
# a Hermes-style template: it reads `tools` and renders calls and results itself
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function.name }} {{ c.function.arguments.city }}</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}</{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def calling(choice="auto", parallel=None) -> ToolCalling:
    return ToolCalling([WEATHER, TIME], choice, parallel)


def test_required_and_named_grammars():
    assert calling("auto").grammar() is None and calling("none").grammar() is None
    named = json.loads(calling(NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_weather"}})).grammar().source)
    assert named["properties"]["name"]["enum"] == ["get_weather"]
    assert named["properties"]["arguments"] == WEATHER.function.parameters
    required = json.loads(calling("required", parallel=False).grammar().source)
    assert required["type"] == "array" and required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    assert "maxItems" not in json.loads(calling("required").grammar().source)


def test_bad_choices_are_refused():
    with pytest.raises(InvalidRequestError, match="nope"):
        calling(NamedToolChoice.model_validate({"type": "function", "function": {"name": "nope"}}))
    with pytest.raises(InvalidRequestError, match="at least one tool"):
        ToolCalling([], "required", None)


@pytest.mark.parametrize("text, names", [
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', ["get_weather"]),
    ('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "parameters": {"city": "Lima"}}]',
     ["get_time", "get_weather"]),
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_time", '
     '"arguments": {"zone": "UTC"}}</tool_call>', ["get_time", "get_time"]),
    ("It is sunny.", None), ('{"name": "unknown", "arguments": {}}', None), ('{"name": "get_time"', None),
    ('{"name": "get_time", "arguments": "x"}', None),
])
def test_parse(text, names):
    calls = calling().parse(text)
    assert (None if calls is None else [c["function"]["name"] for c in calls]) == names
    for call in calls or []:
        assert call["id"].startswith("call_") and isinstance(json.loads(call["function"]["arguments"]), dict)
    assert calling("none").parse(text) is None


CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
]


def test_render_without_a_tool_format_describes_the_tools(tokenizer):
    text = render_chat(CONVERSATION, tokenizer, calling())
    assert "get_weather" in text and "You can call these functions" in text
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert "Result of tool call call_1: rain" in text
    assert "You can call these functions" not in render_chat(CONVERSATION, tokenizer, calling("none"))


def test_render_with_the_templates_own_tool_format(tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = TOOL_TEMPLATE
    text = render_chat(CONVERSATION, tokenizer, calling())
    assert text.startswith("<tools>get_weather;get_time;</tools>")
    assert "<tool_call>get_weather Oslo</tool_call>" in text and "<tool>rain</tool>" in text
    assert text.endswith("<assistant>")


def test_stream_holds_back_what_may_be_a_call():
    plain = StreamedChoice(None)
    assert plain.push("Hi") == "Hi" and plain.close() is None
    auto = StreamedChoice(calling())
    assert auto.push("  ") is None and auto.push("Sunny") == "  Sunny" and auto.push("!") == "!"
    assert auto.close() is None
    held = StreamedChoice(calling())
    assert held.push(' {"name": "get_time", ') is None and held.push('"arguments": {}}') is None
    kind, calls = held.close()
    assert kind == "tool_calls" and calls[0]["function"]["name"] == "get_time"
    brace = StreamedChoice(calling())
    assert brace.push("{not json") is None and brace.close() == ("content", "{not json")
    required = StreamedChoice(calling("required"))
    assert required.push("[") is None and required.close() == ("content", "[")
