"""The engine core on a thread of the server's process (``tessellm serve --engine-core
thread``, and an ``LLM`` handed to ``build_app``): an ``EngineClient`` whose core runs on a
background thread, exchanging the same messages as with a core process (serve/engine_client.py
``ThreadTransport``). The debugging mode: one process, the engine's objects at hand
(``engine``), at the cost of the GIL shared by HTTP and the engine's steps."""

from __future__ import annotations

from typing import Any

from tessellm.serve.engine_client import EngineClient, SampleDelta, ServerBusy, StepOutput, ThreadTransport
from tessellm.serve.engine_protocol import RequestFailed

__all__ = ["EngineThread", "RequestFailed", "SampleDelta", "ServerBusy", "StepOutput"]


class EngineThread(EngineClient):
    """``llm``'s engine stepped on a thread named ``tessellm-engine``; ``start()`` starts it,
    ``shutdown()`` stops it (and closes the pipeline)."""

    def __init__(self, llm: Any, *, max_waiting: int | None = None, metrics: Any | None = None):
        super().__init__(ThreadTransport(llm), llm.tokenizer, getattr(llm.pipeline, "tokenizer_lock", None),
                         max_waiting=max_waiting, metrics=metrics)
        self.llm = llm
        self.image_processor_factory = lambda: llm.pipeline.image_processor
        self.images = llm.pipeline.config.images

    @property
    def engine(self) -> Any:
        """The engine itself (read it from the event loop only where a race does not matter)."""
        return self.llm.engine

    @property
    def core(self) -> Any:
        """The ``EngineCore`` looping on the thread."""
        return self.transport.core

    @property
    def errors(self) -> int:
        """Steps that raised, bugs outside steps, and requests the engine failed."""
        return self.core.step_errors + self.failed_requests

    def start(self) -> None:
        self.transport.start()
