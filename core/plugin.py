"""The base every plugin class derives from, and what it is shown when asked whether it
can serve a config."""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from .cache import KVLayout
    from .config import PipelineConfig
    from .model_spec import ModelSpec

KINDS = ("attention", "cache", "scheduler", "decoding", "quant")
"""The five kinds of part, named as their config sections and plugins/ folders."""


class PluginOptions(BaseModel):
    """Base of a plugin's options model. Unknown keys are an error, so a misspelled option
    never passes silently; subclasses give every field a default, bounds and a docstring."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


@dataclass
class SelectionContext:
    """What a plugin sees when asked whether it can serve a pipeline.

    ``chosen`` holds the plugins already selected for the other kinds (kind -> (class,
    options)); selection goes quant, cache, attention, scheduler, decoding, so an attention
    backend sees the cache's ``kv_layout``.
    """

    config: PipelineConfig
    device: torch.device
    dtype: torch.dtype
    model: ModelSpec
    options: PluginOptions
    max_model_len: int
    kv_layout: KVLayout | None = None
    chosen: dict[str, tuple[type, PluginOptions]] = field(default_factory=dict)


class Plugin(ABC):
    """A concrete part of a pipeline, selected by ``kind`` and ``name``.

    Contract for subclasses:
    - ``name``: unique within its kind; it is what configs select.
    - ``api_version``: the plugin-API version the class was written for ("1.0"). It must be
      set on the concrete class; a missing or incompatible version stops the plugin loading.
    - ``Options``: a ``PluginOptions`` subclass validating the config's ``options``.
    - ``auto_priority``: rank when the config says ``auto`` (higher first); None means the
      plugin is only used when named.
    - ``unsupported_reasons(ctx)``: every reason it cannot serve ``ctx`` (empty if it can).
    """

    kind: ClassVar[str]
    name: ClassVar[str]
    description: ClassVar[str] = ""
    api_version: ClassVar[str]
    Options: ClassVar[type[PluginOptions]] = PluginOptions
    auto_priority: ClassVar[int | None] = None
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    """Device types the plugin runs on; checked by the default ``unsupported_reasons``."""

    @classmethod
    def unsupported_reasons(cls, ctx: SelectionContext) -> list[str]:
        """Reasons this plugin cannot serve the pipeline in ``ctx``; [] when it can."""
        if ctx.device.type not in cls.devices:
            return [f"runs on {', '.join(sorted(cls.devices))}, not on device {ctx.device.type!r}"]
        return []

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """A JSON-able summary for ``tessellm plugins``."""
        return {
            "kind": cls.kind,
            "name": cls.name,
            "description": cls.description or (cls.__doc__ or "").strip().split("\n")[0],
            "api_version": getattr(cls, "api_version", None),
            "auto_priority": cls.auto_priority,
            "devices": sorted(cls.devices),
            "options": cls.Options.model_json_schema().get("properties", {}),
        }
