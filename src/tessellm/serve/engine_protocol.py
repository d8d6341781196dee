"""What the API side and the engine core say to each other: compact messages of plain values
(lists, ints, strings; token ids, never text), packed with msgpack, the same bytes whether the
core runs in its own process (serve/engine_process.py) or on a thread of the server's.

To the core:

- ``["add", request_id, kind, payload]``: a request of a kind (``generate``: a prompt's token
  ids and its sampling; others, such as embeddings or image prompts, register their own
  ``RequestKind``), its payload that kind's;
- ``["abort", [request_id, ...], asked_at]``: stop them before the next step (``asked_at``:
  the API side's ``time.monotonic()``, which the core turns into the steps it had started by
  then);
- ``["call", call_id, method, args]``: a named utility call between two steps (load a LoRA
  adapter, ...), answered by a ``result`` message;
- ``["stop"]``: finish and exit.

From the core:

- ``["ready", info]``: the core is built (``EngineInfo``'s fields);
- ``["step", records, errors, admitted, aborted, gauges]``: one pass of its loop: each
  request's progress (a record its kind reads: ``[request_id, finished, ...]``; or, for the
  common decode step, the compact ``[request_id, new_token_ids]``: sample 0 of a running
  request gained these tokens, nothing else changed), the requests refused or failed
  (``[request_id, error, message, field]``), those admitted (``[request_id, prompt_tokens]``)
  and aborted (``[request_id, steps_started_when_asked, steps_started_when_done]``), and, now and then, the gauges;
- ``["result", call_id, ok, value or error]``.

An error crosses as ``[type, message, field]`` (``encode_error``/``decode_error``): the type
among the ones a server answers differently, the field the request error is about.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from tessellm.extras import require

msgpack = require("msgpack", "serve")
from tessellm.core.errors import ConfigError, InvalidRequestError, LoraAdapterError, RequestRejectedError
from tessellm.core.interfaces.sequence import SamplingParams, TokenLogprob


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)


class RequestFailed(RuntimeError):
    """The engine raised while stepping this request, or its core process died; the request
    is aborted."""


class EngineDead(RequestFailed):
    """The engine core is not running (it exited, or is being restarted)."""


ERROR_TYPES: dict[str, type[BaseException]] = {
    "InvalidRequestError": InvalidRequestError, "RequestRejectedError": RequestRejectedError,
    "LoraAdapterError": LoraAdapterError, "ConfigError": ConfigError, "RequestFailed": RequestFailed}


def encode_error(exc: BaseException) -> list[Any]:
    """``[type, message, field]``: the nearest type a server tells apart (``RuntimeError`` for
    any other), the message, and the request field it names (``InvalidRequestError.field``)."""
    kind = next((name for name, cls in ERROR_TYPES.items() if type(exc) is cls), None)
    if kind is None:
        kind = next((name for name, cls in ERROR_TYPES.items() if isinstance(exc, cls)), "RuntimeError")
    return [kind, str(exc), getattr(exc, "field", None)]


def decode_error(encoded: list[Any]) -> BaseException:
    kind, message, field_ = encoded
    cls = ERROR_TYPES.get(kind, RuntimeError)
    exc = cls(message)
    if field_ is not None:
        exc.field = field_
    return exc


# ---------------------------------------------------------------------------- values


def encode_params(params: SamplingParams) -> dict[str, Any]:
    return params.model_dump(exclude_defaults=True)


def decode_params(data: dict[str, Any]) -> SamplingParams:
    return SamplingParams.model_validate(data)


def encode_logprobs(values: list[TokenLogprob] | None) -> list[Any] | None:
    if values is None:
        return None
    return [None if v is None else [v.logprob, [list(t) for t in v.top]] for v in values]


def decode_logprobs(values: list[Any] | None) -> list[TokenLogprob | None] | None:
    if values is None:
        return None
    return [None if v is None else TokenLogprob(v[0], [(t, lp) for t, lp in v[1]]) for v in values]


# ---------------------------------------------------------------------------- what the API learns at start


@dataclass
class EngineInfo:
    """What the API side knows of the engine core once it is built (the ``ready`` message)."""

    model: str
    """The config's ``model`` (the served name's default)."""
    max_model_len: int
    vocab_size: int
    decoder: str
    """The decoding plugin's name."""
    joint_decoding: bool
    """Whether the decoder runs joint requests (beam search)."""
    lora: bool
    """Whether the pipeline serves LoRA adapters."""
    lora_adapters: dict[str, str] = field(default_factory=dict)
    """The adapters registered at start: name -> folder."""
    lora_runtime_updates: bool = False
    total_blocks: int = 0
    pid: int = 0
    """The engine core's process id (this process's, for a core on a thread)."""
    request_kinds: list[str] = field(default_factory=list)
    """The request kinds the core serves (``generate``, ...)."""
    gauges: dict[str, Any] = field(default_factory=dict)
    """The engine's gauges when it was built (serve/engine_core.py ``gauges``): the metrics'
    baseline (a pipeline used before it was served has counted already)."""
    task: str = "generate"
    """What the pipeline serves: "generate", or its pooler's task ("embed", "score")."""
    pooler: str | None = None
    """The pooling plugin's name (None: the pipeline generates)."""
    similarity: str = "cosine"
    """How an embedding pipeline scores two embeddings (the checkpoint's similarity function)."""
    query_prompt: str | None = None
    """The prompt name a query is embedded under when an embedding pipeline scores pairs."""
    document_prompt: str | None = None
    """The prompt name a document is embedded under then."""

    def to_wire(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "EngineInfo":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


# ---------------------------------------------------------------------------- request kinds


@dataclass
class RequestKind:
    """How one kind of request crosses: ``encode`` makes its payload on the API side
    (``encode(*args, **kwargs)``); the core's ``EngineCore`` admits and reports it with the
    handler registered under the same name (serve/engine_core.py ``CORE_KINDS``). The API
    side keeps each request's records as they arrive and turns them into what it hands out
    only when the request's reader takes them: ``reader()`` makes a request's reader, which
    turns the records waiting, in order, into one output (an object with a ``finished``
    flag)."""

    name: str
    encode: Callable[..., dict[str, Any]]
    reader: Callable[[], Callable[[list[list[Any]]], Any]]
    merges: bool = False
    """Whether a reader that fell behind takes every record waiting as one output (one event
    for several steps: the API side keeps up at any step rate); False: one at a time."""
    samples: Callable[[list[Any]], list[tuple[int, int, str | None]]] = lambda record: []
    """A full record's (sample index, new tokens, finish reason) per sample, for the
    server's metrics (a compact record is sample 0's tokens)."""


def is_compact(record: list[Any]) -> bool:
    """A compact record: ``[request_id, new_token_ids]`` (sample 0 gained them; not finished)."""
    return len(record) == 2


REQUEST_KINDS: dict[str, RequestKind] = {}
"""The API side's request kinds by name; a new kind registers here and in ``CORE_KINDS``."""


def register_kind(kind: RequestKind) -> RequestKind:
    REQUEST_KINDS[kind.name] = kind
    return kind


# ---------------------------------------------------------------------------- images


def encode_images(images: list[Any] | None) -> list[Any] | None:
    """Processed images (``ImageInput``s) as wire values: offset, length, content key,
    placeholders, and each tensor as [name, dtype, shape, bytes]."""
    if not images:
        return None
    out = []
    for image in images:
        tensors = [[name, str(t.dtype).removeprefix("torch."), list(t.shape), t.contiguous().numpy().tobytes()]
                   for name, t in image.data.items()]
        out.append([image.offset, image.length, image.key,
                    None if image.placeholders is None else list(image.placeholders), tensors])
    return out


def decode_images(values: list[Any] | None) -> list[Any] | None:
    """``encode_images``' values as ``ImageInput``s again."""
    if not values:
        return None
    import numpy as np
    import torch

    from tessellm.core.interfaces.multimodal import ImageInput

    images = []
    for offset, length, key, placeholders, tensors in values:
        data = {name: torch.from_numpy(np.frombuffer(raw, dtype=np.dtype(dtype)).copy()).reshape(shape)
                for name, dtype, shape, raw in tensors}
        images.append(ImageInput(offset, length, bytes(key), data,
                                 None if placeholders is None else tuple(placeholders)))
    return images
