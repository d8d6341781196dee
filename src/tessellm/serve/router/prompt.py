"""The text a routing policy sees of a request: the prompt of a completion, or the chat
messages rendered deterministically, so requests that share a leading prompt share a leading
text (core/interfaces/routing.py's ``RouteRequest``)."""

from __future__ import annotations

import json
from typing import Any

from tessellm.core.interfaces.routing import RouteRequest


def prompt_text(prompt: Any) -> str:
    """A completion's ``prompt``: a text; token ids as ``"<id> "`` each (a token prefix is a
    text prefix); a list of either joined by newlines."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return "".join(f"{t} " for t in prompt)
    if isinstance(prompt, list):
        return "\n".join(prompt_text(p) for p in prompt)
    return ""


def content_text(content: Any) -> str:
    """A message's content: a text, or its parts' texts (other parts as sorted JSON)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) and p.get("type") == "text"
                       else json.dumps(p, sort_keys=True) for p in content)
    return "" if content is None else json.dumps(content, sort_keys=True)


def messages_text(messages: Any) -> str:
    """Chat messages as ``role: content`` lines (tool calls as sorted JSON): the same leading
    messages always give the same leading text."""
    if not isinstance(messages, list):
        return ""
    lines = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        line = f"{m.get('role', '')}: {content_text(m.get('content'))}"
        if m.get("tool_calls"):
            line += " " + json.dumps(m["tool_calls"], sort_keys=True)
        lines.append(line + "\n")
    return "".join(lines)


def route_request(path: str, body: Any) -> RouteRequest:
    """The ``RouteRequest`` of a request to ``path`` whose parsed JSON body is ``body`` (any
    value: a body that is no object routes with an empty text, and its replica refuses it)."""
    if not isinstance(body, dict):
        return RouteRequest("", None, False, path)
    if "messages" in body:
        text = messages_text(body.get("messages"))
    else:
        text = prompt_text(body.get("prompt", body.get("input", "")))
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return RouteRequest(text, model, bool(body.get("stream")), path)
