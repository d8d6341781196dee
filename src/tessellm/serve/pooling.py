"""What the pooling routes share (/v1/embeddings, /v1/rerank, /v1/score): turning texts and pairs into pooling requests (the
``LLM``'s own rules, under the tokenizer lock), running them through the engine thread's one
pooling call (``EngineThread.pool``) while watching for the client to leave, and refusals as
400s naming the field."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from fastapi import Request

from tessellm.core.engine.embed import similarity, similarity_prompts
from tessellm.core.errors import InvalidRequestError, LoraAdapterError
from tessellm.core.interfaces.pooling import PoolingParams
from tessellm.serve.context import ServerContext
from tessellm.serve.engine_thread import RequestFailed, ServerBusy, StepOutput
from tessellm.serve.http_errors import RequestError
from tessellm.serve.streaming import until_disconnect

def inputs_or_400(ctx: ServerContext, param: str, make: Callable[[], Any]) -> Any:
    """``make()`` holding the tokenizer lock; its InvalidRequestError as a 400 on ``param``."""
    try:
        with ctx.engine.tokenizer_lock:
            return make()
    except InvalidRequestError as exc:
        raise RequestError(400, str(exc), param=param) from None


def pooling_params(param_of: dict[str, str], **fields: Any) -> PoolingParams:
    """``PoolingParams`` from the request's fields; a bad one is a 400 naming it as the API does."""
    from pydantic import ValidationError

    try:
        return PoolingParams(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else None
        raise RequestError(400, f"{param_of.get(field, field)}: {first['msg']}", param=param_of.get(field, field)) from None


async def run_pooled(ctx: ServerContext, request: Request, request_id: str, inputs: list[Any],
                     params: PoolingParams, param: str, lora: str | None = None) -> list[StepOutput]:
    """Every input as one pooling request, run at once (the scheduler batches them); their
    outputs in order. Refusals: 400 naming ``param`` (which input, in a batch), 429 when the
    queue is full, 500 when the engine fails; ClientGone if the client leaves first. Nothing
    is left running after any of them."""
    ids = [request_id] if len(inputs) == 1 else [f"{request_id}-{i}" for i in range(len(inputs))]

    try:  # a batch is admitted when the queue has room as it arrives, whatever its size
        ctx.engine.check_room()
    except ServerBusy as exc:
        raise RequestError(429, str(exc), kind="rate_limit_error", code="server_busy") from None

    async def one(i: int, rid: str, item: Any) -> StepOutput:
        try:
            return await ctx.engine.pool(rid, item.token_ids, params, check_room=False,
                                         token_type_ids=item.token_type_ids, skip=item.skip, lora=lora)
        except InvalidRequestError as exc:
            if len(inputs) > 1 and not isinstance(exc, ServerBusy):
                raise type(exc)(f"{param}[{i}]: {exc}") from exc
            raise

    work = asyncio.gather(*(one(i, rid, item) for i, (rid, item) in enumerate(zip(ids, inputs))))
    try:
        return await until_disconnect(request, work, request_id)
    except BaseException as exc:
        work.cancel()  # a sibling's refusal must not leave the others running
        for rid in ids:
            ctx.engine.abort(rid)
        answer = refusal(exc, param)
        if answer is exc:
            raise
        raise answer from None


def refusal(exc: BaseException, param: str) -> BaseException:
    """An engine's refusal of a pooling request as the RequestError the route answers (other
    exceptions as they are)."""
    if isinstance(exc, ServerBusy):
        return RequestError(429, str(exc), kind="rate_limit_error", code="server_busy")
    if isinstance(exc, LoraAdapterError):
        return RequestError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, InvalidRequestError):
        return RequestError(400, str(exc), param=param)
    if isinstance(exc, RequestFailed):
        return RequestError(500, str(exc), kind="server_error")
    return exc


async def pair_scores(ctx: ServerContext, request: Request, request_id: str, queries: list[str], docs: list[str],
                      truncate: int | None, param: str, lora: str | None = None) -> tuple[list[float], int]:
    """Each (query, document) pair's score and the prompt tokens read: a reranker's, or for
    an embedding model the similarity of their embeddings (the query under its "query"
    prompt, documents under their "document" one, as ``LLM.score``)."""
    llm = ctx.llm
    if llm.pipeline.task == "score":
        inputs = inputs_or_400(ctx, param, lambda: llm.score_inputs(queries, docs, truncate_prompt_tokens=truncate))
        outs = await run_pooled(ctx, request, request_id, inputs, PoolingParams(), param, lora)
        return [float(o.pooled[0]) for o in outs], sum(len(i.token_ids) for i in inputs)
    said = llm.pipeline.checkpoint_pooling
    unique = list(dict.fromkeys(queries))
    query_prompt, doc_prompt = similarity_prompts(said)
    q_inputs = inputs_or_400(ctx, param, lambda: llm.embedding_inputs(
        unique, prompt_name=query_prompt, truncate_prompt_tokens=truncate))
    d_inputs = inputs_or_400(ctx, param, lambda: llm.embedding_inputs(docs, prompt_name=doc_prompt,
                                                                      truncate_prompt_tokens=truncate))
    outs = await run_pooled(ctx, request, request_id, q_inputs + d_inputs, PoolingParams(), param, lora)
    by_query = dict(zip(unique, (o.pooled for o in outs[:len(unique)])))
    scores = [float(similarity(said.similarity, by_query[q], o.pooled[None])[0])
              for q, o in zip(queries, outs[len(unique):])]
    return scores, sum(len(i.token_ids) for i in q_inputs + d_inputs)
