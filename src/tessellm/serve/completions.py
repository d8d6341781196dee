"""POST /v1/completions: a prompt (a text, token ids, or a batch of either) continued; with
``echo``, the prompt (and its log-probabilities) before each choice's completion; streamed as
``text_completion`` chunks when ``stream`` is true."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

from fastapi import FastAPI, Request

from tessellm.core.errors import InvalidRequestError
from tessellm.serve.context import ServerContext
from tessellm.serve.engine_client import SampleDelta, StepOutput
from tessellm.serve.http_errors import RequestError
from tessellm.serve.sampling import check_model, sampling_params
from tessellm.serve.schema import CompletionRequest
from tessellm.serve.streaming import (Admitted, EngineStream, admit, choices_of, event_stream, logprob_pairs,
                                      new_request_id, token_piece, usage)
from tessellm.serve.structured import grammar_of


def add_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await complete(ctx, body, request)


async def complete(ctx: ServerContext, body: CompletionRequest, request: Request):
    """The whole answer, or its stream."""
    lora = check_model(ctx, body.model, "generate", "/v1/completions")
    if body.max_tokens == 0 and not body.echo:
        raise RequestError(400, "max_tokens: 0 generates nothing; it is allowed only with echo: true (to score the "
                                "prompt)", param="max_tokens")
    try:
        given = body.prompts()
        prompts = [ctx.engine.encode(p) if isinstance(p, str) else list(p) for p in given]
    except InvalidRequestError as exc:
        raise RequestError(400, str(exc), param="prompt") from None
    try:
        constraint = grammar_of(body.response_format, body.structured_outputs)
    except InvalidRequestError as exc:
        raise RequestError(400, str(exc), param="structured_outputs") from None
    # max_tokens 0 with echo: one token is sampled from the prefill's last row and dropped
    params = sampling_params(ctx, body, max_tokens=1 if body.max_tokens == 0 else body.max_tokens,
                             logprobs=body.logprobs, prompt_logprobs=body.logprobs if body.echo else None,
                             structured_output=constraint, names={"prompt_logprobs": "logprobs"})
    echo = None
    if body.echo:  # a token-id prompt's text is decoded once the engine has admitted its ids
        echo = Echo(given, prompts, body.max_tokens == 0,
                    lambda ids: ctx.engine.with_tokenizer(ctx.tokenizer.decode, ids))
    admitted = await admit(ctx, request, new_request_id("cmpl"), prompts, params, body, prompt_param="prompt",
                           lora=lora)
    if body.stream:
        return completion_stream(request, admitted, echo, body.stream_options)
    return completion_body(admitted, await admitted.rest(request), echo)


def completion_body(admitted: Admitted, outputs: list[list[StepOutput]], echo: "Echo | None") -> dict:
    """The ``text_completion`` object of a whole answer."""
    ctx, n = admitted.ctx, admitted.params.n
    choices = []
    for choice in choices_of(outputs, n):
        deltas = [echo.delta(d) for d in choice.deltas] if echo else choice.deltas
        head = echo.texts[choice.prompt] if echo else ""
        echoed = echo.echoed(choice.prompt, admitted.first[choice.prompt]) if echo else None
        choices.append({"index": choice.index, "text": head + "".join(d.text for d in deltas),
                        "logprobs": completion_logprobs(ctx, deltas, 0, echoed),
                        "finish_reason": next((d.finish_reason for d in reversed(deltas) if d.finish_reason), None)})
    return {"id": admitted.request_id, "object": "text_completion", "created": int(time.time()),
            "model": admitted.model, "choices": choices,
            "usage": usage([outs[-1] for outs in outputs], bool(echo and echo.score_only))}


def completion_stream(request: Request, admitted: Admitted, echo: "Echo | None", options: Any) -> EngineStream:
    """The streamed answer: ``text_completion`` chunks (``options``: the request's
    ``stream_options``)."""
    created = int(time.time())

    def chunk(choices: list[dict], **extra: Any) -> dict:
        return {"id": admitted.request_id, "object": "text_completion", "created": created, "model": admitted.model,
                "choices": choices, **extra}

    def final_usage(lasts: list[StepOutput]) -> dict:
        return usage(lasts, bool(echo and echo.score_only))

    return event_stream(request, admitted, CompletionChunks(admitted, echo), chunk, final_usage, options)


class CompletionChunks:
    """Each streamed output's choices: a choice's first chunk carries its echoed prompt; a
    token's ``text_offset`` counts the text its choice has shown before it (kept only for a
    request that asks for logprobs: no token is decoded on its own otherwise)."""

    def __init__(self, admitted: Admitted, echo: "Echo | None"):
        self.admitted, self.echo = admitted, echo
        self.started: set[int] = set()
        self.offsets: dict[int, int] = {}

    def __call__(self, p: int, out: StepOutput) -> list[dict]:
        ctx, echo, n = self.admitted.ctx, self.echo, self.admitted.params.n
        choices = []
        for d in out.samples:
            i = p * n + d.index
            head, echoed = "", None
            if echo is not None:  # the prompt comes first, in the choice's first chunk
                d = echo.delta(d)
                if i not in self.started:
                    head, echoed = echo.texts[p], echo.echoed(p, self.admitted.first[p])
            self.started.add(i)
            logprobs = completion_logprobs(ctx, [d], self.offsets.get(i, 0), echoed)
            choices.append({"index": i, "text": head + d.text, "logprobs": logprobs,
                            "finish_reason": d.finish_reason})
            if logprobs is not None and logprobs["tokens"]:  # offsets count only where logprobs show them
                self.offsets[i] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        return choices


def completion_logprobs(ctx: ServerContext, deltas: list[SampleDelta], offset: int = 0,
                        echoed: list[tuple[int, Any]] | None = None) -> dict | None:
    """The completions API's logprobs object (tokens, token_logprobs, top_logprobs,
    text_offset from ``offset``) of these deltas' tokens, after ``echoed`` (the prompt's
    (token id, ``TokenLogprob`` or None for its first token)); None if not asked for."""
    pairs = logprob_pairs(deltas)
    if pairs is None:
        return None
    pairs = (echoed or []) + pairs
    pieces = [token_piece(ctx, t) for t, _ in pairs]
    offsets, at = [], offset
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {"tokens": pieces,
            "token_logprobs": [None if lp is None else lp.logprob for _, lp in pairs],
            "top_logprobs": [None if lp is None else {token_piece(ctx, a): v for a, v in lp.top} for _, lp in pairs],
            "text_offset": offsets}


@dataclass
class Echo:
    """A completions request with ``echo``: each prompt's text and token ids go before its
    choices' completions; ``score_only`` (max_tokens 0) drops the one token sampled.
    ``texts`` are the prompts as given, token-id prompts decoded (read only after the
    engine admitted them: an id outside the vocabulary is its 400, not a decoder's error)."""

    given: list[Any]
    prompt_ids: list[list[int]]
    score_only: bool
    decode: Callable[[list[int]], str]

    @cached_property
    def texts(self) -> list[str]:
        return [p if isinstance(p, str) else self.decode(ids) for p, ids in zip(self.given, self.prompt_ids)]

    def delta(self, d: SampleDelta) -> SampleDelta:
        """``d`` as the response shows it: nothing generated when only scoring."""
        if not self.score_only:
            return d
        return SampleDelta(d.index, [], "", "length" if d.finish_reason else None,
                           [] if d.logprobs is not None else None)

    def echoed(self, p: int, first: StepOutput) -> list[tuple[int, Any]] | None:
        """Prompt ``p``'s (token id, log-probability) pairs, when the request asked for logprobs."""
        if first.prompt_logprobs is None:
            return None
        return list(zip(self.prompt_ids[p], first.prompt_logprobs))
