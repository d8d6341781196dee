"""What every protocol module of the server shares: the engine client that serves it (its
tokenizer, what it knows of the engine), the model's public name, the models (base and LoRA
adapters) a request may name, and when the server started."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessellm.serve.engine_client import EngineClient
from tessellm.serve.models import ServedModels


@dataclass
class ServerContext:
    """``engine``: the one ``EngineClient`` every request goes through (``engine.tokenizer``,
    ``engine.info``: the engine's limits and parts); ``model_name``: the base model's id, the
    one clients send and ``/v1/models`` lists first; ``created``: when the server started
    (Unix seconds), the models' ``created`` and the default of a response's; ``models``: the
    base model and the LoRA adapters a request's ``model`` may name; ``llm``: the ``LLM``
    whose engine runs on a thread of this process (None for an engine core process)."""

    engine: EngineClient
    model_name: str
    created: int
    models: ServedModels
    llm: Any = None

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer
