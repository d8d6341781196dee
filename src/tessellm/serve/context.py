"""What every protocol module of the server shares: the loaded model, the engine thread that
serves it, the model's public name, the models (base and LoRA adapters) a request may name,
and when the server started."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessellm.serve.engine_thread import EngineThread
from tessellm.serve.models import ServedModels


@dataclass
class ServerContext:
    """``llm``: the loaded ``LLM`` (its tokenizer and pipeline); ``engine``: the one engine
    thread every request goes through; ``model_name``: the base model's id, the one clients
    send and ``/v1/models`` lists first; ``created``: when the server started (Unix seconds),
    the models' ``created`` and the default of a response's; ``models``: the base model and
    the LoRA adapters a request's ``model`` may name."""

    llm: Any
    engine: EngineThread
    model_name: str
    created: int
    models: ServedModels
