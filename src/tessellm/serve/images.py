"""Images in requests: OpenAI's ``image_url`` chat content parts and the Responses API's
``input_image`` items. Each image part becomes the model's image marker in its message's
text (what its chat template writes for an image part), and its image is read from the
part's URL: a ``data:`` URL always, an http(s) URL only where the config's ``images.fetch_urls``
is on (``tessellm serve --allow-image-urls``), within ``fetch_max_bytes`` and
``fetch_timeout_s``. The prompt's text and images then go through the model's
``ImageProcessor``, here where prompts are tokenized.

Everything wrong with an image is a ``RequestError`` (400) naming the part and what is
allowed: too many images (checked before any is read), a URL this server does not read, bad
base64, a file that is not an image or is in an unsupported format, a fetch that fails, is
too large or too slow, and an image sent to a model that takes none."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tessellm.core.errors import InvalidRequestError
from tessellm.core.model.vision import data_url_bytes, read_image
from tessellm.serve.http_errors import RequestError


@dataclass
class ImageRef:
    """An image part of a message: its URL and where in the request it is (for errors)."""

    url: str
    where: str


def has_images(messages: list[Any]) -> bool:
    return any(isinstance(m.content, list) and any(p.type == "image_url" for p in m.content) for m in messages)


def image_processor_of(ctx: Any, param: str) -> Any:
    """The served model's ``ImageProcessor``; a 400 naming ``param`` for a text-only model."""
    processor = ctx.engine.image_processor
    if processor is None:
        raise RequestError(400, f"model {ctx.model_name!r} is a text-only model: it takes no images; send the "
                                f"{param} without image parts", param=param)
    return processor


def check_image_count(count: int, policy: Any, param: str) -> None:
    """A 400 naming the limit when a prompt holds more images than ``policy`` allows."""
    limit = policy.max_per_prompt
    if count > limit:
        raise RequestError(400, f"{count} images in one prompt; this server takes at most {limit} per prompt "
                                f"(images.max_per_prompt, tessellm serve --limit-mm-per-prompt image=N)", param=param)


def image_from_url(url: str, where: str, policy: Any) -> Any:
    """The image a part's URL holds (``data:`` URL, base64; or an http(s) URL, fetched where
    ``policy.fetch_urls``); RequestError naming ``where``."""
    if url.startswith(("http://", "https://")):
        return _read(fetch_image(url, where, policy), where)
    if not url.startswith("data:") or "," not in url:
        raise RequestError(400, f"{where}: {url[:40]!r} is not a data: or http(s) URL; send "
                                f"data:image/<format>;base64,<bytes>", param=where)
    try:
        raw = data_url_bytes(url, where)
    except InvalidRequestError as exc:
        raise RequestError(400, str(exc), param=where) from None
    return _read(raw, where)


def _read(raw: bytes, where: str) -> Any:
    try:
        return read_image(raw)
    except InvalidRequestError as exc:
        raise RequestError(400, f"{where}: {str(exc).removeprefix('image 0 ')}", param=where) from None


def fetch_image(url: str, where: str, policy: Any) -> bytes:
    """The bytes at an http(s) ``url``, read within ``policy``'s size and time limits (the
    time limit covers connecting and the whole body); RequestError naming ``where`` when
    fetching is off, fails, or goes past a limit."""
    if not policy.fetch_urls:
        raise RequestError(400, f"{where}: fetching image URLs is off on this server; send the image inline as a "
                                f"data: URL (data:image/png;base64,...), or start the server with --allow-image-urls "
                                f"(images.fetch_urls: true)", param=where)
    import httpx

    limit, seconds = policy.fetch_max_bytes, policy.fetch_timeout_s
    too_large = RequestError(400, f"{where}: the image at {url[:200]!r} is larger than this server's "
                                  f"{limit} bytes (images.fetch_max_bytes, --image-fetch-max-bytes)", param=where)
    deadline = time.monotonic() + seconds
    try:
        with httpx.Client(timeout=seconds, follow_redirects=True, max_redirects=5) as client:
            with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise RequestError(400, f"{where}: fetching {url[:200]!r} answered HTTP {response.status_code}",
                                       param=where)
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise too_large
                chunks, size = [], 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("the whole body took too long")
                    chunks.append(chunk)
    except httpx.TimeoutException:
        raise RequestError(400, f"{where}: fetching {url[:200]!r} took longer than this server's {seconds:g} s "
                                f"(images.fetch_timeout_s, --image-fetch-timeout)", param=where) from None
    except httpx.HTTPError as exc:
        raise RequestError(400, f"{where}: fetching {url[:200]!r} failed: {exc}", param=where) from None
    return b"".join(chunks)


def process_prompt(ctx: Any, text: str, images: list[Any], param: str) -> tuple[list[int], list[Any]]:
    """A rendered prompt and its images through the model's processor: token ids with the
    images' placeholders expanded, and the processed images."""
    processor = ctx.engine.image_processor
    try:
        with ctx.engine.tokenizer_lock:
            processed = processor.process(text, images)
    except InvalidRequestError as exc:
        raise RequestError(400, str(exc), param=param) from None
    return processed.token_ids, processed.images


def with_markers(messages: list[dict[str, Any]], marker: str, policy: Any,
                 param: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """Chat messages (dicts) whose list contents hold text parts (``{"type": "text"}``) and
    ``ImageRef``s, as messages with each image replaced by ``marker`` in the text, and the
    images read, in order (the count checked against ``policy`` first)."""
    refs = [part for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, ImageRef)]
    check_image_count(len(refs), policy, param)
    out, images = [], []
    for message in messages:
        if isinstance(message.get("content"), list):
            texts = []
            for part in message["content"]:
                if isinstance(part, ImageRef):
                    images.append(image_from_url(part.url, part.where, policy))
                    texts.append(marker)
                else:
                    texts.append(part["text"])
            message = {**message, "content": "".join(texts)}
        out.append(message)
    return out, images


def chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The chat request's messages as dicts, image parts as ``ImageRef``s."""
    out = []
    for i, message in enumerate(messages):
        m = message.model_dump()
        if isinstance(message.content, list):
            m["content"] = [{"type": "text", "text": part.text} if part.type == "text" else
                            ImageRef(part.image_url.url, f"messages[{i}].content[{j}].image_url")
                            for j, part in enumerate(message.content)]
        out.append(m)
    return out
