"""The Python API: ``Pipeline`` assembles the parts a config names, ``LLM`` generates."""

from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence as Seq

import torch
from pydantic import ValidationError
from tqdm.auto import tqdm

from .cache import CacheSpec
from .config import PipelineConfig, apply_overrides, config_from_dict, load_config
from .engine import Engine, RequestState
from .kernel_builds import build_log
from .errors import ConfigError, InvalidRequestError
from .heap import frozen_heap
from .model_loader import load_hf_config, load_state_dict, load_tokenizer
from .model_runner import ModelRunner, build_model
from .model_spec import ModelSpec
from .registry import PluginRegistry, get_registry
from .resolve import ResolvedPipeline, model_dir_for, precheck, resolve
from .scheduler import SchedulerLimits

logger = logging.getLogger(__name__)

@dataclass
class CompletionOutput:
    """One generated sample."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[Any] | None = None
    """With ``SamplingParams.logprobs``: a ``TokenLogprob`` (logprob, top alternatives) per token."""


@dataclass
class RequestOutput:
    """A finished request: its prompt, its samples and its timings (seconds)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    ttft_s: float | None
    e2e_s: float

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class Pipeline:
    """A config resolved against the registry, with the model loaded and every part built."""

    def __init__(self, config: PipelineConfig, registry: PluginRegistry | None = None):
        self.config = config
        self.registry = registry or get_registry()
        precheck(config, self.registry)  # fail on a config typo before converting or loading a model
        self.model_dir = model_dir_for(config)
        hf_config = load_hf_config(self.model_dir)
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.resolved: ResolvedPipeline = resolve(config, self.registry, self.spec)
        r, c = self.resolved, self.resolved.choices
        self.tokenizer = load_tokenizer(self.model_dir)
        quantizer = c["quant"].cls(c["quant"].options, r.device, r.dtype)
        self.model = build_model(self.spec, load_state_dict(self.model_dir), r.device, r.dtype, quantizer)
        cache_spec = CacheSpec(self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim, r.dtype,
                               r.device, r.max_model_len)
        self.cache = c["cache"].cls(c["cache"].options, cache_spec, r.kv_layout)
        self.attention = c["attention"].cls(c["attention"].options, self.spec, r.device, r.dtype)
        self.decoder = c["decoding"].cls(c["decoding"].options, self.spec, r.device)
        limits = SchedulerLimits(r.max_model_len, self.decoder.num_lookahead_tokens)
        self.scheduler = c["scheduler"].cls(c["scheduler"].options, self.cache, limits)
        self.runner = ModelRunner(self.model, self.spec, self.attention, self.cache, r.device)
        if self.runner.compiles_kernels():  # compile every kernel variant now, not inside a request's step
            build_log.install()
            tokens = self.scheduler.max_step_tokens or r.max_model_len
            try:
                self.runner.warm_up(tokens, r.max_model_len)
            except torch.cuda.OutOfMemoryError as exc:  # a real step that size would fail too: say so now
                raise ConfigError(
                    f"start-up warm-up ran out of GPU memory running one step of {tokens} tokens (the "
                    f"scheduler's token budget) beside the KV cache; lower scheduler.options."
                    f"max_num_batched_tokens or cache.options.gpu_memory_fraction ({exc})") from exc
        if config.cuda_graphs and self.runner.graphs_unsupported() is None:
            try:
                # no decode batch outgrows the scheduler's limit: capturing larger ones wastes memory
                max_batch = min(config.cuda_graph_max_batch, self.scheduler.max_step_seqs or config.cuda_graph_max_batch)
                self.runner.capture_graphs(max_batch, r.max_model_len)
            except torch.cuda.OutOfMemoryError as exc:  # a slower engine beats none: say so, run eagerly
                self.runner.graphs = None
                torch.cuda.empty_cache()
                logger.warning("CUDA graph capture ran out of memory (%s); decode steps run eagerly. Lower "
                               "cuda_graph_max_batch or cache.options.gpu_memory_fraction to keep them.", exc)
        self.async_scheduling = r.async_scheduling
        self.engine = Engine(self.runner, self.cache, self.scheduler, self.decoder,
                             max_model_len=r.max_model_len, eos_token_ids=self._eos_ids(hf_config),
                             vocab_size=self.spec.vocab_size, seed=config.seed,
                             decode_text=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                             async_scheduling=self.async_scheduling)
        self.decoder.bind(self)

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


def to_sampling_params(value: Any) -> Any:
    from .sequence import SamplingParams

    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    try:
        return SamplingParams.model_validate(value)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']} (got {err.get('input')!r})"
                    for err in exc.errors()]
        raise InvalidRequestError("; ".join(problems)) from None


def _per_prompt(value: Any, n: int, name: str, kind: type | tuple[type, ...]) -> list[Any]:
    """One value per prompt from a single value or a list of ``n``."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(values) != n:
        raise InvalidRequestError(f"{len(values)} {name} values for {n} prompts")
    bad = [v for v in values if not isinstance(v, kind) or isinstance(v, bool)]
    if bad:
        raise InvalidRequestError(f"{name} must be {'an int' if kind is int else 'a string or None'}, not {bad[0]!r}")
    return values


class LLM:
    """Generate text from prompts with a pipeline: ``LLM().generate(["Hello"])``."""

    def __init__(self, config: PipelineConfig | dict | str | Path | None = None, *,
                 overrides: list[str] | None = None, pipeline: Pipeline | None = None):
        self.pipeline = pipeline or Pipeline.from_config(config, overrides)
        self.tokenizer = self.pipeline.tokenizer
        self.engine = self.pipeline.engine

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, not {type(prompt).__name__}")
        if not prompt:
            raise InvalidRequestError("prompt is empty; give at least one character")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidRequestError("this model's tokenizer has no chat template; run without --chat")
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(prompt)["input_ids"]

    def generate(self, prompts: str | Seq[str] | Seq[list[int]], params: Any = None, *, chat: bool = False,
                 progress: bool | None = None, priority: int | Seq[int] = 0,
                 cache_salt: str | None | Seq[str | None] = None) -> list[RequestOutput]:
        """Run every prompt as one batch; outputs come back in prompt order.

        ``params`` is one SamplingParams (or dict) for all prompts or a list of them;
        ``priority`` (lower runs first under the `priority` scheduling policy) and
        ``cache_salt`` (a tenant key: prefix-cache blocks are shared only within one salt)
        are one value for all prompts or one per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if not prompts:
            raise InvalidRequestError("no prompts given")
        per = [to_sampling_params(p) for p in params] if isinstance(params, list) else [to_sampling_params(params)] * len(prompts)
        if len(per) != len(prompts):
            raise InvalidRequestError(f"{len(per)} sampling params for {len(prompts)} prompts")
        priorities = _per_prompt(priority, len(prompts), "priority", int)
        salts = _per_prompt(cache_salt, len(prompts), "cache_salt", (str, type(None)))
        encoded = [list(p) if isinstance(p, (list, tuple)) else self.encode(p, chat=chat) for p in prompts]
        ids = []
        try:
            for tokens, p, prio, salt in zip(encoded, per, priorities, salts):
                request_id = uuid.uuid4().hex
                self.engine.add_request(request_id, tokens, p, priority=prio, cache_salt=salt)
                ids.append(request_id)
            done = self._run(ids, per, progress)
        except BaseException:
            for request_id in ids:  # never leave a request (or its blocks) behind
                self.engine.abort(request_id)
            raise
        return [self._output(done[i], prompt, tokens) for i, prompt, tokens in zip(ids, prompts, encoded)]

    def _run(self, ids: list[str], params: list[Any], progress: bool | None) -> dict[str, RequestState]:
        if progress is None:
            progress = sys.stderr.isatty()
        total = sum(p.max_tokens * p.n for p in params)
        bar = tqdm(total=total, desc="generating", unit="tok", disable=not progress, leave=False)
        wanted = set(ids)
        done: dict[str, RequestState] = {}
        before = self.engine.stats.generated_tokens
        with frozen_heap():  # the collector's full passes skip the pipeline's objects meanwhile
            while wanted - done.keys():
                for state in self.engine.step():
                    if state.request_id in wanted:
                        done[state.request_id] = self.engine.pop_finished(state.request_id)
                failed = [r for r in ids if r in self.engine.failures]
                if failed:  # the engine aborted a request whose own forward raised
                    errors = [self.engine.failures.pop(r) for r in failed]
                    raise errors[0]
                bar.update(self.engine.stats.generated_tokens - before - bar.n)
        bar.close()
        return done

    def _output(self, state: RequestState, prompt: Any, tokens: list[int]) -> RequestOutput:
        outs = []
        for seq in sorted(state.seqs, key=lambda s: s.sample_index):
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            if seq.stop_text_len is not None:
                text = text[: seq.stop_text_len]
            outs.append(CompletionOutput(seq.sample_index, text, list(seq.output_token_ids),
                                         seq.finish_reason.value if seq.finish_reason else None,
                                         list(seq.logprobs) if seq.params.logprobs is not None else None))
        first = state.seqs[0]
        ends = [s.finish_time for s in state.seqs if s.finish_time is not None]
        return RequestOutput(state.request_id, prompt if isinstance(prompt, str) else None, tokens, outs,
                             None if first.first_token_time is None else first.first_token_time - first.arrival_time,
                             (max(ends) if ends else time.perf_counter()) - first.arrival_time)

