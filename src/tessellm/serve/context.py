"""What every protocol module of the server shares: the loaded model, the engine thread that
serves it, the model's public name and when the server started."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessellm.serve.engine_thread import EngineThread


@dataclass
class ServerContext:
    """``llm``: the loaded ``LLM`` (its tokenizer and pipeline); ``engine``: the one engine
    thread every request goes through; ``model_name``: the id clients send and
    ``/v1/models`` lists; ``created``: when the server started (Unix seconds), the models'
    ``created`` and the default of a response's."""

    llm: Any
    engine: EngineThread
    model_name: str
    created: int
