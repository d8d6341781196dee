"""tessellm: a plugin-based LLM inference engine.

Everything a script or a plugin author needs is importable from here, lazily (importing
``tessellm`` to reach ``hookimpl`` loads neither torch nor a model):

    import tessellm

    class MyAttention(tessellm.AttentionBackend):
        name = "mine"
        api_version = "1.1"
        ...

    @tessellm.hookimpl
    def register_attention(register):
        register(MyAttention)

Scripts use ``tessellm.LLM`` (and ``Pipeline``, ``PipelineConfig``, ``SamplingParams``).
These names are the plugin API, versioned as ``PLUGIN_API_VERSION``; the modules behind them
may move between releases.
"""

from __future__ import annotations

from typing import Any

from tessellm.core import compat as _compat
from tessellm.core.hookspecs import hookimpl
from tessellm.core.version import PLUGIN_API_VERSION, __version__

_compat.install()  # the import paths of tessellm 0.1, for plugins written against them

_INTERFACES = "tessellm.core.interfaces"
_LAZY = {
    # scripts
    "LLM": "tessellm.core.engine.llm",
    "RequestOutput": "tessellm.core.engine.llm",
    "CompletionOutput": "tessellm.core.engine.llm",
    "EmbeddingOutput": "tessellm.core.engine.embed",
    "ScoreOutput": "tessellm.core.engine.embed",
    "Pipeline": "tessellm.core.engine.pipeline",
    "PipelineConfig": "tessellm.core.config",
    "load_config": "tessellm.core.config",
    # the plugin base, options and selection
    "Plugin": "tessellm.core.plugin",
    "PluginOptions": "tessellm.core.plugin",
    "SelectionContext": "tessellm.core.plugin",
    "KINDS": "tessellm.core.plugin",
    "PluginRegistry": "tessellm.core.registry",
    "LoadFailure": "tessellm.core.registry",
    "get_registry": "tessellm.core.registry",
    "resolve": "tessellm.core.resolve",
    "ModelSpec": "tessellm.core.model.spec",
    "LayerAttention": "tessellm.core.model.spec",
    "LAYER_FEATURES": "tessellm.core.model.spec",
    # the interfaces
    "AttentionBackend": f"{_INTERFACES}.attention",
    "LatentProjection": f"{_INTERFACES}.attention",
    "CacheManager": f"{_INTERFACES}.cache",
    "CacheSpec": f"{_INTERFACES}.cache",
    "PrefixCacheStats": f"{_INTERFACES}.cache",
    "Scheduler": f"{_INTERFACES}.scheduler",
    "QueueScheduler": f"{_INTERFACES}.scheduler",
    "SchedulerLimits": f"{_INTERFACES}.scheduler",
    "Decoder": f"{_INTERFACES}.decoder",
    "DecoderContext": f"{_INTERFACES}.decoder",
    "slot_logits": f"{_INTERFACES}.decoder",
    "DECODER_FIELDS": f"{_INTERFACES}.decoder",
    "Quantizer": f"{_INTERFACES}.quantizer",
    "CalibrationContext": f"{_INTERFACES}.quantizer",
    "GrammarBackend": f"{_INTERFACES}.grammar",
    "GrammarMatcher": f"{_INTERFACES}.grammar",
    "GrammarSpec": f"{_INTERFACES}.grammar",
    "LogitsProcessor": f"{_INTERFACES}.logits",
    "ProcessorRows": f"{_INTERFACES}.logits",
    "ProcessorContext": f"{_INTERFACES}.logits",
    "to_device": f"{_INTERFACES}.logits",
    "LogitsProcessorRequest": f"{_INTERFACES}.sequence",
    "LoraKernel": f"{_INTERFACES}.lora",
    "LoraMapping": f"{_INTERFACES}.lora",
    "LoraWeights": f"{_INTERFACES}.lora",
    "ModelArchitecture": f"{_INTERFACES}.model",
    "RoutingPolicy": f"{_INTERFACES}.routing",
    "RouteRequest": f"{_INTERFACES}.routing",
    "ReplicaState": f"{_INTERFACES}.routing",
    "RoutingContext": f"{_INTERFACES}.routing",
    "least_loaded": f"{_INTERFACES}.routing",
    "Pooler": f"{_INTERFACES}.pooling",
    "PoolingParams": f"{_INTERFACES}.pooling",
    "PoolingContext": f"{_INTERFACES}.pooling",
    "CheckpointPooling": f"{_INTERFACES}.pooling",
    "DenseLayer": f"{_INTERFACES}.pooling",
    "MoESpec": "tessellm.core.model.spec",
    "MLASpec": "tessellm.core.model.spec",
    "decoder_spec": "tessellm.core.model.spec",
    # a model plugin's building blocks
    "DecoderForCausalLM": "tessellm.core.model.decoder",
    "DecoderLayer": "tessellm.core.model.decoder",
    "MLP": "tessellm.core.model.decoder",
    "RMSNorm": "tessellm.core.model.decoder",
    "LayerNorm": "tessellm.core.model.decoder",
    "make_norm": "tessellm.core.model.decoder",
    "RotaryEmbedding": "tessellm.core.model.decoder",
    "Attention": "tessellm.core.model.decoder",
    "apply_rotary": "tessellm.core.model.decoder",
    "MoE": "tessellm.core.model.moe",
    "LatentAttention": "tessellm.core.model.mla",
    "EncoderModel": "tessellm.core.model.encoder",
    # the data they exchange
    "BatchMetadata": f"{_INTERFACES}.batch",
    "SampleSlot": f"{_INTERFACES}.batch",
    "ScheduledSeq": f"{_INTERFACES}.batch",
    "SchedulerOutput": f"{_INTERFACES}.batch",
    "KVLayout": f"{_INTERFACES}.kv",
    "KVStorage": f"{_INTERFACES}.kv",
    "DenseKVStorage": f"{_INTERFACES}.kv",
    "LatentKVStorage": f"{_INTERFACES}.kv",
    "dense_storage": f"{_INTERFACES}.kv",
    "Sequence": f"{_INTERFACES}.sequence",
    "SequenceStatus": f"{_INTERFACES}.sequence",
    "SamplingParams": f"{_INTERFACES}.sequence",
    "FinishReason": f"{_INTERFACES}.sequence",
    "TokenLogprob": f"{_INTERFACES}.sequence",
    "ImageInput": f"{_INTERFACES}.multimodal",
    "MultimodalPrompt": f"{_INTERFACES}.multimodal",
    "MultimodalBatch": f"{_INTERFACES}.multimodal",
    "ProcessedPrompt": f"{_INTERFACES}.multimodal",
    "ImageProcessor": f"{_INTERFACES}.multimodal",
    "VisionModule": f"{_INTERFACES}.multimodal",
    "images_key": f"{_INTERFACES}.multimodal",
    "content_key": f"{_INTERFACES}.multimodal",
    "cut_chunk": f"{_INTERFACES}.sequence",
    "VisionSpec": f"{_INTERFACES}.spec",
    "EngineStats": "tessellm.core.engine.stats",
    # errors
    "TessellmError": "tessellm.core.errors",
    "ConfigError": "tessellm.core.errors",
    "PluginError": "tessellm.core.errors",
    "PluginLoadError": "tessellm.core.errors",
    "PluginCallError": "tessellm.core.errors",
    "ContractError": "tessellm.core.errors",
    "PluginConflictError": "tessellm.core.errors",
    "ModelLoadError": "tessellm.core.errors",
    "InvalidRequestError": "tessellm.core.errors",
    "RequestRejectedError": "tessellm.core.errors",
}

__all__ = ["hookimpl", "PLUGIN_API_VERSION", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'tessellm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
