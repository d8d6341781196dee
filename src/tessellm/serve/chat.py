"""POST /v1/chat/completions: messages rendered with the model's chat template and answered
as an assistant message (tool calls where the answer is one); streamed as
``chat.completion.chunk`` deltas when ``stream`` is true."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.grammar import GrammarSpec
from tessellm.serve.context import ServerContext
from tessellm.serve.engine_client import StepOutput
from tessellm.serve.http_errors import RequestError
from tessellm.serve.images import chat_messages, has_images, image_processor_of, process_prompt, with_markers
from tessellm.serve.sampling import check_model, sampling_params
from tessellm.serve.schema import ChatCompletionRequest
from tessellm.serve.streaming import (Admitted, EngineStream, admit, choices_of, event_stream, logprobs_content,
                                      new_request_id, usage)
from tessellm.serve.structured import grammar_of
from tessellm.serve.tools import StreamedChoice, ToolCalling, render_chat


def add_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await chat(ctx, body, request)


async def chat(ctx: ServerContext, body: ChatCompletionRequest, request: Request):
    """The whole answer, or its stream."""
    lora = check_model(ctx, body.model, "generate", "/v1/chat/completions")
    if body.top_logprobs and not body.logprobs:
        raise RequestError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if not getattr(ctx.tokenizer, "chat_template", None):
        raise RequestError(400, f"model {ctx.model_name!r} has no chat template; use /v1/completions",
                           param="messages")
    calling, constraint = output_constraint(body)
    max_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    params = sampling_params(ctx, body, max_tokens=body.max_completion_tokens or body.max_tokens,
                             logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                             structured_output=constraint,
                             names={"logprobs": "top_logprobs", "max_tokens": max_name})
    if has_images(body.messages):  # reading (perhaps fetching) and resizing images: off the event loop
        prompt, images = await run_in_threadpool(chat_prompt, ctx, body, calling)
    else:
        prompt, images = chat_prompt(ctx, body, calling)
    admitted = await admit(ctx, request, new_request_id("chatcmpl"), [prompt], params, body, prompt_param="messages",
                           lora=lora, images=[images])
    if body.stream:
        return chat_stream(request, admitted, calling, body.stream_options)
    return chat_body(admitted, await admitted.rest(request), calling)


def output_constraint(body: ChatCompletionRequest) -> tuple[ToolCalling | None, GrammarSpec | None]:
    """The request's tool calling and the grammar its output must follow (a tool choice
    that requires a call, or a response format), RequestError naming the field."""
    try:
        calling = body.tool_calling()
    except InvalidRequestError as exc:
        raise RequestError(400, str(exc), param="tool_choice") from None
    try:
        constraint = grammar_of(body.response_format, body.structured_outputs)
    except InvalidRequestError as exc:
        raise RequestError(400, str(exc), param="response_format") from None
    if calling is not None and calling.grammar() is not None:
        if constraint is not None:
            raise RequestError(400, f"tool_choice {calling.mode!r} and response_format/structured_outputs both "
                                    f"constrain the output; give one", param="tool_choice")
        constraint = calling.grammar()
    return calling, constraint


def chat_prompt(ctx: ServerContext, body: ChatCompletionRequest,
                calling: ToolCalling | None) -> tuple[list[int], list[Any] | None]:
    """The messages rendered with the chat template (and the tools offered), as token ids,
    and the prompt's processed images (None without image parts)."""
    tokenizer = ctx.tokenizer
    messages: list[dict[str, Any]] = chat_messages(body.messages)
    processor = image_processor_of(ctx, "messages") if has_images(body.messages) else None
    messages, images = with_markers(messages, processor.image_marker if processor else "", ctx.engine.images,
                                    "messages")
    try:
        with ctx.engine.tokenizer_lock:
            text = render_chat(messages, tokenizer, calling, **body.template_ending())
            if processor is None:
                return tokenizer(text, add_special_tokens=False)["input_ids"], None
    except Exception as exc:  # a template that rejects these messages (roles out of order, ...)
        raise RequestError(400, f"messages could not be rendered with the chat template: {exc}",
                           param="messages") from None
    return process_prompt(ctx, text, images, "messages")


def chat_body(admitted: Admitted, outputs: list[list[StepOutput]], calling: ToolCalling | None) -> dict:
    """The ``chat.completion`` object of a whole answer."""
    ctx = admitted.ctx
    choices = [{"index": c.index, **chat_message(c.text, c.finish_reason, calling),
                "logprobs": logprobs_content(ctx, c.deltas)} for c in choices_of(outputs, admitted.params.n)]
    return {"id": admitted.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": admitted.model, "choices": choices, "usage": usage([outs[-1] for outs in outputs])}


def chat_message(text: str, reason: str | None, calling: ToolCalling | None) -> dict[str, Any]:
    """A chat choice's message and finish reason: tool calls where the answer is one."""
    calls = calling.parse(text) if calling is not None else None
    if calls:
        return {"message": {"role": "assistant", "content": None, "tool_calls": calls}, "finish_reason": "tool_calls"}
    return {"message": {"role": "assistant", "content": text}, "finish_reason": reason}


def chat_stream(request: Request, admitted: Admitted, calling: ToolCalling | None, options: Any) -> EngineStream:
    """The streamed answer: ``chat.completion.chunk`` deltas (``options``: the request's
    ``stream_options``)."""
    created = int(time.time())

    def chunk(choices: list[dict], **extra: Any) -> dict:
        return {"id": admitted.request_id, "object": "chat.completion.chunk", "created": created,
                "model": admitted.model, "choices": choices, **extra}

    return event_stream(request, admitted, ChatChunks(admitted, calling), chunk, usage, options)


class ChatChunks:
    """Each streamed output's choice deltas: a choice's first delta says its role; text that
    may be a tool call is held back (``StreamedChoice``) and sent as ``tool_calls`` at the
    end if it is one."""

    def __init__(self, admitted: Admitted, calling: ToolCalling | None):
        self.admitted, self.calling = admitted, calling
        self.held: dict[int, StreamedChoice] = {}

    def __call__(self, p: int, out: StepOutput) -> list[dict]:
        choices = []
        for d in out.samples:
            i = p * self.admitted.params.n + d.index
            delta: dict[str, Any] = {} if i in self.held else {"role": "assistant"}
            held = self.held.setdefault(i, StreamedChoice(self.calling))
            text, reason = held.push(d.text), d.finish_reason
            if text is not None and (text or reason is None):
                delta["content"] = text
            rest = held.close() if reason is not None else None
            if rest is not None and rest[0] == "tool_calls":
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(rest[1])]
                reason = "tool_calls"
            elif rest is not None:
                delta["content"] = delta.get("content", "") + rest[1]
            lps = logprobs_content(self.admitted.ctx, [d])
            if delta or reason is not None or lps is not None:
                choices.append({"index": i, "delta": delta, "logprobs": lps, "finish_reason": reason})
        return choices
