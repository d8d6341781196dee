"""The models a server answers to: its base model and the LoRA adapters over it.

A request's ``model`` names the base model (or is left out) or a registered adapter, which
the request then runs under; adapter requests and base requests share the engine's batches.
GET /v1/models lists them all (an adapter as vLLM shows one: ``root`` its folder, ``parent``
the base model), GET /v1/models/{id} retrieves one. With runtime updates on
(``lora.runtime_updates``, ``tessellm serve --allow-runtime-lora-updating``), vLLM's POST
/v1/load_lora_adapter and /v1/unload_lora_adapter change the adapters while serving; off,
they answer 404 saying how to turn them on.

The engine's adapter registry is changed on the engine thread only (``EngineThread.call``);
the server's own list (``ServedModels``) is replaced whole, never edited in place, by that
same call, so a route reading it on the event loop sees one state or the next.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from tessellm.core.errors import ConfigError, InvalidRequestError, LoraAdapterError
from tessellm.serve.http_errors import RequestError

if TYPE_CHECKING:
    from tessellm.serve.context import ServerContext

RUNTIME_FLAG = "--allow-runtime-lora-updating"


@dataclass(frozen=True)
class ServedAdapter:
    """A LoRA adapter clients may name: its name, its PEFT folder, when it was registered."""

    name: str
    path: str
    created: int


class ServedModels:
    """The base model's public name and the adapters registered over it, by name.

    ``adapters`` is replaced by ``add`` and ``remove``, which run on the engine thread right
    after the engine's registry changed; readers on the event loop take it as it stands."""

    def __init__(self, base: str, root: str, created: int, max_model_len: int,
                 adapters: dict[str, str] | None = None, runtime_updates: bool = False):
        self.base, self.root, self.created, self.max_model_len = base, root, created, max_model_len
        self.runtime_updates = runtime_updates
        if base in (adapters or {}):
            raise ConfigError(f"LoRA adapter {base!r} has the served model's name; name the adapter otherwise "
                              f"(or the model, with --served-model-name)")
        self.adapters: dict[str, ServedAdapter] = {n: ServedAdapter(n, p, created) for n, p in (adapters or {}).items()}

    def lora_of(self, requested: str | None) -> str | None:
        """The adapter a request's ``model`` names (None: the base model; a 404
        ``model_not_found`` RequestError for a name that is neither)."""
        if requested is None or requested == self.base:
            return None
        if requested in self.adapters:
            return requested
        raise RequestError(404, f"The model {requested!r} does not exist; this server serves {self.served()}",
                           param="model", code="model_not_found")

    def served(self) -> str:
        """The names a request may give, for error messages."""
        adapters = sorted(self.adapters)
        return repr(self.base) + (f" and LoRA adapters {', '.join(map(repr, adapters))}" if adapters else "")

    def add(self, name: str, path: str) -> None:
        self.adapters = {**self.adapters, name: ServedAdapter(name, path, int(time.time()))}

    def remove(self, name: str) -> None:
        self.adapters = {n: a for n, a in self.adapters.items() if n != name}

    def cards(self) -> list[dict[str, Any]]:
        """The model objects of /v1/models: the base model first, then each adapter."""
        adapters = self.adapters
        return [self.base_card()] + [self.adapter_card(adapters[n]) for n in sorted(adapters)]

    def card(self, model_id: str) -> dict[str, Any]:
        """One model object (a 404 ``model_not_found`` RequestError for an unknown id)."""
        adapter = self.adapters.get(model_id)
        if adapter is not None:
            return self.adapter_card(adapter)
        if model_id == self.base:
            return self.base_card()
        raise RequestError(404, f"The model {model_id!r} does not exist; this server serves {self.served()}",
                           param="model", code="model_not_found")

    def base_card(self) -> dict[str, Any]:
        return {"id": self.base, "object": "model", "created": self.created, "owned_by": "tessellm",
                "root": self.root, "parent": None, "max_model_len": self.max_model_len}

    def adapter_card(self, adapter: ServedAdapter) -> dict[str, Any]:
        return {"id": adapter.name, "object": "model", "created": adapter.created, "owned_by": "tessellm",
                "root": adapter.path, "parent": self.base, "max_model_len": self.max_model_len}


class LoadLoraAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter: register the PEFT folder ``lora_path`` as ``lora_name``."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter: unregister ``lora_name`` (its running requests finish)."""

    model_config = ConfigDict(extra="ignore")  # vLLM's lora_int_id too: adapters are known by name here

    lora_name: str


def add_routes(app: FastAPI, ctx: "ServerContext") -> None:
    models = ctx.models

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": models.cards()}

    @app.get("/v1/models/{model_id:path}")
    async def model_by_id(model_id: str):
        return models.card(model_id)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest):
        check_runtime_updates(models, "load_lora_adapter")
        name, path = body.lora_name.strip(), body.lora_path.strip()
        if not name or not path:
            raise RequestError(400, "both lora_name and lora_path must be given (non-empty)",
                               param="lora_path" if name else "lora_name")
        if name == models.base:
            raise RequestError(400, f"lora_name {name!r} is the base model's name; choose another",
                               param="lora_name")
        if name in models.adapters:
            raise RequestError(400, f"LoRA adapter {name!r} is already loaded (from {models.adapters[name].path!r}); "
                                    f"unload it first to load another under that name", param="lora_name")
        try:  # the folder is read off the engine's thread: decoding goes on meanwhile
            adapter = await asyncio.to_thread(ctx.llm.pipeline.lora.reader.read, name, path)
        except LoraAdapterError as exc:
            raise RequestError(400, str(exc), param="lora_path") from None
        await ctx.engine.call(_load, models, name, path, adapter)
        return PlainTextResponse(f"Success: LoRA adapter {name!r} loaded from {path!r}.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest):
        check_runtime_updates(models, "unload_lora_adapter")
        name = body.lora_name
        if name not in models.adapters:
            raise RequestError(404, f"LoRA adapter {name!r} is not loaded; loaded adapters: "
                                    f"{', '.join(map(repr, sorted(models.adapters))) or 'none'}",
                               param="lora_name", code="model_not_found")
        await ctx.engine.call(_unload, models, name)
        return PlainTextResponse(f"Success: LoRA adapter {name!r} unloaded.")


def check_runtime_updates(models: ServedModels, route: str) -> None:
    """A 404 naming how to turn runtime updates on, unless they are on."""
    if not models.runtime_updates:
        raise RequestError(404, f"POST /v1/{route} is off: loading and unloading LoRA adapters while serving needs "
                                f"runtime updates; start the server with {RUNTIME_FLAG} (config: "
                                f"lora.runtime_updates: true)", code="runtime_lora_updates_disabled")


def _load(engine: Any, models: ServedModels, name: str, path: str, adapter: Any) -> None:
    """On the engine thread: register the adapter (read already) with the engine, then serve
    its name. A name taken meanwhile is a 400 naming the problem."""
    try:
        engine.load_lora(name, path, adapter)
    except (LoraAdapterError, InvalidRequestError) as exc:
        param = "lora_name" if name in models.adapters else "lora_path"
        raise RequestError(400, str(exc), param=param) from None
    models.add(name, engine.lora.get(name).path)


def _unload(engine: Any, models: ServedModels, name: str) -> None:
    """On the engine thread: stop serving the name, then unregister it (requests running
    under it finish; new ones get 404)."""
    models.remove(name)
    try:
        engine.unload_lora(name)
    except (LoraAdapterError, InvalidRequestError) as exc:
        raise RequestError(404, str(exc), param="lora_name", code="model_not_found") from None
