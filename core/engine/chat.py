"""Conversations for ``LLM.chat``: OpenAI-style messages whose content is a string or a list
of parts (text, and for a model that takes images, image parts), rendered through the
tokenizer's chat template.

Image parts come in the shapes clients send: ``{"type": "image_url", "image_url": {"url":
...}}`` (OpenAI chat), ``{"type": "input_image", "image_url": ...}`` (OpenAI responses) and
``{"type": "image", "image": ...}`` (transformers' chat format), the image a ``data:`` URL,
a path, the file's bytes or a PIL image. Nothing is fetched: an http(s) URL is refused,
naming what to send instead.
"""

from __future__ import annotations

from typing import Any

from tessellm.core.errors import InvalidRequestError
from tessellm.core.model.vision import data_url_bytes

IMAGE_PARTS = ("image_url", "input_image", "image")
TEXT_PARTS = ("text", "input_text")


def split_images(messages: Any) -> tuple[list[dict], list[Any]]:
    """A conversation's messages as the chat template reads them (each image part replaced by
    ``{"type": "image"}``; a content of text parts only joined into one string, which every
    template reads) and its images in order (data: URLs decoded to bytes, other values as
    given, for ``read_image``). InvalidRequestError naming the message and part at fault."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("a conversation is a non-empty list of messages ({'role': ..., 'content': ...})",
                                  field="messages")
    rendered, images = [], []
    for m, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"message {m} is not a dict with a 'role'", field="messages")
        content = message.get("content")
        if content is None or isinstance(content, str):
            rendered.append(dict(message))
            continue
        if not isinstance(content, (list, tuple)):
            raise InvalidRequestError(f"message {m}'s content is a {type(content).__name__}; give a string or a "
                                      f"list of parts", field="messages")
        parts = [_part(m, p, part, images) for p, part in enumerate(content)]
        if all(part["type"] == "text" for part in parts):
            rendered.append({**message, "content": "".join(part["text"] for part in parts)})
        else:
            rendered.append({**message, "content": parts})
    return rendered, images


def _part(m: int, p: int, part: Any, images: list[Any]) -> dict:
    where = f"message {m}, part {p}"
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS:
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}: a text part needs a string 'text'", field="messages")
        return {"type": "text", "text": part["text"]}
    if kind not in IMAGE_PARTS:
        raise InvalidRequestError(f"{where}: part type {kind!r} is not served; parts are "
                                  f"{', '.join(TEXT_PARTS + IMAGE_PARTS)}", field="messages")
    value = part.get(kind) if kind != "input_image" else part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    if value is None and kind == "image":
        value = part.get("url") or part.get("path")
    images.append(_image_value(where, value))
    return {"type": "image"}


def _image_value(where: str, value: Any) -> Any:
    """An image part's value for ``read_image``: a data: URL's bytes; an http(s) URL refused."""
    if isinstance(value, str) and value.startswith("data:"):
        return data_url_bytes(value, where, field="messages")
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        raise InvalidRequestError(f"{where}: LLM.chat fetches nothing; give the image as a data: URL, a path, "
                                  f"bytes or a PIL image", field="messages")
    if value is None:
        raise InvalidRequestError(f"{where}: an image part holds no image", field="messages")
    return value
