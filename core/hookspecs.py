"""Hook specifications: the extension points a plugin package implements.

A plugin module implements one or more of these with ``@tessellm.hookimpl`` and is named in
the ``tessellm`` entry-point group of its package. Each hook receives a ``register``
callback and calls it with plugin classes; it returns nothing, so the core owns the registry
(the register-callback pattern of simonw/llm). Every hook is called once per plugin module
when the registry loads, in no guaranteed order.

    import tessellm
    from tessellm.core.interfaces.attention import AttentionBackend

    class MyAttention(AttentionBackend):
        name = "mine"
        api_version = "1.0"
        ...

    @tessellm.hookimpl
    def register_attention(register):
        register(MyAttention)
"""

from __future__ import annotations

from typing import Callable

import pluggy

PROJECT = "tessellm"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[[type], None]


# ---------------------------------------------------------------- one hook per plugin kind


@hookspec
def register_attention(register: Register) -> None:
    """Register attention backends: subclasses of ``tessellm.AttentionBackend``."""


@hookspec
def register_cache(register: Register) -> None:
    """Register KV-cache managers: subclasses of ``tessellm.CacheManager``."""


@hookspec
def register_scheduler(register: Register) -> None:
    """Register schedulers: subclasses of ``tessellm.Scheduler``."""


@hookspec
def register_decoding(register: Register) -> None:
    """Register decoders: subclasses of ``tessellm.Decoder``."""


@hookspec
def register_quant(register: Register) -> None:
    """Register quantizers: subclasses of ``tessellm.Quantizer``."""


@hookspec
def register_grammar(register: Register) -> None:
    """Register grammar backends (structured outputs): subclasses of ``tessellm.GrammarBackend``."""


@hookspec
def register_logits(register: Register) -> None:
    """Register logits processors (per-request penalties, bans, masks): subclasses of
    ``tessellm.LogitsProcessor``."""


@hookspec
def register_lora(register: Register) -> None:
    """Register LoRA kernels (many adapters applied to one batch's rows): subclasses of
    ``tessellm.LoraKernel``."""


@hookspec
def register_model(register: Register) -> None:
    """Register model architectures: subclasses of ``tessellm.ModelArchitecture``, each
    declaring the Hugging Face ``model_type``s it builds."""


@hookspec
def register_pooling(register: Register) -> None:
    """Register poolers (the step after the model in an embedding or scoring pipeline: hidden
    states to an embedding or scores): subclasses of ``tessellm.Pooler``."""


@hookspec
def register_routing(register: Register) -> None:
    """Register routing policies (which data-parallel replica serves a request): subclasses of
    ``tessellm.RoutingPolicy``; ``tessellm router --policy NAME`` selects one."""
