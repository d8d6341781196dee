"""What the pooling routes share (/v1/embeddings, /v1/rerank, /v1/score): each input (a text,
token ids, a (query, document) pair) sent as one ``pool`` request (serve/pooling_kind.py)
through the engine client, all of a response's at once, while watching for the client to
leave; the engine core tokenizes them by the ``LLM``'s own rules. Refusals are 400s naming
the field (which input, in a batch), a full queue a 429, an engine failure a 500."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from tessellm.core.engine.embed import similarity
from tessellm.core.errors import InvalidRequestError, LoraAdapterError
from tessellm.core.interfaces.pooling import PoolingParams
from tessellm.serve.context import ServerContext
from tessellm.serve.engine_client import ServerBusy
from tessellm.serve.engine_protocol import RequestFailed
from tessellm.serve.http_errors import RequestError
from tessellm.serve.pooling_kind import POOL, PooledOutput
from tessellm.serve.streaming import until_disconnect


def pooling_params(**fields: Any) -> PoolingParams:
    """``PoolingParams`` from the request's fields; a bad one is a 400 naming it."""
    try:
        return PoolingParams(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else None
        raise RequestError(400, f"{field}: {first['msg']}", param=field) from None


async def run_pooled(ctx: ServerContext, request: Request, request_id: str, payloads: list[dict[str, Any]],
                     param: str) -> list[PooledOutput]:
    """Every payload as one pooling request, sent at once (the scheduler batches them; the
    queue is checked once for all of them); their outputs in order. Nothing is left running
    after a refusal or a client that leaves."""
    ids = [request_id] if len(payloads) == 1 else [f"{request_id}-{i}" for i in range(len(payloads))]
    engine = ctx.engine
    try:  # a batch is admitted when the queue has room as it arrives, whatever its size
        engine.check_room()
    except ServerBusy as exc:
        raise refusal(exc, param) from None

    async def one(i: int, rid: str, payload: dict[str, Any]) -> PooledOutput:
        try:
            async for out in engine.submit(POOL, rid, payload, check_room=False):
                if out.finished:
                    return out
        except InvalidRequestError as exc:
            if len(payloads) > 1:
                raise type(exc)(f"{param}[{i}]: {exc}") from exc
            raise
        raise RequestFailed("the engine ended the request without its output")

    work = asyncio.gather(*(one(i, rid, p) for i, (rid, p) in enumerate(zip(ids, payloads))))
    try:
        return await until_disconnect(request, work, request_id)
    except BaseException as exc:
        work.cancel()  # a sibling's refusal must not leave the others running
        for rid in ids:
            engine.abort(rid)
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
                      truncate: int | None, param: str, lora: str | None = None,
                      use_activation: bool | None = None) -> tuple[list[float], int]:
    """Each (query, document) pair's score and the prompt tokens read: a reranker's (its raw
    logits where ``use_activation`` is false), or for an embedding model the similarity of
    their embeddings (the query under its "query" prompt, documents under their "document"
    one, as ``LLM.score``)."""
    info = ctx.engine.info
    if info.task == "score":
        params = pooling_params(use_activation=use_activation)
        payloads = [POOL.encode(pair=(q, d), truncate=truncate, params=params, lora=lora)
                    for q, d in zip(queries, docs)]
        outs = await run_pooled(ctx, request, request_id, payloads, param)
        return [o.values[0] for o in outs], sum(o.prompt_tokens for o in outs)
    unique = list(dict.fromkeys(queries))
    payloads = ([POOL.encode(input=q, prompt_name=info.query_prompt, truncate=truncate, lora=lora) for q in unique]
                + [POOL.encode(input=d, prompt_name=info.document_prompt, truncate=truncate, lora=lora) for d in docs])
    outs = await run_pooled(ctx, request, request_id, payloads, param)
    import torch

    by_query = {q: torch.tensor(o.values) for q, o in zip(unique, outs[:len(unique)])}
    scores = [float(similarity(info.similarity, by_query[q], torch.tensor(o.values)[None])[0])
              for q, o in zip(queries, outs[len(unique):])]
    return scores, sum(o.prompt_tokens for o in outs)
