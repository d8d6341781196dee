"""Tool calling over the chat API: ``tools`` and ``tool_choice`` in, ``tool_calls`` out.

The prompt: a chat template that has its own tool format (it reads ``tools``) renders the
tools and the conversation's earlier calls and results itself; for one that has none, the
tools are described in the system message and earlier calls and results are written as
text. The answer: a call is a JSON object ``{"name": ..., "arguments": {...}}`` (or a list
of them). ``tool_choice`` ``required`` and a named function are enforced by a JSON-schema
grammar, so the arguments always parse and fit the function's ``parameters``; under ``auto``
the model chooses, and an answer that is such JSON (bare, or in ``<tool_call>`` tags as
Hermes-style templates ask) naming a declared function is returned as calls, anything else
as content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.grammar import GrammarSpec


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    """A JSON schema of the arguments object; none: any object."""
    strict: Optional[bool] = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    name: str
    arguments: str
    """The arguments object as JSON text, as OpenAI sends it."""


class ToolCallItem(BaseModel):
    """An earlier tool call in a conversation's assistant message."""

    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                             "arguments": tool.function.parameters or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


class ToolCalling:
    """How one chat request may call tools.

    ``mode``: ``none`` (tools are not offered), ``auto``, ``required`` or ``named`` (the one
    function ``tool_choice`` names). ``grammar()`` is the constraint that enforces
    ``required`` and ``named`` (None otherwise); ``render(messages, tokenizer)`` is the
    prompt text; ``parse(text)`` is the OpenAI ``tool_calls`` list the answer holds, or None
    when it holds none.
    """

    def __init__(self, tools: list[Tool], choice: ToolChoice | None, parallel: bool | None):
        self.tools = {t.function.name: t for t in tools}
        self.parallel = parallel is not False
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in self.tools:
                raise InvalidRequestError(f"tool_choice names function {choice.function.name!r}, which tools does not "
                                          f"declare (declared: {', '.join(self.tools) or 'none'})")
            self.mode, self.named = "named", choice.function.name
        else:
            self.mode, self.named = (choice or "auto"), None
        if self.mode == "required" and not self.tools:
            raise InvalidRequestError("tool_choice 'required' needs at least one tool in tools")

    def grammar(self) -> GrammarSpec | None:
        if self.mode == "named":
            return GrammarSpec.schema(_call_schema(self.tools[self.named]))
        if self.mode != "required":
            return None
        calls = [_call_schema(t) for t in self.tools.values()]
        item = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return GrammarSpec.schema({"type": "array", "items": item, "minItems": 1,
                                   **({} if self.parallel else {"maxItems": 1})})

    def render(self, messages: list[dict[str, Any]], tokenizer: Any) -> str:
        return render_chat(messages, tokenizer, self)

    def _described(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        functions = [{"name": t.function.name, "description": t.function.description or "",
                      "parameters": t.function.parameters or {"type": "object"}} for t in self.tools.values()]
        text = ("You can call these functions:\n" + json.dumps(functions) + "\nTo call one, answer with only a JSON "
                "object: {\"name\": <function name>, \"arguments\": <an object of its arguments>}.")
        if messages and messages[0]["role"] in ("system", "developer"):
            return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        if self.mode == "none":
            return None
        tagged = _TAGGED.findall(text)
        candidates = tagged if tagged else [text.strip()]
        calls: list[dict[str, Any]] = []
        for candidate in candidates:
            try:
                value = json.loads(candidate)
            except json.JSONDecodeError:
                return None
            for call in value if isinstance(value, list) else [value]:
                parsed = self._call(call)
                if parsed is None:
                    return None
                calls.append(parsed)
        return calls or None

    def _call(self, value: Any) -> dict[str, Any] | None:
        if not isinstance(value, dict) or value.get("name") not in self.tools:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": value["name"], "arguments": json.dumps(arguments)}}


def render_chat(messages: list[dict[str, Any]], tokenizer: Any, calling: ToolCalling | None = None, *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of a conversation (with the tools ``calling`` offers, if any), ending
    with the opening of the assistant's turn (``add_generation_prompt``) or inside the last
    message, left open (``continue_final_message``); ``template_kwargs`` are passed to the
    template (a request's ``chat_template_kwargs``)."""
    offered = calling is not None and calling.mode != "none" and calling.tools
    ending = {"add_generation_prompt": add_generation_prompt, **(template_kwargs or {})}
    if continue_final_message:  # only when asked: a tokenizer older than the option refuses it
        ending["continue_final_message"] = True
    if "tools" in (tokenizer.chat_template or ""):
        tools = [t.model_dump(exclude_none=True) for t in calling.tools.values()] if offered else None
        return tokenizer.apply_chat_template(_for_template(messages), tools=tools, tokenize=False, **ending)
    messages = [_as_text(m) for m in messages]
    if offered:
        messages = calling._described(messages)
    return tokenizer.apply_chat_template(messages, tokenize=False, **ending)


def _for_template(message: list[dict[str, Any]]) -> Any:
    """Messages for a template with a tool format: calls' arguments as objects (what
    templates iterate over), content never None."""
    out = []
    for m in message:
        m = {k: v for k, v in m.items() if v is not None}
        m.setdefault("content", "")
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def _loads(arguments: Any) -> Any:
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments


def _as_text(m: dict[str, Any]) -> dict[str, Any]:
    """A message for a template without a tool format: calls written as the JSON the model
    answers with, a tool's result as a user turn naming the call."""
    if m["role"] == "assistant" and m.get("tool_calls"):
        calls = [{"name": c["function"]["name"], "arguments": _loads(c["function"]["arguments"])}
                 for c in m["tool_calls"]]
        return {"role": "assistant", "content": json.dumps(calls[0] if len(calls) == 1 else calls)}
    if m["role"] == "tool":
        return {"role": "user", "content": f"Result of tool call {m.get('tool_call_id') or ''}: {m.get('content') or ''}"}
    return {"role": m["role"], "content": m.get("content") or ""}


class StreamedChoice:
    """One streamed chat choice's text, held back while it may be a tool call.

    ``push(text)`` returns the content to send now (None: nothing yet); ``close()`` returns
    what is left to send at the end: ``("tool_calls", calls)`` or ``("content", text)``, or
    None. Without tools every piece is sent at once; under ``required`` or a named function
    everything is held; under ``auto`` the answer is held once its first non-blank character
    opens JSON or a ``<tool_call>`` tag, and sent as it comes otherwise."""

    def __init__(self, calling: ToolCalling | None):
        self.calling = calling
        self.held = ""
        if calling is None or calling.mode == "none":
            self.state = "text"
        else:
            self.state = "hold" if calling.mode in ("required", "named") else "undecided"

    def push(self, text: str) -> str | None:
        if self.state == "text":
            return text
        self.held += text
        if self.state == "undecided":
            start = self.held.lstrip()
            if not start:
                return None
            if start[0] in "{[<":
                self.state = "hold"
                return None
            self.state, text, self.held = "text", self.held, ""
            return text
        return None

    def close(self) -> tuple[str, Any] | None:
        if self.state == "text" or not self.held:
            return None
        calls = self.calling.parse(self.held)
        return ("tool_calls", calls) if calls else ("content", self.held)
