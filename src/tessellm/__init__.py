"""tessellm: a plugin-based LLM inference engine.

Plugin authors need only ``tessellm.hookimpl``; scripts use ``tessellm.LLM`` and
``tessellm.Pipeline`` (imported lazily, so loading a plugin module stays cheap).
"""

from __future__ import annotations

from typing import Any

from tessellm.core.hookspecs import hookimpl
from tessellm.core.version import PLUGIN_API_VERSION, __version__

__all__ = ["LLM", "Pipeline", "PipelineConfig", "SamplingParams", "hookimpl", "PLUGIN_API_VERSION", "__version__"]

_LAZY = {
    "LLM": "tessellm.core.llm",
    "Pipeline": "tessellm.core.llm",
    "PipelineConfig": "tessellm.core.config",
    "SamplingParams": "tessellm.core.sequence",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tessellm' has no attribute {name!r}")
