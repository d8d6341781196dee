"""Reranking: POST /v1/rerank (also /rerank and /v2/rerank), the request Jina's and Cohere's
clients send and vLLM serves (a ``query``, ``documents`` as strings or ``{"text": ...}``,
``top_n``, ``return_documents``), answered with ``results`` ordered by ``relevance_score``;
and POST /v1/score (also /score), vLLM's (``text_1`` against ``text_2``: one against many,
or pairwise; vLLM's other names for the two sides, ``queries`` and ``documents`` or ``items``,
``data_1`` and ``data_2``, are read as ``text_1`` and ``text_2``), answered with one ``score``
object per pair in order. A reranker scores each pair (vLLM's ``use_activation`` false: its
raw logit); an embedding model scores by the similarity of the two embeddings."""

from __future__ import annotations

import time
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, StrictStr, model_validator
from pydantic_core import PydanticCustomError

from tessellm.core.engine.embed import pairs_of
from tessellm.core.errors import InvalidRequestError
from tessellm.serve.context import ServerContext
from tessellm.serve.http_errors import RequestError
from tessellm.serve.pooling import pair_scores
from tessellm.serve.sampling import check_model
from tessellm.serve.streaming import new_request_id


class Document(BaseModel):
    """A document given as an object (Jina's and Cohere's ``{"text": ...}``)."""

    model_config = ConfigDict(extra="ignore")

    text: StrictStr


class RerankRequest(BaseModel):
    """Jina's and Cohere's rerank request, as vLLM serves it."""

    model_config = ConfigDict(extra="ignore")

    query: StrictStr
    documents: list[Union[StrictStr, Document]]
    model: Optional[str] = None
    top_n: Optional[int] = Field(None, ge=0)
    """Return the best ``top_n`` (None or 0: every document)."""
    return_documents: bool = True
    truncate_prompt_tokens: Optional[int] = None
    use_activation: Optional[bool] = None
    """vLLM's: false gives a reranker's raw logits (no sigmoid); None: the pooler's default."""

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(BaseModel):
    """vLLM's score request: ``text_1`` (one, or one per ``text_2``) against ``text_2``."""

    model_config = ConfigDict(extra="ignore")

    text_1: Union[StrictStr, list[StrictStr]]
    text_2: Union[StrictStr, list[StrictStr]]
    model: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    use_activation: Optional[bool] = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_names(cls, data: Any) -> Any:
        """vLLM's other names for the two sides, read as ``text_1`` and ``text_2``."""
        if not isinstance(data, dict) or "text_1" in data or "text_2" in data:
            return data
        for first, second in SCORE_NAMES:
            if first in data and second in data:
                return {**data, "text_1": data[first], "text_2": data[second]}
        raise PydanticCustomError("missing_sides", "give text_1 and text_2 (or vLLM's queries and documents, queries "
                                  "and items, or data_1 and data_2)", {"field": "text_1"})


SCORE_NAMES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))
"""vLLM's other names for /v1/score's two sides."""


def add_routes(app: FastAPI, ctx: ServerContext) -> None:
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, _rerank_route(ctx), methods=["POST"])
    for path in ("/v1/score", "/score"):
        app.add_api_route(path, _score_route(ctx), methods=["POST"])


def _rerank_route(ctx: ServerContext):
    async def rerank_documents(body: RerankRequest, request: Request):
        return await rerank(ctx, body, request)

    return rerank_documents


def _score_route(ctx: ServerContext):
    async def score_pairs(body: ScoreRequest, request: Request):
        return await score(ctx, body, request)

    return score_pairs


async def rerank(ctx: ServerContext, body: RerankRequest, request: Request) -> dict:
    lora = check_model(ctx, body.model, "score", request.url.path)
    if not body.query:
        raise RequestError(400, "query: give a non-empty query", param="query")
    queries, docs = _pairs(body.query, body.texts(), "documents")
    scores, tokens = await pair_scores(ctx, request, new_request_id("rerank"), queries, docs,
                                       body.truncate_prompt_tokens, "documents", lora, body.use_activation)
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:body.top_n or None]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": docs[i]}} if body.return_documents else {})} for i in order]
    return {"id": new_request_id("rerank"), "model": lora or ctx.model_name, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def score(ctx: ServerContext, body: ScoreRequest, request: Request) -> dict:
    lora = check_model(ctx, body.model, "score", request.url.path)
    queries, docs = _pairs(body.text_1, body.text_2, "text_2")
    scores, tokens = await pair_scores(ctx, request, new_request_id("score"), queries, docs,
                                       body.truncate_prompt_tokens, "text_2", lora, body.use_activation)
    return {"id": new_request_id("score"), "object": "list", "created": int(time.time()),
            "model": lora or ctx.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _pairs(query, documents, param: str) -> tuple[list[str], list[str]]:
    try:
        return pairs_of(query, documents)
    except InvalidRequestError as exc:
        raise RequestError(400, f"{param}: {exc}", param=param) from None
