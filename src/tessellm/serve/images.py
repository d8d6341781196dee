"""Images in chat messages (OpenAI's ``image_url`` content parts): each part becomes the
model's image marker in the message's text (what its chat template writes for an image
part), and its image is read from the part's ``data:`` URL; the prompt's text and images then
go through the model's ``ImageProcessor``, here where prompts are tokenized. An http(s) URL
is refused: this server fetches nothing."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from tessellm.core.errors import InvalidRequestError
from tessellm.core.model.vision import read_image
from tessellm.serve.http_errors import RequestError


def has_images(messages: list[Any]) -> bool:
    return any(isinstance(m.content, list) for m in messages)


def image_from_url(url: str, where: str) -> Any:
    """The image a part's URL holds (a ``data:`` URL, base64); RequestError naming ``where``."""
    if url.startswith(("http://", "https://")):
        raise RequestError(400, f"{where}: fetching image URLs is off on this server; send the image inline as a "
                                f"data: URL (data:image/png;base64,...)", param=where)
    if not url.startswith("data:") or "," not in url:
        raise RequestError(400, f"{where}: {url[:40]!r} is not a data: URL; send data:image/<format>;base64,<bytes>",
                           param=where)
    head, payload = url[5:].split(",", 1)
    if not head.endswith(";base64"):
        raise RequestError(400, f"{where}: the data: URL must be base64 (data:image/<format>;base64,...)",
                           param=where)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, f"{where}: the data: URL's payload is not valid base64", param=where) from None
    try:
        return read_image(raw)
    except InvalidRequestError as exc:
        raise RequestError(400, f"{where}: {str(exc).removeprefix('image 0 ')}", param=where) from None


def messages_with_markers(messages: list[Any], marker: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """The messages as dicts with each image part replaced by ``marker`` in the text, and the
    images in order."""
    out, images = [], []
    for i, message in enumerate(messages):
        m = message.model_dump()
        if isinstance(message.content, list):
            texts = []
            for j, part in enumerate(message.content):
                if part.type == "text":
                    texts.append(part.text)
                else:
                    images.append(image_from_url(part.image_url.url, f"messages[{i}].content[{j}].image_url"))
                    texts.append(marker)
            m["content"] = "".join(texts)
        out.append(m)
    return out, images
