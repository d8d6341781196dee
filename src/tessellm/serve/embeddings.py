"""POST /v1/embeddings: OpenAI's embeddings API. ``input`` is a string, a list of strings, a
list of token ids or a list of such lists; ``encoding_format`` "float" (lists of numbers) or
"base64" (each embedding's float32 little-endian bytes, as the openai client decodes them);
``dimensions`` keeps an embedding's first values (Matryoshka), normalised after. vLLM's and
sentence-transformers' extras: ``truncate_prompt_tokens`` (an input past the model's length
is refused without it), ``normalize`` and ``prompt_name``."""

from __future__ import annotations

import base64
import time
from typing import Literal, Optional, Union

import numpy as np
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from tessellm.serve.context import ServerContext
from tessellm.serve.http_errors import RequestError
from tessellm.serve.pooling import pooling_params, run_pooled
from tessellm.serve.pooling_kind import POOL
from tessellm.serve.sampling import check_model
from tessellm.serve.streaming import new_request_id

TokenIds = list[StrictInt]
MAX_INPUTS = 2048
"""OpenAI's limit on inputs per request."""


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request, with vLLM's and sentence-transformers' extras."""

    model_config = ConfigDict(extra="ignore")

    input: Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]]
    """The text(s) or token ids to embed: 1 to ``MAX_INPUTS`` inputs."""
    model: Optional[str] = None
    encoding_format: Optional[Literal["float", "base64"]] = None
    """"float" (lists of numbers; also when null or absent) or "base64"."""
    dimensions: Optional[int] = Field(None, ge=1)
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    """Truncate each input to this many tokens (-1: the model's limit); None: refuse a longer one."""
    normalize: Optional[bool] = None
    prompt_name: Optional[str] = None
    """One of the checkpoint's named prompts (sentence-transformers'), put before each text."""

    def inputs(self) -> list:
        """The inputs as a list (a lone string or token-id list becomes one)."""
        given = self.input
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            return [given]
        return list(given)


def add_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await embed(ctx, body, request)


async def embed(ctx: ServerContext, body: EmbeddingRequest, request: Request) -> dict:
    lora = check_model(ctx, body.model, "embed", "/v1/embeddings")
    texts = body.inputs()
    if not 1 <= len(texts) <= MAX_INPUTS:
        raise RequestError(400, f"input: give 1 to {MAX_INPUTS} texts or lists of token ids, not {len(texts)}",
                           param="input")
    params = pooling_params(dimensions=body.dimensions, normalize=body.normalize)
    payloads = [POOL.encode(input=text, prompt_name=body.prompt_name, truncate=body.truncate_prompt_tokens,
                            params=params, lora=lora) for text in texts]
    outs = await run_pooled(ctx, request, new_request_id("embd"), payloads, "input")
    data = [{"object": "embedding", "index": i, "embedding": encoded(o.values, body.encoding_format or "float")}
            for i, o in enumerate(outs)]
    tokens = sum(o.prompt_tokens for o in outs)
    return {"object": "list", "data": data, "model": lora or ctx.model_name, "created": int(time.time()),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def encoded(values: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as the API sends it: a list of numbers, or base64 of float32 little-endian bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return values
