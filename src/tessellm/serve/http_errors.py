"""Every failure of every route as OpenAI's error body: an unknown route (404), a wrong method
(405), a body that is not JSON or not sent as JSON, a field that fails validation (named as
the API names it, with ``param`` set), an error a route raises (``RequestError``) and, last,
a bug (500). ``add_error_handlers`` registers them on the app."""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessellm.core.errors import InvalidRequestError
from tessellm.serve.errors import error


class RequestError(Exception):
    """An answer other than success that a route decides on: the HTTP status, a message naming
    what is wrong, the request field it is about (``param``), OpenAI's error ``kind`` (its
    ``type``) and a machine-readable ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def response(self) -> JSONResponse:
        return error(self.status, str(self), kind=self.kind, param=self.param, code=self.code)


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestError, refused)
    app.add_exception_handler(InvalidRequestError, refused)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, server_error)


async def refused(request: Request, exc: Exception) -> JSONResponse:
    """A ``RequestError`` a route raised; an engine's ``InvalidRequestError`` no route caught
    (a 400 without ``param``)."""
    return exc.response() if isinstance(exc, RequestError) else error(400, str(exc))


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's routing errors, in OpenAI's words: 404 ``Invalid URL (POST /v1/x)``, 405
    ``Invalid method for URL (GET /v1/completions)`` (with its ``Allow`` header)."""
    where = f"({request.method} {request.url.path})"
    if exc.status_code == 404 and exc.detail == "Not Found":
        message = f"Invalid URL {where}"
    elif exc.status_code == 405:
        message = f"Invalid method for URL {where}"
    else:
        message = str(exc.detail)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    response = error(exc.status_code, message, kind=kind)
    response.headers.update(exc.headers or {})
    return response


async def server_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug: Starlette logs its traceback; the client gets a 500 in OpenAI's shape."""
    return error(500, f"internal server error: {type(exc).__name__}", kind="server_error")


def is_json(content_type: str | None) -> bool:
    """Whether a request's Content-Type is JSON (absent counts: FastAPI then reads JSON)."""
    if not content_type:
        return True
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A request body FastAPI could not validate: a 400 whose message and ``param`` name the
    field as the API does (``messages[0].content``), not as pydantic's locations do
    (``body.messages.0.content.str``)."""
    content_type = request.headers.get("content-type")
    if not is_json(content_type):
        return error(400, f"the body must be JSON sent with 'Content-Type: application/json' (got {content_type!r})")
    errors = list(exc.errors())
    if not errors:
        return error(400, "invalid request")
    body = getattr(exc, "body", None)
    first = errors[0]
    path, tag_at = api_path(first.get("loc", ()), body, first.get("type") == "missing")
    if not path:
        return _body_error(first, body)
    param = format_path(path)
    if tag_at is not None:  # a union: say what each of its forms made of the value
        return error(400, _union_message(param, path, errors, body), param=param)
    if first.get("type") == "missing":
        return error(400, f"Missing required parameter: {param!r}", param=param)
    message = clean_message(first["msg"], param)
    if "input" in first and "got " not in message:
        message += f" (got {_short(first['input'])})"
    return error(400, f"{param}: {message}", param=param)


def _body_error(first: dict[str, Any], body: Any) -> JSONResponse:
    """An error about the whole body: not JSON, empty, not an object, or a check of the
    request as a whole (a field the server does not support names itself in ``ctx``)."""
    kind = first.get("type")
    if kind == "json_invalid":
        return error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if kind == "missing":
        return error(400, "the request body is empty; send a JSON object")
    if kind in ("model_attributes_type", "dict_type", "model_type"):
        return error(400, f"the body must be a JSON object, got {_json_type(body)}")
    field = (first.get("ctx") or {}).get("field")
    return error(400, clean_message(first["msg"]), param=field)


def api_path(loc: tuple, body: Any, missing: bool) -> tuple[list[str | int], int | None]:
    """The part of a pydantic location that indexes the request body, and where the first
    union member's tag (``str``, ``list[int]``, ...) stood in it (None: no union). A part
    that is no key or index of the value at that point is such a tag; the last part of a
    missing field is the field."""
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc)
    path: list[str | int] = []
    tag_at, node = None, body
    for i, part in enumerate(parts):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif missing and i == len(parts) - 1 and isinstance(part, str):
            node = None
        else:
            tag_at = len(path) if tag_at is None else tag_at
            continue
        path.append(part)
    return path, tag_at


def format_path(path: list[str | int]) -> str:
    """``["messages", 0, "content"]`` -> ``messages[0].content``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _union_message(param: str, path: list[str | int], errors: list[dict[str, Any]], body: Any) -> str:
    """``stop: got 5, which fits none of its forms (str: Input should be a valid string;
    list[str]: Input should be a valid list)``: each form's first error under the union."""
    union_loc = _union_prefix(errors[0]["loc"], body)
    forms: dict[str, str] = {}
    for err in errors:
        loc = tuple(err["loc"])
        if loc[:len(union_loc)] != union_loc or len(loc) <= len(union_loc):
            continue
        tag = _tag_name(str(loc[len(union_loc)]))
        if tag in forms:
            continue
        inner, _ = api_path(("body",) + loc[len(union_loc) + 1:], _value_at(body, path), err.get("type") == "missing")
        where = format_path(inner)
        forms[tag] = f"{where}: {clean_message(err['msg'])}" if where else clean_message(err["msg"])
    described = "; ".join(f"{tag}: {what}" for tag, what in forms.items())
    return f"{param}: got {_short(_value_at(body, path))}, which fits none of its forms ({described})"


def _union_prefix(loc: tuple, body: Any) -> tuple:
    """The leading part of ``loc`` up to (not including) the first union tag."""
    path, tag_at = api_path(tuple(loc), body, False)
    head = 1 if loc and loc[0] in ("body", "query", "path", "header") else 0
    return tuple(loc[:head + (tag_at if tag_at is not None else len(path))])


def _value_at(body: Any, path: list[str | int]) -> Any:
    for part in path:
        body = body[part]
    return body


def _tag_name(tag: str) -> str:
    """A union member's tag as a type name: ``function-after[_has_content(), ChatMessage]`` -> ``ChatMessage``."""
    match = re.fullmatch(r"[a-z-]+\[.*?(\w+)\]", tag)
    return match.group(1) if match and tag.startswith(("function-", "json-or-python")) else tag


def clean_message(message: str, param: str | None = None) -> str:
    """pydantic's message without its ``Value error, `` prefix and, when it already begins
    with the field's name, without saying it twice."""
    message = re.sub(r"^(Value error|Assertion failed), ", "", message)
    if param is not None and re.match(rf"{re.escape(param)}\b", message):
        return message[len(param):].lstrip(": ")
    return message


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null", bytes: "bytes that are not JSON"}
    return names.get(type(value), type(value).__name__)
