"""The pipeline config: which model, device and dtype, and one ``{name, options}`` section
per kind of plugin. Read from YAML, TOML or JSON; ``--set key=value`` overrides any field.

    model: smollm2-135m
    device: auto
    dtype: auto
    attention: {name: auto}
    cache: {name: contiguous, options: {max_seqs: 16}}
    decoding: {name: sample}

The config itself is plain data; ``tessellm.core.resolve`` checks names and options against
the plugin registry and picks the ``auto`` plugins.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tessellm.core.errors import ConfigError
from tessellm.core.model.loader import DEFAULT_MODEL

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DType = Literal["auto", "float32", "float16", "bfloat16", "float64"]


class PluginSection(BaseModel):
    """Selects one plugin of a kind by name and passes it options."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = "auto"
    """A registered plugin name, or ``auto``: the first plugin, in priority order, that can serve."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Validated by the chosen plugin's own Options model."""


class ParallelConfig(BaseModel):
    """How the model is split across processes (launched by torchrun)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    tensor: int = Field(1, ge=1, strict=True)
    """Tensor-parallel ranks: each holds a share of every layer's heads and MLP columns.
    Above 1, launch with ``torchrun --nproc-per-node N $(which tessellm) ...``."""
    pipeline: int = Field(1, ge=1, strict=True)
    """Pipeline stages: each holds a contiguous run of the decoder layers (and its KV cache)
    and hands its activations to the next. Combines with ``tensor``: ``pipeline x tensor``
    ranks, the ranks of one stage contiguous (stage = rank // tensor)."""
    stage_layers: Optional[list[int]] = None
    """Decoder layers per stage, in order (e.g. ``[10, 14]``), summing to the model's layer
    count; None: as even as the count allows (earlier stages take the extra layer)."""
    microbatches: Optional[int] = Field(None, ge=1)
    """Under ``pipeline`` above 1: into how many micro-batches (by sequence, balanced by
    tokens) a step is cut at most, so that stage s runs micro-batch k while stage s+1 runs
    k-1. None: twice the stage count (the idle share of a step, (P-1)/(M+P-1), is 1/5 at 2
    stages)."""
    microbatch_min_tokens: int = Field(128, ge=1)
    """The fewest tokens a micro-batch gets: a step of N tokens is cut into at most N // this
    many. A forward of a few tokens costs about as much as one of a few more (its launches
    and per-layer overhead, not its arithmetic), so small decode steps run whole."""
    timeout_s: float = Field(600.0, gt=0)
    """How long a rank waits for the others in one collective before failing (covers the
    slowest rank's kernel compiles at start-up)."""


class LoraConfig(PluginSection):
    """LoRA adapters over the base model: ``name`` and ``options`` choose the kernel (kind
    ``lora``: ``auto``, ``torch``, ``triton``); the rest say which adapters and how many at once."""

    enabled: Optional[bool] = None
    """Wrap the model's projections for adapters. None (the default): on when ``adapters``
    names any or ``runtime_updates`` is set."""
    adapters: dict[str, str] = Field(default_factory=dict)
    """Adapters registered at start, name -> PEFT folder (adapter_config.json and
    adapter_model.safetensors); a request names one (``lora`` offline, ``model`` over HTTP)."""
    max_loras: int = Field(4, ge=1, le=256, strict=True)
    """Adapters resident on the device at once (the slots); the others wait in host memory and
    are copied in, least recently used out, when a request needs them."""
    max_rank: int = Field(16, ge=1, le=512, strict=True)
    """The largest adapter rank served; every slot is this wide, so an adapter of any rank up
    to it loads without new shapes (no kernel compiles, no graph recapture)."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"])
    """The decoder-layer projections given slots; an adapter targeting another is refused at load."""
    runtime_updates: bool = False
    """Allow loading and unloading adapters while serving (``POST /v1/load_lora_adapter``,
    ``/v1/unload_lora_adapter``)."""

    @model_validator(mode="after")
    def _adapters_need_lora_on(self) -> "LoraConfig":
        if self.enabled is False and (self.adapters or self.runtime_updates):
            what = "adapters" if self.adapters else "runtime_updates"
            raise ValueError(f"lora.{what} is set but lora.enabled is false; drop one of them")
        return self

    @property
    def active(self) -> bool:
        """Whether the pipeline serves adapters."""
        return self.enabled if self.enabled is not None else bool(self.adapters) or self.runtime_updates


class ImagesConfig(BaseModel):
    """Images in prompts, for a model that takes them (a model plugin with a vision encoder:
    qwen2-vl, gemma's multimodal Gemma 3, idefics3)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_per_prompt: int = Field(8, ge=0, le=1024, strict=True)
    """Most images one prompt may hold (``tessellm serve --limit-mm-per-prompt image=N``);
    more is refused with a 400."""
    encoder_cache_tokens: int = Field(16384, ge=0, strict=True)
    """How many image embeddings (placeholder tokens) the encoder cache keeps, recent images
    first: a repeated image is encoded once. 0 keeps none beyond the step that needs them."""
    fetch_urls: bool = Field(False, strict=True)
    """Whether the server fetches http(s) image URLs in requests (``tessellm serve
    --allow-image-urls``); off, such a URL is a 400 and only ``data:`` URLs are read."""
    fetch_max_bytes: int = Field(20 << 20, ge=1, strict=True)
    """Largest image a fetched URL may return, in bytes (``--image-fetch-max-bytes``); a larger
    one is a 400."""
    fetch_timeout_s: float = Field(10.0, gt=0)
    """Longest a fetch may take, connecting and reading, in seconds (``--image-fetch-timeout``);
    a slower one is a 400."""


class PipelineConfig(BaseModel):
    """Everything that defines a pipeline. Every field has a default."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: str = DEFAULT_MODEL
    """A model name (smollm2-135m), a Hugging Face folder, or a .gguf file."""
    device: str = "auto"
    """``auto`` (cuda if available, else cpu), ``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: DType = "auto"
    """Compute dtype; ``auto`` is bfloat16 on cuda and float32 on cpu."""
    max_model_len: Optional[int] = Field(None, gt=0, strict=True)
    """Longest sequence (prompt + output); default: the model's max_position_embeddings."""
    seed: int = Field(0, ge=0, strict=True)
    """Seeds the generators of requests that give no seed of their own."""
    trust_remote_code: bool = False
    """Run a checkpoint's own Python code (its config.json ``auto_map``: a custom config,
    tokenizer or model class), which transformers imports from the model folder. Off by
    default: such a checkpoint is refused, saying so. Turn it on only for folders whose code
    you trust; it runs with this process's rights."""
    model_cache_dir: Optional[str] = None
    """Where converted GGUF models are cached; default $TESSELLM_CACHE_DIR, else
    $XDG_CACHE_HOME/tessellm, else ~/.cache/tessellm."""
    attention: PluginSection = Field(default_factory=PluginSection)
    cache: PluginSection = Field(default_factory=PluginSection)
    scheduler: PluginSection = Field(default_factory=PluginSection)
    decoding: PluginSection = Field(default_factory=PluginSection)
    quant: PluginSection = Field(default_factory=PluginSection)
    grammar: PluginSection = Field(default_factory=PluginSection)
    """The grammar backend that constrains structured outputs (JSON schema, regex, choice,
    EBNF); ``auto`` takes the first that can serve, or none (such requests are then refused)."""
    architecture: PluginSection = Field(default_factory=PluginSection)
    """The model plugin (kind ``model``) that builds the checkpoint; ``auto`` takes the one,
    by priority, that declares the checkpoint's ``model_type`` (``tessellm plugins`` lists
    them with the types they build)."""
    pooling: PluginSection = Field(default_factory=PluginSection)
    """The pooler (kind ``pooling``) of an embedding or scoring pipeline: ``last``, ``mean``,
    ``cls``, ``classify`` (a sequence-classification head) or ``yes-no`` (a decoder reranker's
    yes/no token); ``auto`` takes the one the checkpoint's sentence-transformers files (or its
    classification head) name, or none, and the pipeline generates."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters and the kernel that applies them (off unless adapters are given)."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    images: ImagesConfig = Field(default_factory=ImagesConfig)
    """Images in prompts (for a model that takes them): how many per prompt, the encoder cache."""
    cuda_graphs: bool = True
    """On CUDA, replay decode steps from captured CUDA graphs when the attention backend and
    cache support it (``flash`` with ``paged``); False runs every step eagerly."""
    cuda_graph_max_batch: int = Field(512, ge=1, le=2048, strict=True)
    """Largest decode batch replayed from a graph (capped by the scheduler's sequences per
    step); larger batches run eagerly."""
    cpu_compile: bool = False
    """On the CPU, run decode steps of one sequence through the model compiled as one graph
    (torch.compile, Inductor's C++ backend: the small operations between the products fused,
    no Python between them), where the first such step measures it faster than eager (logged;
    a failed compile keeps eager). The compile happens in that first step: tens of seconds or
    more, cached on disk by torch for later processes."""
    async_scheduling: Optional[bool] = None
    """Schedule and launch each decode step before the previous step's tokens reach the host,
    and absorb them while the GPU runs (requests whose decoder samples on the device: greedy;
    other steps run synchronously). Outputs are the same; the host's work leaves the critical
    path. None (the default): on where the pipeline runs on CUDA, off on the CPU (where the
    forward itself holds the host, so there is nothing to overlap)."""

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
            return value
        raise ValueError(f"must be auto, cpu, cuda or cuda:N, not {value!r}")

    def section(self, kind: str) -> PluginSection:
        """The config section of plugin kind ``kind`` (``architecture`` for ``model``); the
        ``logits`` kind has none (a request names its processors)."""
        if kind == "logits":
            raise ConfigError("the logits kind has no config section: every logits processor serves every pipeline, "
                              "and a request turns on the ones it uses (SamplingParams)")
        return getattr(self, "architecture" if kind == "model" else kind)


def _format_validation(exc: ValidationError, where: str) -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        value = err.get("input")
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            sections = {"lora": LoraConfig, "images": ImagesConfig, "parallel": ParallelConfig}
            allowed = ", ".join(PipelineConfig.model_fields) if len(err["loc"]) == 1 else \
                ", ".join(sections[err["loc"][0]].model_fields) if err["loc"][0] in sections else "name, options"
            msg = f"unknown field; allowed: {allowed}"
        parts.append(f"{field}: {msg} (got {value!r})" if err["type"] != "missing" else f"{field}: {msg}")
    return f"{where}: " + "; ".join(parts)


def config_from_dict(data: Any, where: str = "config") -> PipelineConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc, where)) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping in a .yaml/.yml, .toml or .json file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {exc.start}); is it a config file?") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {str(path)!r}: unknown extension {path.suffix!r}; use .yaml, .yml, .toml or .json")
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        first = str(exc).strip().split("\n")[0]
        if isinstance(exc, yaml.MarkedYAMLError):  # YAML keeps positions apart from the message

            def at(mark) -> str:
                return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""

            first = "; ".join(f"{text}{at(mark)}" for text, mark in
                              ((exc.context, exc.context_mark), (exc.problem, exc.problem_mark)) if text)
        raise ConfigError(f"config file {str(path)!r} is malformed: {first}") from None
    return {} if data is None else data


def _parse_value(text: str) -> Any:
    """``--set`` values are YAML scalars: 32 -> int, true -> bool, [1, 2] -> list."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides to a raw config mapping (a new dict)."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. cache.options.block_size=32")
        path = key.strip().split(".")
        if path[0] not in PipelineConfig.model_fields:
            raise ConfigError(f"--set {item!r}: unknown field {path[0]!r}; allowed: {', '.join(PipelineConfig.model_fields)}")
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a section")
            node = child
        raw = raw.strip()
        value = _parse_value(raw)
        # model paths and plugin names stay strings even if they look like numbers
        verbatim = len(path) == 1 and path[0] in ("model", "device", "model_cache_dir") or (
            len(path) == 2 and path[1] == "name")
        if verbatim and value is not None:
            value = raw
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """The config in ``path`` (or the default config) with ``overrides`` applied."""
    data = read_config_file(path) if path is not None else default_config_data()
    where = f"config {str(path)!r}" if path is not None else "config"
    return config_from_dict(apply_overrides(data, overrides or []) if overrides else data, where)


def default_config_data() -> dict[str, Any]:
    """The embedded default config (core/default_config.yaml)."""
    return yaml.safe_load((Path(__file__).parent / "default_config.yaml").read_text()) or {}

