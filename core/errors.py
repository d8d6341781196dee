"""The exceptions tessellm raises for bad input. Each message is one line naming what was
wrong, the value given and what is allowed; the CLI prints it and exits with status 2."""

from __future__ import annotations


def validation_problems(exc, prefix: str = "") -> str:
    """One line from a pydantic ``ValidationError``: each bad field's location (after
    ``prefix``), what is wrong with it and the value given, joined by '; '."""
    return "; ".join(f"{prefix}{'.'.join(str(p) for p in err['loc'])}: {err['msg']} (got {err.get('input')!r})"
                     for err in exc.errors())


class TessellmError(Exception):
    """Base class of every error caused by the user's input (config, model, request)."""


class ConfigError(TessellmError, ValueError):
    """A pipeline config that cannot be read, validated or served."""


class PluginError(TessellmError):
    """A plugin that could not be loaded, two plugins that collide, or a plugin that broke its
    contract when called."""


class PluginCallError(PluginError):
    """A plugin broke its interface's contract when called: it raised, or returned the wrong
    shape or dtype. The message names the plugin and its module."""


class ContractError(PluginCallError):
    """A plugin broke a rule of its contract while the engine ran it (a backend that left its
    layer's new cache slots unwritten, a decoder that returned the wrong count or type of
    tokens, ...). The message names the plugin, the rule and the docs section."""


class PluginLoadError(PluginError):
    """A plugin failed to import, register, or targets another plugin-API version."""


class PluginConflictError(PluginError):
    """Two packages register a plugin of the same kind and name."""


class ModelLoadError(TessellmError):
    """A model that is missing, corrupt, or of an unsupported architecture."""


class InvalidRequestError(TessellmError, ValueError):
    """A request that is malformed (empty prompt, bad sampling parameters). ``field`` names
    the request field it is about, as pydantic's errors carry ``loc`` (``"prompt"``, a
    ``SamplingParams`` field such as ``"n"``, ``"logits_processors"``; dotted for a part of
    one: ``"extra_args.num_beams"``), or None when it is about no single field."""

    def __init__(self, message: str = "", *, field: str | None = None):
        super().__init__(message)
        self.field = field


class RequestRejectedError(InvalidRequestError):
    """A well-formed request that can never be served (longer than the context window or
    than the whole cache): rejected at admission instead of waiting forever."""


class LoraAdapterError(TessellmError, ValueError):
    """A LoRA adapter that cannot be loaded for this model (not PEFT's format, a target the
    pipeline does not serve, base shapes that differ, a rank above the maximum), or a
    request naming an adapter that is not registered."""
