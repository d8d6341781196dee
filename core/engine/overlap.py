"""Async scheduling's name of old: ``OverlappedEngine`` is ``Engine`` with
``async_scheduling`` on (the step itself, launched ahead or collected at once, is
core/engine/engine.py's one implementation)."""

from __future__ import annotations

from typing import Any

from tessellm.core.engine.engine import Engine, LaunchedStep

__all__ = ["LaunchedStep", "OverlappedEngine"]


class OverlappedEngine(Engine):
    """``Engine(..., async_scheduling=True)``."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs["async_scheduling"] = True
        super().__init__(*args, **kwargs)
