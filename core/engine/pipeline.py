"""``Pipeline``: a config resolved against the plugin registry, the model loaded, every part
built and wired to the engine, kernels warmed up and decode graphs captured."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import threading
import warnings
from pathlib import Path
from typing import Any, Sequence as Layers

import torch

from tessellm.core.config import PipelineConfig, PluginSection, apply_overrides, config_from_dict, load_config
from tessellm.core.engine.batch_builder import build_batch
from tessellm.core.engine.engine import Engine
from tessellm.core.engine.grammar import GrammarSession
from tessellm.core.engine.lora import LoraAdapters
from tessellm.core.engine.outputs import StopRule
from tessellm.core.engine.pooling import PoolingEngine
from tessellm.core.engine.scoring import score_tokens
from tessellm.core.engine.warm_up import scratch_batch, warm_up
from tessellm.core.errors import ConfigError
from tessellm.core.interfaces.batch import ScheduledSeq
from tessellm.core.interfaces.cache import CacheSpec
from tessellm.core.interfaces.decoder import Decoder, DecoderContext
from tessellm.core.interfaces.pooling import PoolingContext
from tessellm.core.interfaces.logits import LogitsProcessor, ProcessorContext
from tessellm.core.interfaces.quantizer import CalibrationContext, Quantizer
from tessellm.core.interfaces.scheduler import SchedulerLimits
from tessellm.core.model.kernel_builds import build_log
from tessellm.core.model.loader import (build_model, load_hf_config, load_state_dict, load_tokenizer, quantized,
                                       weights_fingerprint)
from tessellm.core.model.lora import AdapterReader, LoraState, wrap_targets
from tessellm.core.model.runner import ModelRunner
from tessellm.core.model.sentence_transformers import read_checkpoint_pooling
from tessellm.core.model.spec import quantization_config, quantized_checkpoint_readers
from tessellm.core.parallel.group import Ranks, TensorParallel, init_parallel
from tessellm.core.parallel.shard import load_shard, local_spec, plan_shard, tensor_rule
from tessellm.core.parallel.stages import plan_stages
from tessellm.core.parallel.sync import RankSync, follow
from tessellm.core.registry import PluginRegistry, get_registry
from tessellm.core.version import __version__
from tessellm.core.resolve import ResolvedPipeline, model_dir_for, precheck, resolve, resolve_device

logger = logging.getLogger(__name__)


class Pipeline:
    """A config resolved against the registry, with the model loaded and every part built.

    Parts: ``architecture`` (the model plugin that built ``model``), ``model`` (the module), ``cache``, ``attention``, ``scheduler``, ``decoder``,
    ``grammar`` (the grammar backend for structured outputs, built on first use; None where
    none can serve), the
    ``runner`` that runs the model, and the ``engine`` that steps requests (launching steps
    ahead when async scheduling is on; a ``PoolingEngine`` where a ``pooler`` was chosen,
    which embeds or scores instead of generating: ``task``). ``resolved`` says which plugin serves
    each kind and why (``resolved.summary()``).
    """

    def __init__(self, config: PipelineConfig, registry: PluginRegistry | None = None):
        self.config = config
        self.registry = registry or get_registry()
        precheck(config, self.registry)  # fail on a config typo before converting or loading a model
        self.ranks: Ranks | None = None  # a distributed run's (tensor and pipeline parallel)
        if config.parallel.tensor > 1 or config.parallel.pipeline > 1:
            config = self.config = self._join_ranks(config)
        self.tp: TensorParallel | None = self.ranks.tp if self.ranks else None
        self.stage = self.ranks.stage if self.ranks else None
        self.model_dir = self._model_dir(config)
        hf_config = load_hf_config(self.model_dir, config.trust_remote_code)
        arch = config.architecture
        self.architecture, self.spec = self.registry.model_for(hf_config, arch.name, arch.options)
        self.checkpoint_pooling = read_checkpoint_pooling(self.model_dir, hf_config, self.spec.bidirectional)
        self.prequantized = quantization_config(hf_config)
        if self.prequantized is not None:
            config = self.config = self._quant_for_checkpoint(config, self.prequantized)
        # every part is built from this rank's share of the model (the whole of it on one rank)
        self.shard = plan_shard(self.spec, self.tp.size, self.tp.rank) if self.tp else None
        spec = self.local_spec = local_spec(self.spec, self.shard) if self.shard else self.spec
        self.resolved: ResolvedPipeline = resolve(config, self.registry, spec, pooling=self.checkpoint_pooling)
        if self.stage:
            self._place_stage(config)
        r, c = self.resolved, self.resolved.choices
        pooling = c.get("pooling")
        self._check_pooling(pooling)
        if pooling is not None:
            self._pooling_step_budget(config)
        # a pooled prompt generates nothing: it may fill the context window, so the scheduler and
        # cache (which keep room for one generated token) are given one token more
        limit = r.max_model_len + (1 if pooling else 0)
        self.tokenizer = load_tokenizer(self.model_dir, config.trust_remote_code)
        self.tokenizer_lock = threading.Lock()  # fast tokenizers refuse two threads at once (a server's)
        quantizer = c["quant"].cls(c["quant"].options, r.device, r.dtype)
        calibrates = type(quantizer).calibrate is not Quantizer.calibrate and self.prequantized is None
        quantized = None if self.prequantized is None else (type(quantizer), self.prequantized)
        keep = self._stage_holds if self.stage else None
        state = (load_shard(self.model_dir, self.spec, self.shard, self.architecture, quantized, keep) if self.shard
                 else load_state_dict(self.model_dir, keep=keep))
        self.model = build_model(spec, state, r.device, r.dtype, None if calibrates else quantizer, self.architecture,
                                 prequantized=self.prequantized, stage=self.stage,
                                 drop_lm_head=pooling is not None and not pooling.cls.uses_lm_head)
        del state
        if self.tp:
            self.model.set_tensor_parallel(self.tp)
        shape = spec.kv_shape
        windows = tuple(spec.attention_of(i).sliding_window for i in range(spec.num_layers))
        cache_spec = CacheSpec(spec.num_layers, shape.num_heads, shape.head_dim, r.dtype, r.device,
                               limit, shape.format, windows if any(windows) else (),
                               self._kv_fingerprint(), tuple(range(*self.stage.layers)) if self.stage else ())
        self.cache = c["cache"].cls(c["cache"].options, cache_spec, r.kv_layout)
        if self.ranks:
            self.cache = self._cache_agreed_across_ranks(c["cache"], cache_spec, r.kv_layout)
        self.attention = c["attention"].cls(c["attention"].options, spec, r.device, r.dtype)
        self.decoder = c["decoding"].cls(c["decoding"].options, spec, r.device)
        limits = SchedulerLimits(limit, self.decoder.num_lookahead_tokens)
        self.scheduler = c["scheduler"].cls(c["scheduler"].options, self.cache, limits)
        step = self.scheduler.max_step_tokens
        self.cache.limit_step_tokens(None if step is None else step + limits.num_lookahead_tokens)
        self.runner = ModelRunner(self.model, spec, self.attention, self.cache, r.device)
        if self.stage:
            self.runner.microbatches = config.parallel.microbatches or 2 * self.stage.size
            self.runner.microbatch_min_tokens = config.parallel.microbatch_min_tokens
        if calibrates:
            self._calibrate_and_quantize(quantizer)
        self.lora = self._build_lora() if config.lora.active else None
        if self.runner.compiles_kernels():
            self._warm_up()
        if config.cpu_compile and r.device.type == "cpu" and self.ranks is None and not pooling:
            self._compile_decode()
        if config.cuda_graphs and self.runner.graphs_unsupported() is None and self.ranks is None and not pooling:
            self._capture_graphs()  # decode graphs: a pooling pipeline only prefills
        self.async_scheduling = r.async_scheduling and self.ranks is None and not pooling
        self.stop = StopRule(self._eos_ids(hf_config), limit, decode_text=self._decode_text)
        self.pooler = self._build_pooler(pooling) if pooling else None
        """The pooling plugin of an embedding or scoring pipeline (None: the pipeline generates)."""
        self.engine = self._build_engine(config, c.get("grammar"))
        self._attach_decoder()
        if self.ranks and not self.ranks.world.is_leader:  # a follower serves rank 0 until it stops, then exits
            follow(self.engine, self.engine.sync)
            raise SystemExit(0)

    def _build_engine(self, config: PipelineConfig, grammar: Any) -> Engine:
        """The engine over the built parts: a ``PoolingEngine`` where a pooler was chosen, else
        an ``Engine`` (with the config's image limits)."""
        spec, r = self.local_spec, self.resolved
        build = (lambda: grammar.cls(grammar.options, self.tokenizer, spec.vocab_size)) if grammar else None
        if self.pooler:
            extra = {"pooler": self.pooler, "max_input_len": r.max_model_len}
        else:
            extra = {"max_images_per_prompt": config.images.max_per_prompt,
                     "encoder_cache_tokens": config.images.encoder_cache_tokens}
        return (PoolingEngine if self.pooler else Engine)(
            self.runner, self.cache, self.scheduler, self.decoder, stop=self.stop, vocab_size=self.spec.vocab_size,
            seed=config.seed, sync=RankSync(self.ranks.world) if self.ranks else None,
            grammar=GrammarSession(build, self.decoder.num_lookahead_tokens), processors=self._logits_processors(),
            lora=self.lora, async_scheduling=self.async_scheduling, **extra)

    def close(self) -> None:
        """Finish what outlives the pipeline: the cache's (a disk tier's queued writes)."""
        self.cache.close()

    @property
    def task(self) -> str:
        """What the pipeline serves: "generate", or its pooler's task ("embed", "score")."""
        return self.pooler.task if self.pooler is not None else "generate"

    def _check_pooling(self, pooling: Any) -> None:
        """A pipeline without a pooler generates: refused for an encoder; one with a pooler runs
        on one rank (its engine is not one tensor- or pipeline-parallel ranks follow)."""
        said = self.checkpoint_pooling
        if pooling is None and said.mode is not None:  # an embedding model must not quietly become a generator
            served = ", ".join(f"{e.name} ({', '.join(sorted(e.cls.modes)) or 'by name only'})"
                               for e in self.registry.entries("pooling"))
            raise ConfigError(f"pooling.name: the checkpoint pools with {said.mode!r} ({said.source}), which no "
                              f"installed pooler implements; the poolers (and the modes they take): {served}; "
                              f"name one to pool otherwise")
        if pooling is None and self.spec.bidirectional:
            raise ConfigError(f"pooling.name: {self.spec.model_type!r} attends both ways (an encoder): it embeds or "
                              f"scores, it cannot generate, and no pooler serves it (the checkpoint's pooling: "
                              f"{self.checkpoint_pooling.source}); name one, e.g. pooling.name=cls")
        if pooling is not None and self.ranks is not None:
            raise ConfigError("pooling: embedding and scoring pipelines run on one rank; set parallel.tensor=1 and "
                              "parallel.pipeline=1")

    POOLING_STEP_TOKENS = 8192
    """A pooling pipeline's default step budget (tokens), where its scheduler has one the
    config leaves unset: it prefills only, so no decode waits behind a large step, and larger
    steps are fewer, larger products (on a 2-core CPU a MiniLM-shaped encoder embeds about 1.7x
    faster in steps of 4096 tokens than of 1024; docs/benchmarks.md)."""
    POOLING_STEP_SEQS = 256
    """A pooling pipeline's default sequences per step (short texts fill a step by count)."""

    def _pooling_step_budget(self, config: PipelineConfig) -> None:
        """Larger default steps for a pooling pipeline, and one that holds an encoder's longest
        prompt (which runs whole, in one step); a budget the config sets is kept, and an
        encoder's prompt longer than it is refused naming it."""
        choice = self.resolved.choices["scheduler"]
        fields, given = type(choice.options).model_fields, config.scheduler.options
        update = {}
        if "max_num_batched_tokens" in fields and "max_num_batched_tokens" not in given:
            update["max_num_batched_tokens"] = max(self.POOLING_STEP_TOKENS, self.resolved.max_model_len,
                                                   choice.options.max_num_batched_tokens)
        if "max_num_seqs" in fields and "max_num_seqs" not in given:
            update["max_num_seqs"] = max(self.POOLING_STEP_SEQS, choice.options.max_num_seqs)
        if update:
            logger.info("scheduler.options: %s for a pooling pipeline (prefills only)", update)
            choice.options = choice.options.model_copy(update=update)

    def _build_pooler(self, choice: Any) -> Any:
        """The chosen pooler, given the model's heads it may read and the checkpoint's Dense
        modules on the pipeline's device."""
        r, model, said = self.resolved, self.model, self.checkpoint_pooling
        dense = tuple(dataclasses.replace(d, weight=d.weight.to(r.device),
                                          bias=None if d.bias is None else d.bias.to(r.device)) for d in said.dense)

        def token_id(text: str) -> int | None:
            with self.tokenizer_lock:
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            return ids[0] if len(ids) == 1 else None

        ctx = PoolingContext(self.spec, dataclasses.replace(said, dense=dense), r.device, r.dtype,
                             lm_head_rows=getattr(model, "lm_head_rows", None) if choice.cls.uses_lm_head else None,
                             classify=model.classify if getattr(model, "has_classifier", False) else None,
                             classify_rows=getattr(model, "classify_rows", "first"), token_id=token_id)
        return choice.cls(choice.options, ctx)

    @functools.cached_property
    def image_processor(self) -> Any:
        """The model's ``ImageProcessor`` (transformers' processor of the checkpoint), built on
        first use; None for a model that takes no images."""
        if self.spec.vision is None:
            return None
        return self.architecture.image_processor(self.model_dir, self.spec.vision.hf_config)

    def _kv_fingerprint(self) -> str:
        """What K/V values depend on besides the tokens (``CacheSpec.fingerprint``): the
        checkpoint, dtype, architecture, quantization, attention backend, rank and version."""
        c = self.resolved.choices
        parts = [weights_fingerprint(self.model_dir), str(self.resolved.dtype), self.architecture.name,
                 __version__, f"tp{self.tp.rank}/{self.tp.size}" if self.tp else "tp0/1"]
        if self.stage:
            parts.append(f"pp{self.stage.index}/{self.stage.size}")
        for kind in ("quant", "attention"):
            parts.append(f"{kind}={c[kind].cls.name}:{c[kind].options.model_dump_json()}")
        return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).hexdigest()

    def _build_lora(self) -> LoraAdapters:
        """Wrap the target projections with ``max_loras`` slots of ``max_rank`` and register
        the config's adapters (``LoraAdapterError`` for one this model cannot serve)."""
        cfg, r = self.config.lora, self.resolved
        if self.spec.mla is not None:
            raise ConfigError("lora: adapters on multi-head latent attention (DeepSeek's MLA) are not supported: its "
                              "projections are absorbed into the attention; serve this model without lora")
        choice = r.choices.get("lora")
        if choice is None:
            raise ConfigError("lora: adapters are on, but no installed LoRA kernel (plugin kind lora) can serve this "
                              "pipeline; `tessellm plugins` lists them with their reasons")
        kernel = choice.cls(choice.options, r.device, r.dtype)
        state = LoraState(kernel, cfg.max_loras)
        targets = tuple(cfg.target_modules)
        layers = wrap_targets(self.model, targets, cfg.max_loras, cfg.max_rank, state, r.device, r.dtype)
        if not layers:
            raise ConfigError(f"lora.target_modules {list(targets)}: no decoder-layer projection of this "
                              f"{self.spec.model_type} model has such a name")
        rule = None
        if self.shard is not None:  # adapters are sliced as the layers they adapt
            rule = functools.partial(tensor_rule, spec=self.spec, shard=self.shard, architecture=self.architecture)
        held = functools.partial(self.stage.holds, tied_embedding=False) if self.stage else None
        reader = AdapterReader(layers, cfg.max_rank, targets, self.architecture.checkpoint_name, rule, held)
        adapters = LoraAdapters(layers, reader, cfg.max_loras)
        for name, path in cfg.adapters.items():
            adapters.register(name, path)
        self.runner.lora = state
        return adapters

    def _logits_processors(self) -> list[LogitsProcessor]:
        """One instance of every registered logits processor (a request turns on the ones it
        uses); each keeps nothing until a request does."""
        def encode(text: str) -> list[int]:
            with self.tokenizer_lock:
                return self.tokenizer.encode(text, add_special_tokens=False)

        ctx = ProcessorContext(self.spec.vocab_size, self.resolved.device, self.stop.eos_token_ids, encode,
                               self.resolved.max_model_len)
        return [entry.cls(entry.cls.Options(), ctx) for entry in self.registry.entries("logits")]

    def _decode_text(self, ids: list[int]) -> str:
        """The stop rule's decoding, holding ``tokenizer_lock``: a server's threads share the tokenizer."""
        with self.tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def grammar(self) -> Any:
        """The grammar backend (built now if no structured request has built it yet), or None."""
        return self.engine.grammar.backend

    def _quant_for_checkpoint(self, config: PipelineConfig, quant: dict[str, Any]) -> PipelineConfig:
        """The config with the quant plugin that loads this pre-quantized checkpoint: under
        ``auto`` the first that reads it; a named one must read it."""
        readers, reasons = quantized_checkpoint_readers(quant)  # none: load_spec refused it already
        method = quant.get("quant_method", "?")
        if config.quant.name == "auto":
            config = config.model_copy(update={"quant": PluginSection(name=readers[0], options=config.quant.options)})
        elif config.quant.name not in readers:
            why = next((r for r in reasons if r.startswith(f"{config.quant.name}: ")), f"{config.quant.name}: not installed")
            raise ConfigError(f"quant.name {config.quant.name!r} cannot load this {method!r} checkpoint ({why}); "
                              f"quant plugins that can: {', '.join(readers)} (or quant.name auto)")
        return config

    def _join_ranks(self, config: PipelineConfig) -> PipelineConfig:
        """Join the distributed run (tensor and pipeline parallel); on CUDA each rank
        computes on its local GPU."""
        device = resolve_device(config.device)
        p = config.parallel
        self.ranks = init_parallel(p.tensor, p.pipeline, device, p.timeout_s)
        if self.ranks.device.type == "cuda":
            config = config.model_copy(update={"device": str(self.ranks.device)})
        if config.async_scheduling or (config.cuda_graphs and self.ranks.device.type == "cuda"):
            logger.info("parallel: steps run synchronously and eagerly (no async scheduling, no CUDA graphs) "
                        "across ranks")
        return config

    def _place_stage(self, config: PipelineConfig) -> None:
        """This rank's pipeline stage: its layers, the dtypes it exchanges, and a cache that
        counts blocks as every other stage's does."""
        stage, r = self.stage, self.resolved
        stage.layers = plan_stages(self.spec.num_layers, stage.size, config.parallel.stage_layers)[stage.index]
        stage.dtype = r.dtype
        stage.logits_dtype = torch.float64 if r.dtype == torch.float64 else torch.float32
        choice = r.choices["cache"]
        sliding = any(self.spec.attention_of(i).sliding_window is not None for i in range(self.spec.num_layers))
        if getattr(choice.options, "free_out_of_window", False) and sliding:
            # stages holding different mixes of sliding and full layers would count blocks
            # differently and their schedulers part ways; every stage keeps them instead
            logger.info("pipeline parallel: cache %r keeps out-of-window blocks (free_out_of_window off) so that "
                        "every stage counts blocks alike", choice.entry.name)
            choice.options = choice.options.model_copy(update={"free_out_of_window": False})

    def _stage_holds(self, name: str) -> bool:
        """Whether this pipeline stage reads checkpoint tensor ``name``."""
        mapped = self.architecture.checkpoint_name(name) or name
        return self.stage.holds(mapped, self.spec.tie_word_embeddings)

    def _model_dir(self, config: PipelineConfig) -> Path:
        """The model's folder; in a distributed run rank 0 converts a GGUF file first and the
        others wait, so no two ranks convert it at once."""
        if self.ranks is None:
            return model_dir_for(config)
        world = self.ranks.world
        folder = model_dir_for(config) if world.is_leader else None
        world.barrier("waiting for rank 0 to find the model")
        return folder or model_dir_for(config)

    def _cache_agreed_across_ranks(self, choice: Any, cache_spec: CacheSpec, layout: Any) -> Any:
        """Every rank's scheduler must decide over the same number of cache blocks, but each
        rank sizes its cache from its own memory and its own (possibly uneven) share of the
        heads. A cache with a ``num_blocks`` option is rebuilt on the ranks above the
        smallest count with that count; any other cache must agree by itself."""
        if self.cache.prefix_cache_stats().tiers:
            self.cache.close()
            raise ConfigError(f"tensor and pipeline parallel: cache {choice.entry.name!r} keeps prefix blocks in "
                              f"tiers below the device (host memory, disk), which each rank fills on its own, while "
                              f"the ranks must agree on every prefix hit; turn the tiers off (host_tier_bytes 0, no "
                              f"disk_tier_path) or serve on one rank")
        counts = self.ranks.world.gather_objects(self.cache.num_blocks, "comparing KV cache sizes")
        fewest = min(counts)
        if self.cache.num_blocks == fewest:
            return self.cache
        if "num_blocks" not in type(choice.options).model_fields:
            raise ConfigError(f"tensor parallel: the ranks' {choice.entry.name!r} caches hold different numbers "
                              f"of blocks {counts}, and the cache has no num_blocks option to make them agree")
        del self.cache
        options = choice.options.model_copy(update={"num_blocks": fewest})
        return choice.cls(options, cache_spec, layout)

    def _calibrate_and_quantize(self, quantizer: Quantizer) -> None:
        """Let the quantizer observe the float model through the runner, then apply it."""
        limit = self.resolved.max_model_len
        ctx = CalibrationContext(self.tokenizer, lambda ids: score_tokens(self.runner, self.cache, ids, limit), limit)
        with torch.inference_mode():
            quantizer.calibrate(self.model, ctx)
        self.model = self.runner.model = quantized(self.model, quantizer)

    def _compile_decode(self) -> None:
        """``cpu_compile``: compile one-stream decode steps and choose between compiled and
        eager now, on a dummy step in the cache's scratch block (without one: at the first
        such step of a request)."""
        self.runner.compile_decode()
        scratch = self.cache.scratch_block
        if scratch is not None:  # a context of 2: 1 would be specialised, the stream never meets it
            self.runner.forward(scratch_batch([(1, 2)], scratch, self.cache.layout.block_size, self.runner.device))

    def _warm_up(self) -> None:
        """Compile every kernel variant now, not inside a request's step."""
        build_log.install()
        tokens = self.scheduler.max_step_tokens or self.resolved.max_model_len
        try:
            pooled = {"hidden_states": True} if "pooling" in self.resolved.choices else {}  # no LM head to run
            warm_up(self.runner, tokens, self.resolved.max_model_len, **pooled)
        except torch.cuda.OutOfMemoryError as exc:  # a real step that size would fail too: say so now
            raise ConfigError(
                f"start-up warm-up ran out of GPU memory running one step of {tokens} tokens (the "
                f"scheduler's token budget) beside the KV cache; lower scheduler.options."
                f"max_num_batched_tokens or cache.options.gpu_memory_fraction ({exc})") from exc

    def _capture_graphs(self) -> None:
        limit = self.config.cuda_graph_max_batch
        try:
            # no decode batch outgrows the scheduler's limit: capturing larger ones wastes memory
            self.runner.capture_graphs(min(limit, self.scheduler.max_step_seqs or limit), self.resolved.max_model_len)
        except torch.cuda.OutOfMemoryError as exc:  # a slower engine beats none: say so, run eagerly
            self.runner.graphs = None
            torch.cuda.empty_cache()
            logger.warning("CUDA graph capture ran out of memory (%s); decode steps run eagerly. Lower "
                           "cuda_graph_max_batch or cache.options.gpu_memory_fraction to keep them.", exc)

    def _attach_decoder(self) -> None:
        self.decoder.attach(self.decoder_context())
        if type(self.decoder).bind is not Decoder.bind:
            warnings.warn(f"decoding plugin {self.decoder.name!r} overrides Decoder.bind(pipeline), which plugin "
                          f"API 1.1 deprecates; override attach(ctx) and use the DecoderContext instead",
                          DeprecationWarning, stacklevel=2)
            self.decoder.bind(self)

    def decoder_context(self) -> DecoderContext:
        """What a decoder may use of this pipeline (``Decoder.attach``)."""

        def run(items: list[ScheduledSeq], layers: Layers[int] | None = None) -> torch.Tensor:
            return self.runner.forward(build_batch(items, self.cache, self.runner.device, prompt_logprobs=False), layers)

        def build_pipeline(config: dict[str, Any], overrides: list[str]) -> DecoderContext:
            if self.ranks is not None:
                raise ConfigError("a second pipeline (the speculative 'draft' proposer's) does not run under tensor "
                                  "or pipeline parallelism; use proposer ngram or layer-skip, or parallel.tensor=1 "
                                  "and parallel.pipeline=1")
            return Pipeline.from_config(config, overrides, self.registry).decoder_context()

        return DecoderContext(
            model=self.local_spec, device=self.resolved.device, max_model_len=self.resolved.max_model_len,
            cache=self.cache, run=run, tokens_left=self.stop.tokens_left, vocab_size=len(self.tokenizer),
            num_parameters=sum(p.numel() for p in self.model.parameters()),
            config=json.loads(self.config.model_dump_json()), build_pipeline=build_pipeline,
            eos_token_ids=self.stop.eos_token_ids, reassign=self.engine.reassign, end_group=self.engine.end_group)

    def _eos_ids(self, hf_config: Any) -> set[int]:
        ids: set[int] = set()
        for value in (getattr(hf_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        gen = self.model_dir / "generation_config.json"
        if gen.is_file():
            value = json.loads(gen.read_text()).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else value or [])
        return ids

    @classmethod
    def from_config(cls, config: PipelineConfig | dict | str | Path | None = None,
                    overrides: list[str] | None = None, registry: PluginRegistry | None = None) -> "Pipeline":
        """Build from a config object, a mapping, a file path, or the default config (None)."""
        if isinstance(config, PipelineConfig):
            if overrides:
                config = config_from_dict(apply_overrides(config.model_dump(), overrides))
        elif isinstance(config, dict):
            config = config_from_dict(apply_overrides(config, overrides or []))
        else:
            config = load_config(config, overrides)
        return cls(config, registry)


def image_processor_for(config: Any, model_dir: Any) -> Any:
    """The ``ImageProcessor`` of the model ``config`` names (in ``model_dir``), built without
    the model: what a server's API process, apart from the engine core, processes a prompt's
    images with; None for a model that takes no images."""
    config = config if isinstance(config, PipelineConfig) else PipelineConfig.model_validate(config)
    hf_config = load_hf_config(model_dir)
    architecture = get_registry().architecture_for(hf_config, config.architecture.name, config.architecture.options)
    spec = architecture.load_spec(hf_config)
    if spec.vision is None:
        return None
    return architecture.image_processor(model_dir, spec.vision.hf_config)
