"""OpenAI's error body, the one shape every route of the server answers an error with."""

from __future__ import annotations

from fastapi.responses import JSONResponse


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, extra: dict | None = None) -> JSONResponse:
    """``{"error": {"message", "type", "param", "code"}}`` with HTTP status ``status`` (and
    ``extra``'s fields beside ``error``)."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}, **(extra or {})},
                        status_code=status)
