"""The models a server answers to: its base model and the LoRA adapters over it.

A request's ``model`` names the base model (or is left out) or a registered adapter, which
the request then runs under; adapter requests and base requests share the engine's batches.
GET /v1/models lists them all (an adapter as vLLM shows one: ``root`` its folder, ``parent``
the base model), GET /v1/models/{id} retrieves one. With runtime updates on
(``lora.runtime_updates``, ``tessellm serve --allow-runtime-lora-updating``), vLLM's POST
/v1/load_lora_adapter and /v1/unload_lora_adapter change the adapters while serving; off,
they answer 404 saying how to turn them on.

The engine's adapter registry is changed by the engine core between two steps
(``EngineClient.call``: ``load_lora`` reads the folder on a worker thread of the core first);
the server's own list (``ServedModels``) is replaced whole, never edited in place, on the
event loop, after a load and before an unload, so a route reading it sees one state or the
next. Each load and unload is logged.
"""

from __future__ import annotations

import logging
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
logger = logging.getLogger("tessellm.server")


@dataclass(frozen=True)
class ServedAdapter:
    """A LoRA adapter clients may name: its name, its PEFT folder, when it was registered."""

    name: str
    path: str
    created: int


class ServedModels:
    """The base model's public name and the adapters registered over it, by name.

    ``adapters`` is replaced by ``add`` and ``remove`` on the event loop (after the engine
    core registered an adapter, before it unregisters one); readers take it as it stands."""

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
        try:  # the core reads the folder on a worker thread: decoding goes on meanwhile
            root = await ctx.engine.call("load_lora", name, path)
        except (LoraAdapterError, InvalidRequestError) as exc:
            param = "lora_name" if name in models.adapters else "lora_path"
            raise RequestError(400, str(exc), param=param) from None
        models.add(name, root)
        logger.info("LoRA adapter %r loaded from %r", name, path)
        return PlainTextResponse(f"Success: LoRA adapter {name!r} loaded from {path!r}.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest):
        check_runtime_updates(models, "unload_lora_adapter")
        name = body.lora_name
        if name not in models.adapters:
            raise RequestError(404, f"LoRA adapter {name!r} is not loaded; loaded adapters: "
                                    f"{', '.join(map(repr, sorted(models.adapters))) or 'none'}",
                               param="lora_name", code="model_not_found")
        models.remove(name)  # new requests naming it get 404 from now on
        try:
            await ctx.engine.call("unload_lora", name)
        except (LoraAdapterError, InvalidRequestError) as exc:
            raise RequestError(404, str(exc), param="lora_name", code="model_not_found") from None
        logger.info("LoRA adapter %r unloaded", name)
        return PlainTextResponse(f"Success: LoRA adapter {name!r} unloaded.")


def check_runtime_updates(models: ServedModels, route: str) -> None:
    """A 404 naming how to turn runtime updates on, unless they are on."""
    if not models.runtime_updates:
        raise RequestError(404, f"POST /v1/{route} is off: loading and unloading LoRA adapters while serving needs "
                                f"runtime updates; start the server with {RUNTIME_FLAG} (config: "
                                f"lora.runtime_updates: true)", code="runtime_lora_updates_disabled")
