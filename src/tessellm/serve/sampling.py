"""What completions and chat share before the engine sees a request: the model check (the
base model or a LoRA adapter), the ``SamplingParams`` a request body asks for, and which
request field an engine's refusal is about (the field the error carries), so that every 400
names the field as the API spells it (``param``)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.serve.context import ServerContext
from tessellm.serve.http_errors import RequestError, clean_message


def check_model(ctx: ServerContext, requested: str | None, task: str | None = None, route: str = "") -> str | None:
    """The LoRA adapter ``requested`` names, None for the base model (its name, or None: the
    default); a 404 ``model_not_found`` RequestError for a model this server does not serve.
    With ``task`` ("generate", "embed", "score"), a 400 from ``route`` unless the pipeline
    serves it (``check_task``)."""
    lora = ctx.models.lora_of(requested)
    if task is not None:
        check_task(ctx, task, route)
    return lora


ROUTES = {"embed": "/v1/embeddings", "score": "/v1/rerank or /v1/score", "generate": "/v1/completions, "
          "/v1/chat/completions or /v1/responses"}


def check_task(ctx: ServerContext, task: str, route: str) -> None:
    """A 400 unless the pipeline serves ``task`` ("embed"; "score": a reranker, or an
    embedding model scoring by similarity), naming what it serves and where."""
    info = ctx.engine.info
    have = info.task
    if have == task or (task == "score" and have == "embed"):
        return
    what = {"generate": "generates text (it has no pooler)", "embed": f"embeds texts (pooling plugin {info.pooler!r})",
            "score": f"scores (query, document) pairs (pooling plugin {info.pooler!r})"}[have]
    raise RequestError(400, f"{route}: model {ctx.model_name!r} {what}; it serves {ROUTES[have]}",
                       param="model", code="wrong_task")


def sampling_params(ctx: ServerContext, body: Any, *, max_tokens: int | None, logprobs: int | None,
                    names: dict[str, str] | None = None, **more: Any) -> SamplingParams:
    """The engine's ``SamplingParams`` for ``body`` (a completions or chat request); a field
    out of the engine's bounds (``n`` over 64, ...) is a RequestError naming it. ``names``
    maps a ``SamplingParams`` field to the request's name for it where the two differ
    (chat's ``top_logprobs`` is the engine's ``logprobs``)."""
    if max_tokens is None:
        max_tokens = max(1, ctx.engine.info.max_model_len // 2)
    if body.use_beam_search:
        _check_beams(ctx, body)
    try:
        bias = body.bias()
    except InvalidRequestError as exc:
        raise RequestError(400, str(exc), param="logit_bias") from None
    temperature = 0.0 if body.use_beam_search and "temperature" not in body.model_fields_set else body.temperature
    fields = dict(max_tokens=max_tokens, temperature=temperature, top_p=body.top_p, top_k=body.top_k,
                  min_p=body.min_p, n=body.n, stop=body.stop_list(), seed=body.seed, logprobs=logprobs,
                  ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, logit_bias=bias,
                  **body.logits_fields(), extra_args={**(body.extra_args or {}), **body.beam_args()}, **more)
    try:
        return SamplingParams.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else None
        param = (names or {}).get(field, field)
        message = clean_message(first["msg"], field)
        got = "" if "got " in message else f" (got {first.get('input')!r})"
        raise RequestError(400, f"{param}: {message}{got}", param=param) from None


def _check_beams(ctx: ServerContext, body: Any) -> None:
    """``use_beam_search`` needs a decoder that runs joint requests, and no stream."""
    info = ctx.engine.info
    if not info.joint_decoding:
        raise RequestError(400, f"use_beam_search: this server decodes with {info.decoder!r}, which does not search "
                                f"beams; start it with --set decoding.name=beam", param="use_beam_search")
    if body.stream:
        raise RequestError(400, "use_beam_search: beam search results are known only at its end, so they are not "
                                "streamed; send stream false", param="stream")


def admission_param(exc: BaseException, body: Any, prompt_param: str) -> str | None:
    """The request field an engine's refusal at admission is about (``InvalidRequestError.
    field``), as the API spells it: the prompt (``prompt_param``: ``prompt``, ``messages`` or
    ``input``), else the field's first part where the body has a field of that name, else
    the engine's name for it; None when the refusal names no field."""
    field = getattr(exc, "field", None)
    if field is None:
        return None
    top = field.split(".", 1)[0]
    if top in ("prompt", "images"):
        return prompt_param
    spelled = BODY_NAMES.get(top)
    if spelled is None:
        return top
    given = getattr(body, "model_fields_set", set())
    return next((name for name in spelled if name in given), spelled[0])


BODY_NAMES = {"structured_output": ("structured_outputs", "response_format", "text", "tools"), "lora": ("model",)}
"""Engine fields a request body spells otherwise, in the order tried: the first the body set."""
