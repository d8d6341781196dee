"""POST /v1/responses: OpenAI's Responses API for text in and text (or function calls) out.

``input`` is a text or a list of items: messages (role user, system, developer or assistant;
content a text or ``input_text``/``output_text`` parts), ``function_call`` and
``function_call_output`` items. They become chat messages, rendered with the model's chat
template as /v1/chat/completions renders them (``instructions`` first, as a system message),
so a request and the same conversation sent to the chat route give the same answer under
greedy decoding. ``text.format`` (``json_schema``, ``json_object``) and function ``tools``
under ``tool_choice`` ``required`` or a named function are enforced by a grammar, as on the
chat route (serve/structured.py, serve/tools.py). ``stream`` answers with the API's typed
events. A response is kept in memory (the last ``capacity``) unless ``store`` is false:
GET /v1/responses/{id} returns it and ``previous_response_id`` continues its conversation.
A message's ``input_image`` parts (``image_url``: a data: URL, or an http(s) URL where the
server fetches them) go to a model that takes images as chat image parts do (serve/images.py).
What this server cannot do (built-in tools, ``background``, reasoning effort, files,
``truncation: auto``, ...) is a 400 naming the field, never silently ignored.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal, Optional, Union

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from tessellm.core.engine.llm import to_sampling_params
from tessellm.core.errors import InvalidRequestError, validation_problems
from tessellm.core.interfaces.grammar import GrammarSpec
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.serve.context import ServerContext
from tessellm.serve.engine_client import StepOutput
from tessellm.serve.engine_protocol import RequestFailed
from tessellm.serve.http_errors import RequestError
from tessellm.serve.images import ImageRef, image_processor_of, process_prompt, with_markers
from tessellm.serve.sampling import BODY_NAMES, check_model
from tessellm.serve.streaming import EngineStream, MergedOutputs, admit
from tessellm.serve.structured import JsonSchemaFormat, ResponseFormat, grammar_of
from tessellm.serve.tools import (FunctionDefinition, FunctionName, NamedToolChoice, StreamedChoice, Tool,
                                  ToolCalling, render_chat)

logger = logging.getLogger("tessellm.server")

# ---------------------------------------------------------------------------- the request

UNSUPPORTED: dict[str, tuple[Any, str]] = {
    # field -> (what "not used" looks like: a value, or a test of the value; what to do instead)
    "background": (lambda v: not v, "responses run in the request; leave background out or false"),
    "conversation": (None, "conversations are not stored here; use previous_response_id"),
    "prompt": (None, "prompt templates are not stored here; send input and instructions"),
    "include": (lambda v: not v, "no extra output data is served; leave include out"),
    "reasoning": (lambda v: v is None or (isinstance(v, dict) and v.get("effort") in (None, "none")
                                          and v.get("summary") is None and v.get("generate_summary") is None),
                  "the model does not reason before answering; leave reasoning out or give effort: none"),
    "truncation": (lambda v: v in (None, "disabled"), "a prompt longer than the context is refused; use "
                                                      "truncation: disabled"),
    "max_tool_calls": (None, "built-in tools are not served; leave max_tool_calls out"),
    "top_logprobs": (lambda v: not v, "log-probabilities are not served by /v1/responses; use "
                                      "/v1/chat/completions with logprobs"),
    "context_management": (lambda v: not v, "context management is not served; leave it out"),
    "moderation": (None, "moderation is not served; leave it out"),
    "image": (None, "images are not served; send text"),
    "access_programs": (None, "programs are not served; leave access_programs out"),
    "background_options": (None, "responses run in the request; leave background_options out"),
    "prompt_cache_options": (None, "leave prompt_cache_options out"),
}
"""Fields of OpenAI's request that change the result, which this route does not serve."""

NO_EFFECT = frozenset({"user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier",
                       "stream_options"})
"""Fields accepted and logged once: they cannot change the tokens returned."""

_logged: set[str] = set()


class TextFormat(BaseModel):
    """``text.format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (output that parses and fits ``schema``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("type json_schema needs schema (the JSON schema the output must fit)")
        return self

    def grammar(self) -> GrammarSpec | None:
        if self.type == "text":
            return None
        schema = JsonSchemaFormat(name=self.name or "response", schema=self.schema_, strict=self.strict)
        return grammar_of(ResponseFormat(type=self.type, json_schema=schema if self.type == "json_schema" else None),
                          None)


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["medium"]] = None
    """Only the default: the output's length is the model's choice."""


class ResponsesRequest(BaseModel):
    """POST /v1/responses, the fields this route serves (``input`` items are read by
    ``conversation``, tools by ``tool_calling``); a field of ``UNSUPPORTED`` given a value
    that changes the result is a 400 naming it."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _nothing_ignored(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for field, value in data.items():
            if field in UNSUPPORTED:
                unused, instead = UNSUPPORTED[field]
                if not (unused(value) if callable(unused) else value == unused):
                    raise PydanticCustomError("not_supported", "{field} is not supported by this server (got "
                                              "{value}): {instead}", {"field": field, "value": repr(value),
                                                                      "instead": instead})
            elif (field in NO_EFFECT or field not in cls.model_fields) and field not in _logged:
                _logged.add(field)
                logger.warning("/v1/responses: request field %r %s", field, "accepted; it does not change the "
                               "result" if field in NO_EFFECT else "is unknown and ignored")
        return data

    model: str
    input: Union[str, list[Any]]
    """A text (one user message) or a list of items, read by ``conversation``."""
    instructions: Optional[str] = None
    """A system message before the conversation; not carried over by ``previous_response_id``."""
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    stream: Optional[bool] = False
    text: Optional[TextConfig] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    previous_response_id: Optional[str] = None
    store: Optional[bool] = True
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    seed: Optional[int] = Field(None, ge=0)
    """Extension (as the chat route's): the sampling seed."""
    cache_salt: Optional[str] = Field(None, min_length=1)
    """Extension (as the chat route's): the prefix cache shares blocks only between requests
    with the same salt."""


# ---------------------------------------------------------------------------- input items

def conversation(given: str | list[Any]) -> list[dict[str, Any]]:
    """``input`` as chat messages (the chat route's shape: role, content, tool_calls,
    tool_call_id). A function call joins the assistant message just before it (its text,
    or the calls made with it), as one chat message holds an answer's text and calls."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            function = {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}
            call = {"id": _string(item, "call_id", where), "type": "function", "function": function}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
        elif not isinstance(item, dict):
            raise RequestError(400, f"{where} must be an item object (a message, function_call or "
                                    f"function_call_output), got {item!r}", param=where)
        else:
            raise RequestError(400, f"{where}: item type {kind!r} is not supported by this server; input items are "
                                    f"message, function_call and function_call_output", param=f"{where}.type")
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise RequestError(400, f"{where}.role must be user, system, developer or assistant (got {role!r})",
                           param=f"{where}.role")
    content = item.get("content")
    return {"role": role, "content": content if isinstance(content, str) else _content(content, f"{where}.content")}


def _content(parts: Any, where: str) -> str | list[Any]:
    """A message's content parts: its text, or, where it holds ``input_image`` parts, a list
    of text parts and ``ImageRef``s (serve/images.py reads them)."""
    if not isinstance(parts, list) or not any(isinstance(p, dict) and p.get("type") == "input_image" for p in parts):
        return _text_of(parts, where)
    out: list[Any] = []
    for j, part in enumerate(parts):
        if isinstance(part, dict) and part.get("type") == "input_image":
            out.append(_image_ref(part, f"{where}[{j}]"))
        else:
            out.append({"type": "text", "text": _text_of([part], where, first=j)})
    return out


def _image_ref(part: dict[str, Any], where: str) -> ImageRef:
    """An ``input_image`` part's image: its ``image_url`` (a data: URL, or an http(s) URL the
    server may fetch); a ``file_id`` is refused, as no files are stored here."""
    if part.get("file_id") is not None:
        raise RequestError(400, f"{where}.file_id: files are not stored on this server, so an input_image cannot "
                                f"name one; send image_url with the image as a data: URL "
                                f"(data:image/png;base64,...)", param=f"{where}.file_id")
    url = part.get("image_url")
    if not isinstance(url, str):
        raise RequestError(400, f"{where}.image_url must be a string: the image as a data: URL (or an http(s) URL "
                                f"where the server fetches them); got {url!r}", param=f"{where}.image_url")
    if part.get("detail", "auto") not in ("auto", "low", "high", None):
        raise RequestError(400, f"{where}.detail must be auto, low or high (got {part.get('detail')!r})",
                           param=f"{where}.detail")
    return ImageRef(url, f"{where}.image_url")


def _text_of(parts: Any, where: str, first: int = 0) -> str:
    """The text of a list of content parts (input_text, output_text, refusal); ``first``: the
    index of the first part in its message, for errors."""
    if not isinstance(parts, list):
        raise RequestError(400, f"{where} must be a text or a list of content parts (got {type(parts).__name__})",
                           param=where)
    texts = []
    for j, part in enumerate(parts, start=first):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise RequestError(400, f"{where}[{j}]: content part type {kind!r} is not supported by this server; it "
                                    f"reads input_text, output_text and, in a message, input_image",
                               param=f"{where}[{j}].type")
    return "".join(texts)


def _string(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise RequestError(400, f"{where}.{name} must be a string (got {value!r})", param=f"{where}.{name}")
    return value


def tool_calling(body: ResponsesRequest) -> ToolCalling | None:
    """The request's function tools and tool_choice, as the chat route's ToolCalling."""
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.get("type") != "function":
            raise RequestError(400, f"tools[{i}]: tool type {tool.get('type')!r} is not supported by this server; "
                                    f"it serves function tools only (type: function)", param=f"tools[{i}].type")
        fields = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        try:
            tools.append(Tool(type="function", function=FunctionDefinition.model_validate(fields)))
        except ValidationError as exc:
            where = ".".join(str(part) for part in exc.errors()[0]["loc"])
            raise RequestError(400, validation_problems(exc, f"tools[{i}]."), param=f"tools[{i}].{where}") from None
    choice: Any = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise RequestError(400, f"tool_choice {choice!r} is not supported by this server; give none, auto, "
                                    f"required or {{\"type\": \"function\", \"name\": ...}}", param="tool_choice")
        choice = NamedToolChoice(type="function", function=FunctionName(name=choice["name"]))
    if not tools:
        if choice not in (None, "none", "auto"):
            raise RequestError(400, "tool_choice asks for a tool call, but the request declares no tools",
                               param="tool_choice")
        return None
    try:
        return ToolCalling(tools, choice, body.parallel_tool_calls)
    except InvalidRequestError as exc:
        raise RequestError(400, str(exc), param="tool_choice") from None


# ---------------------------------------------------------------------------- stored responses

@dataclass
class Stored:
    """A response as GET returns it, and its conversation as chat messages (its input, with
    what an earlier response it continued held, and its own output; no instructions)."""

    response: dict[str, Any]
    history: list[dict[str, Any]]


class ResponseStore:
    """The last ``capacity`` stored responses, by id (the oldest is dropped first)."""

    def __init__(self, capacity: int = 1000):
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response_id: str, stored: Stored) -> None:
        self._items[response_id] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


# ---------------------------------------------------------------------------- the response

@dataclass
class Turn:
    """One request, ready to run: its id, the request, the conversation it continues and
    adds (``messages``: no instructions), how it may call tools, its prompt and sampling."""

    id: str
    created_at: int
    body: ResponsesRequest
    model: str
    messages: list[dict[str, Any]]
    calling: ToolCalling | None
    prompt: list[int]
    params: SamplingParams
    lora: str | None = None
    """The LoRA adapter it runs under (``model`` names it), None for the base model."""
    images: list[Any] | None = None
    """The prompt's processed images (None: none)."""

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 failure: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object in ``status``, echoing the request's settings."""
        b = self.body
        text_format = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else None
        tools = [{"type": "function", "name": t["name"], "description": t.get("description"),
                  "parameters": t.get("parameters"), "strict": t.get("strict")} for t in b.tools or []]
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": failure,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "max_tool_calls": None,
                "metadata": b.metadata or {}, "model": self.model, "output": output,
                "parallel_tool_calls": b.parallel_tool_calls is not False,
                "previous_response_id": b.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": b.store is not False, "temperature": 1.0 if b.temperature is None else b.temperature,
                "text": {"format": text_format or {"type": "text"}, "verbosity": "medium"},
                "tool_choice": b.tool_choice or "auto", "tools": tools,
                "top_p": 1.0 if b.top_p is None else b.top_p, "truncation": "disabled", "background": False,
                "usage": usage, "user": b.user}


def usage_of(last: StepOutput) -> dict[str, Any]:
    return {"input_tokens": last.prompt_tokens,
            "input_tokens_details": {"cached_tokens": last.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": last.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": last.prompt_tokens + last.completion_tokens}


class OutputWriter:
    """An answer's text as output items, and the stream events that build them.

    ``push(text)`` and ``close(incomplete)`` return the events (type, fields) for the text
    seen so far; ``items`` is the output once closed. Text that may be a function call is
    held back (StreamedChoice) and becomes ``function_call`` items if it is one; anything
    else is one ``message`` item with one ``output_text`` part."""

    def __init__(self, calling: ToolCalling | None):
        self.held = StreamedChoice(calling)
        self.items: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the open message item
        self.text = ""
        self.calls: list[dict[str, Any]] = []

    def push(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        sent = self.held.push(text)
        return self._text(sent) if sent else []

    def close(self, incomplete: bool) -> list[tuple[str, dict[str, Any]]]:
        rest = self.held.close()
        if rest is not None and rest[0] == "tool_calls":
            return [event for call in rest[1] for event in self._call(call)]
        events = self._text(rest[1]) if rest is not None and rest[1] else []
        if self.message is None:  # an empty answer is still one (empty) message
            events += self._open()
        part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        where = {"item_id": self.message["id"], "output_index": len(self.items), "content_index": 0}
        self.message.update(status="incomplete" if incomplete else "completed", content=[part])
        events += [("response.output_text.done", {**where, "text": self.text, "logprobs": []}),
                   ("response.content_part.done", {**where, "part": part}),
                   ("response.output_item.done", {"output_index": len(self.items), "item": self.message})]
        self.items.append(self.message)
        return events

    def _open(self) -> list[tuple[str, dict[str, Any]]]:
        self.message = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant",
                        "status": "in_progress", "content": []}
        where = {"item_id": self.message["id"], "output_index": len(self.items), "content_index": 0}
        return [("response.output_item.added", {"output_index": len(self.items), "item": dict(self.message)}),
                ("response.content_part.added",
                 {**where, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})]

    def _text(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        events = self._open() if self.message is None else []
        self.text += text
        events.append(("response.output_text.delta", {"item_id": self.message["id"], "output_index": len(self.items),
                                                      "content_index": 0, "delta": text, "logprobs": []}))
        return events

    def _call(self, call: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        function = call["function"]
        item = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "call_id": call["id"],
                "name": function["name"], "arguments": "", "status": "in_progress"}
        where = {"item_id": item["id"], "output_index": len(self.items)}
        done = {**item, "arguments": function["arguments"], "status": "completed"}
        self.items.append(done)
        self.calls.append(call)
        return [("response.output_item.added", {"output_index": where["output_index"], "item": item}),
                ("response.function_call_arguments.delta", {**where, "delta": function["arguments"]}),
                ("response.function_call_arguments.done", {**where, "arguments": function["arguments"]}),
                ("response.output_item.done", {"output_index": where["output_index"], "item": done})]

    def as_messages(self) -> list[dict[str, Any]]:
        """The output as the chat messages a follow-up's conversation holds."""
        if self.calls:
            return [{"role": "assistant", "content": None, "tool_calls": self.calls}]
        return [{"role": "assistant", "content": self.text}]


# ---------------------------------------------------------------------------- the routes

def add_routes(app: FastAPI, ctx: ServerContext, capacity: int = 1000) -> None:
    """POST /v1/responses, GET and DELETE /v1/responses/{id} on ``app``; responses are kept
    (the last ``capacity``) in memory, in ``app.state.responses``."""
    store = ResponseStore(capacity)
    app.state.responses = store

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        if input_has_images(body.input) or body.previous_response_id is not None:
            turn = await run_in_threadpool(prepare, ctx, store, body)  # images read and resized off the loop
        else:
            turn = prepare(ctx, store, body)
        try:
            admitted = await admit(ctx, request, turn.id, [turn.prompt], turn.params, body, prompt_param="input",
                                   lora=turn.lora, images=[turn.images])
        except RequestError as exc:
            if exc.param in BODY_NAMES["structured_output"]:  # a schema the grammar backend cannot compile
                param = "tools" if turn.calling and turn.calling.grammar() else "text.format"
                raise RequestError(400, f"{param}: {exc}", param=param) from None
            raise
        if body.stream:
            outputs = admitted.merged()
            return EngineStream(response_events(turn, store, outputs), request, turn.id, release=outputs.close)
        outs = (await admitted.rest(request))[0]
        writer = OutputWriter(turn.calling)
        writer.push("".join(d.text for out in outs for d in out.samples))
        return finish(turn, store, outs, writer)[1]

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        stored = store.get(response_id)
        if stored is None:
            raise not_found(response_id, "response_id")
        return stored.response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            raise not_found(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}


def not_found(response_id: str, param: str) -> RequestError:
    return RequestError(404, f"{param}: no stored response with id {response_id!r} (responses created with store: "
                             f"false are not kept, and this server keeps only the most recent ones)",
                        param=param, code="response_not_found")


def prepare(ctx: ServerContext, store: ResponseStore, body: ResponsesRequest) -> Turn:
    """The request as a turn to run: its conversation (an earlier stored one continued),
    its prompt rendered with the chat template, its sampling; RequestError naming the
    field if it cannot run."""
    lora = check_model(ctx, body.model, "generate", "/v1/responses")
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = store.get(body.previous_response_id)
        if stored is None:
            raise not_found(body.previous_response_id, "previous_response_id")
        history = stored.history
    messages = history + conversation(body.input)
    if not messages:
        raise RequestError(400, "input holds no item", param="input")
    calling = tool_calling(body)
    constraint = body.text.format.grammar() if body.text and body.text.format else None
    if calling is not None and calling.grammar() is not None:
        if constraint is not None:
            raise RequestError(400, f"tool_choice {calling.mode!r} and text.format both constrain the output; "
                                    f"give one", param="tool_choice")
        constraint = calling.grammar()
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    prompt, images = render_prompt(ctx, system + messages, calling)
    return Turn("resp_" + uuid.uuid4().hex, int(time.time()), body, lora or ctx.model_name, messages, calling,
                prompt, sampling(ctx, body, constraint), lora, images)


def sampling(ctx: ServerContext, body: ResponsesRequest, constraint: GrammarSpec | None) -> SamplingParams:
    max_tokens = body.max_output_tokens or max(1, ctx.engine.info.max_model_len // 2)
    try:
        return to_sampling_params(dict(max_tokens=max_tokens,
                                       temperature=1.0 if body.temperature is None else body.temperature,
                                       top_p=1.0 if body.top_p is None else body.top_p,
                                       seed=body.seed, structured_output=constraint))
    except InvalidRequestError as exc:
        raise RequestError(400, str(exc)) from None


def render_prompt(ctx: ServerContext, messages: list[dict[str, Any]],
                  calling: ToolCalling | None) -> tuple[list[int], list[Any] | None]:
    """The conversation rendered with the chat template (and the tools offered), as token ids,
    and its processed images (None without ``input_image`` parts)."""
    tokenizer = ctx.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(400, f"model {ctx.model_name!r} has no chat template; use /v1/completions", param="input")
    processor = None
    if any(isinstance(m.get("content"), list) for m in messages):
        processor = image_processor_of(ctx, "input")
        messages, images = with_markers(messages, processor.image_marker, ctx.engine.images, "input")

    def render() -> Any:
        text = render_chat(messages, tokenizer, calling)
        return text if processor is not None else tokenizer(text, add_special_tokens=False)["input_ids"]

    try:
        rendered = ctx.engine.with_tokenizer(render)
    except Exception as exc:  # a template that rejects these messages (roles out of order, ...)
        raise RequestError(400, f"input could not be rendered with the chat template: {exc}", param="input") from None
    if processor is None:
        return rendered, None
    return process_prompt(ctx, rendered, images, "input")


def input_has_images(given: Any) -> bool:
    """Whether a request's ``input`` holds an ``input_image`` part."""
    return isinstance(given, list) and any(
        isinstance(item, dict) and isinstance(item.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "input_image" for p in item["content"]) for item in given)


def finish(turn: Turn, store: ResponseStore, outs: list[StepOutput],
           writer: OutputWriter) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
    """The events that close the output ``writer`` has seen, and the finished response
    (stored unless the request's ``store`` is false)."""
    reason = next((d.finish_reason for out in reversed(outs) for d in out.samples if d.finish_reason), None)
    incomplete = reason == "length"
    events = writer.close(incomplete)
    response = turn.response("incomplete" if incomplete else "completed", writer.items, usage_of(outs[-1]))
    if turn.body.store is not False:
        store.put(turn.id, Stored(response, turn.messages + writer.as_messages()))
    return events, response


async def response_events(turn: Turn, store: ResponseStore, outputs: MergedOutputs) -> AsyncIterator[str]:
    """The stream's server-sent events, from ``response.created`` to ``response.completed``
    (``response.incomplete`` when max_output_tokens ended it, ``response.failed`` when the
    engine failed); a client that leaves closes it, which aborts the request."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": next(numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    yield event("response.created", response=turn.response("in_progress", []))
    yield event("response.in_progress", response=turn.response("in_progress", []))
    writer, outs = OutputWriter(turn.calling), []
    try:
        while not outputs.done:
            _, out = await outputs.next()
            outs.append(out)
            for kind, fields in (e for d in out.samples for e in writer.push(d.text)):
                yield event(kind, **fields)
    except RequestFailed as exc:
        failure = {"code": "server_error", "message": str(exc)}
        yield event("response.failed", response=turn.response("failed", writer.items, failure=failure))
        return
    finally:  # however it ends; synchronous, so a cancelled task still runs all of it
        outputs.close()
    closing, response = finish(turn, store, outs, writer)
    for kind, fields in closing:
        yield event(kind, **fields)
    yield event(f"response.{response['status']}", response=response)
