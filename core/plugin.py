"""The base every plugin class derives from, and what it is shown when asked whether it
can serve a config."""

from __future__ import annotations

import typing
import warnings
from abc import ABC
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, model_validator

if TYPE_CHECKING:
    from tessellm.core.interfaces.kv import KVLayout
    from tessellm.core.interfaces.spec import ModelSpec

KINDS = ("attention", "cache", "scheduler", "decoding", "quant", "grammar", "model", "logits", "lora", "routing",
         "pooling")
"""The kinds of part, named as their plugins/ folders and (but for ``model``) their config
sections: the five of the forward and decode path, the grammar backends that constrain
outputs (structured outputs), which a pipeline may do without, and the model architectures
(config section ``architecture``; ``auto`` picks by the checkpoint's model_type), and the
logits processors (no config section: each request turns on the ones it uses), and the
LoRA kernels (section ``lora``, which also lists the adapters), and the routing policies of
a data-parallel router (no pipeline section: ``tessellm router --policy NAME`` picks one),
and the poolers of embedding and scoring pipelines (section ``pooling``; ``auto`` picks by
what the checkpoint's sentence-transformers files say, or none: the pipeline generates)."""

CONFIG_KINDS = tuple(kind for kind in KINDS if kind not in ("logits", "routing"))
"""The kinds a pipeline config chooses a plugin of (``PipelineConfig.section``); every logits
processor serves every pipeline, and each request names the ones it uses; a routing policy
serves a router of several pipelines, not one pipeline."""

OPTIONAL_KINDS = frozenset({"grammar", "lora", "pooling"})
"""Kinds a pipeline runs without when ``auto`` finds no plugin that can serve (requests that
need one are then refused, naming what to install)."""


def _numeric(annotation: Any) -> bool:
    """Whether a field of this type takes numbers and not booleans (int, float, Optional of them)."""
    if annotation in (int, float):
        return True
    args = typing.get_args(annotation)
    return bool(args) and bool not in args and any(a in (int, float) for a in args)


def reject_booleans_for_numbers(model: type[BaseModel], data: Any) -> Any:
    """A model-level "before" check: ``true`` given for a number field is an error, where
    pydantic would take it as 1 (``min_p: true`` meaning 1.0 is never what was meant)."""
    if isinstance(data, dict):
        for key, value in data.items():
            if not isinstance(value, bool):
                continue  # (model_fields is a slow lookup: a server validates every request's sampling)
            field = model.model_fields.get(key)
            if field is not None and _numeric(field.annotation):
                raise ValueError(f"{key}: expected a number, got {str(value).lower()} (a boolean)")
    return data


class PluginOptions(BaseModel):
    """Base of a plugin's options model. Unknown keys are an error, so a misspelled option
    never passes silently, and so is a boolean given for a number; subclasses give every
    field a default, bounds and a docstring."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        return reject_booleans_for_numbers(cls, data)


class SelectionContext:
    """What a plugin sees when asked whether it can serve a pipeline (``unsupported_reasons``).

    - ``device``, ``dtype``: the resolved torch device and compute dtype.
    - ``model``: the ``ModelSpec`` (head counts and dims, vocabulary, window, RoPE, ...).
    - ``options``: this plugin's validated options.
    - ``max_model_len``: the resolved context length.
    - ``kv_layout``: the chosen cache's ``KVLayout``; None while quant and cache resolve.
    - ``kv_extras``: the side data the configured attention backend needs the cache to keep
      (its ``kv_extras``, e.g. "key_bounds"); a cache puts those it keeps into its layout.
    - ``chosen``: the plugins already selected for earlier kinds, kind -> (class, options);
      selection goes quant, cache, attention, scheduler, decoding.
    - ``auto``: whether the plugin is being considered because the config says ``auto``
      (False: the config names it), e.g. to stay out of ``auto`` where it only runs slowly.
    - ``pooling``: what the checkpoint's own files say about pooling (a ``CheckpointPooling``:
      sentence-transformers' files, a classification head; plugin API 1.18), None where
      not read.

    ``config``, the whole ``PipelineConfig``, was part of plugin API 1.0; reading it still
    works and warns (DeprecationWarning): a plugin should need only the fields above.
    """

    def __init__(self, *, device: torch.device, dtype: torch.dtype, model: ModelSpec, options: PluginOptions,
                 max_model_len: int, kv_layout: KVLayout | None = None,
                 chosen: dict[str, tuple[type, PluginOptions]] | None = None, auto: bool = False,
                 config: Any = None, kv_extras: frozenset[str] = frozenset(), pooling: Any = None):
        self.device = device
        self.dtype = dtype
        self.model = model
        self.options = options
        self.max_model_len = max_model_len
        self.kv_layout = kv_layout
        self.kv_extras = frozenset(kv_extras)
        self.chosen = chosen if chosen is not None else {}
        self.auto = auto
        self.pooling = pooling
        self._config = config

    @property
    def config(self) -> Any:
        """Deprecated: the whole pipeline config (plugin API 1.0)."""
        warnings.warn("SelectionContext.config is deprecated since plugin API 1.1: read ctx.auto, ctx.device, "
                      "ctx.dtype, ctx.model, ctx.options, ctx.max_model_len, ctx.kv_layout or ctx.chosen",
                      DeprecationWarning, stacklevel=2)
        return self._config

    def __repr__(self) -> str:
        return (f"SelectionContext(device={self.device}, dtype={self.dtype}, options={self.options!r}, "
                f"max_model_len={self.max_model_len}, kv_layout={self.kv_layout}, auto={self.auto})")


class Plugin(ABC):
    """A concrete part of a pipeline, selected by ``kind`` and ``name``.

    Contract for subclasses:
    - ``name``: unique within its kind; it is what configs select.
    - ``api_version``: the plugin-API version the class was written for, a string ("1.0"). It
      must be set on the concrete class; a missing, non-string or incompatible version stops
      the plugin loading.
    - ``Options``: a ``PluginOptions`` subclass validating the config's ``options``; a field
      without a default stops the plugin loading.
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
