"""tessellm's plugin contract as pytest suites, one base class per kind. A plugin author
subclasses the kind's class, names the plugin, and runs pytest:

    from tessellm.testing.conformance import AttentionConformance

    class TestMyAttention(AttentionConformance):
        plugin = "mine"                 # an installed plugin's name (or plugin_class = MyAttention)
        options = {"block": 64}         # the options it is tested with

Every property is checked against a plain-torch reference on cases hypothesis generates; a
case the plugin declares unsupported (``unsupported_reasons``) is skipped with its reason.
The fixtures the suites use come with tessellm's pytest plugin (entry point ``pytest11``).
``tessellm plugins --check KIND:NAME`` runs a suite on one installed plugin."""

from typing import Any

from tessellm.testing.conformance.base import ConformanceSuite, property_settings

_SUITES = {"AttentionConformance": "attention", "CacheConformance": "cache", "SchedulerConformance": "scheduler",
           "DecodingConformance": "decoding", "QuantConformance": "quant", "GrammarConformance": "grammar",
           "ModelConformance": "model", "LogitsConformance": "logits",
           "LoraConformance": "lora", "RoutingConformance": "routing", "PoolingConformance": "pooling"}

__all__ = ["ConformanceSuite", "property_settings", *_SUITES]


def __getattr__(name: str) -> Any:
    """Each kind's suite, imported when first asked for."""
    if name in _SUITES:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_SUITES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
