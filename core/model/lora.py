"""LoRA in the model: the wrapped projections that hold every resident adapter's slot, and
reading a PEFT adapter folder into the tensors those slots take.

``wrap_targets`` replaces each target projection of the decoder layers (attention's q/k/v/o,
the MLP's gate/up/down, or their stacked forms) by a ``LoraLinear``: the base layer as it was
(float, quantized or sharded), then the configured kernel adding each row's adapter. Every
wrapped layer reads the step's plan from one shared ``LoraState``, which the runner sets
(None when no row of the step has an adapter: the base layers alone run).

``read_adapter`` turns adapter_config.json and adapter_model.safetensors into one
``LoraAdapter`` (host tensors, scaling folded into B, sliced for a tensor-parallel rank),
refusing, at load, anything that is not a LoRA adapter this model can serve.
"""

from __future__ import annotations

import hashlib

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from tessellm.core.errors import LoraAdapterError
from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.lora import LoraKernel, LoraMapping, LoraWeights

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections a pipeline with LoRA wraps unless the config names others: PEFT's usual
``target_modules`` for decoder-only models (stacked forms, ``qkv_proj`` and ``gate_up_proj``,
serve their parts' names)."""

_LAYER_MODULE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.([A-Za-z0-9_]+)$")


@dataclass
class LoraState:
    """What every wrapped layer of one model shares: the kernel, the slot count and the
    step's plan."""

    kernel: LoraKernel
    num_slots: int
    plan: Any = None
    """The step's plan (``LoraKernel.plan``); None: no row of this step has an adapter."""

    def mapping(self, batch: BatchMetadata) -> LoraMapping | None:
        """The step's ``LoraMapping`` (None: no sequence of ``batch`` has an adapter)."""
        slots = batch.lora_slots_cpu
        if slots is None:
            return None
        device = batch.input_ids.device
        starts = batch.query_starts_cpu
        host = torch.tensor(slots, dtype=torch.int32)
        rows = torch.repeat_interleave(host.long(), torch.tensor(batch.query_lens_cpu))
        return LoraMapping(host.to(device, non_blocking=True), rows.to(device, non_blocking=True),
                           batch.query_start_loc, list(slots), starts, self.num_slots, batch.max_query_len)

    def plan_for(self, batch: BatchMetadata) -> Any:
        mapping = self.mapping(batch)
        return None if mapping is None else self.kernel.plan(mapping)


class LoraLinear(nn.Module):
    """A projection with LoRA slots: ``base(x)``, then each row's adapter added by the kernel.

    ``parts`` names the projections stacked in ``base`` and their output widths (one part for
    a plain projection); part ``j`` of slot ``s`` sits on ranks ``j * rank .. (j + 1) * rank``
    of ``weights.a[s]`` and on its own output rows of ``weights.b[s]``."""

    def __init__(self, base: nn.Module, parts: tuple[tuple[str, int], ...], num_slots: int, rank: int,
                 state: LoraState, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.base = base
        self.in_features = _features(base)[0]
        self.out_features = sum(width for _, width in parts)
        self.parts = parts
        self.rank = rank
        self.state = state
        zeros = dict(device=device, dtype=dtype)
        self.weights = LoraWeights(torch.zeros(num_slots, len(parts) * rank, self.in_features, **zeros),
                                   torch.zeros(num_slots, self.out_features, len(parts) * rank, **zeros))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        # a plain Linear is called directly: one module dispatch less per projection and step
        out = F.linear(x, base.weight, base.bias) if type(base) is nn.Linear else base(x)
        plan = self.state.plan
        if plan is not None:
            if x.dim() == 2:
                self.state.kernel.apply(out, x, self.weights, plan)
            else:
                self.state.kernel.apply(out.view(-1, self.out_features), x.reshape(-1, self.in_features),
                                        self.weights, plan)
        return out

    def part_index(self, name: str) -> int | None:
        return next((j for j, (part, _) in enumerate(self.parts) if part == name), None)

    def load_slot(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` holds ``parts`` (part index -> (A [r, in], B [width, r] scaled)),
        zero everywhere else."""
        self.weights.derived.clear()
        a, b = self.weights.a[slot], self.weights.b[slot]
        a.zero_()
        b.zero_()
        offsets = [0]
        for _, width in self.parts:
            offsets.append(offsets[-1] + width)
        for j, (lora_a, lora_b) in parts.items():
            r = lora_a.shape[0]
            a[j * self.rank:j * self.rank + r].copy_(lora_a, non_blocking=True)
            b[offsets[j]:offsets[j + 1], j * self.rank:j * self.rank + r].copy_(lora_b, non_blocking=True)

    def extra_repr(self) -> str:
        names = "+".join(name for name, _ in self.parts)
        return f"{names}, slots={self.weights.num_slots}, rank={self.rank}"


def _features(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a linear layer, float or quantized."""
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return int(module.in_features), int(module.out_features)
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[1]), int(weight.shape[0])
    raise TypeError(f"{type(module).__name__} is not a linear layer")


def wrap_targets(model: nn.Module, targets: tuple[str, ...], num_slots: int, rank: int, state: LoraState,
                 device: torch.device, dtype: torch.dtype) -> dict[str, LoraLinear]:
    """Wrap every decoder-layer projection named in ``targets`` (or stacking parts so named)
    in a ``LoraLinear``; the wrapped layers by module path."""
    wrapped: dict[str, LoraLinear] = {}
    for path, module in list(model.named_modules()):
        match = _LAYER_MODULE.match(path)
        if match is None or isinstance(module, LoraLinear):
            continue
        name = match.group(3)
        parts = getattr(module, "stacked_parts", None) or ((name, _features_or_none(module)),)
        if parts[0][1] is None or not any(part in targets for part, _ in parts):
            continue
        parent = model.get_submodule(path.rsplit(".", 1)[0])
        layer = LoraLinear(module, tuple(parts), num_slots, rank, state, device, dtype)
        setattr(parent, name, layer)
        wrapped[path] = layer
    return wrapped


def _features_or_none(module: nn.Module) -> int | None:
    try:
        return _features(module)[1]
    except TypeError:
        return None


@dataclass
class LoraAdapter:
    """One adapter read from a PEFT folder, ready to copy into a slot."""

    name: str
    path: str
    rank: int
    """The largest rank of any of its modules."""
    modules: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    """Wrapped layer path -> part index -> (A [r, in], B [width, r] with the scaling folded in)."""
    base_model: str | None = None
    """``base_model_name_or_path`` from its adapter_config.json."""
    uid: int = 0
    """Unique per registration: slots tell a re-registered name apart."""

    def digest(self) -> str:
        """A digest of the adapter's weights (computed once): what its K/V depend on, so
        prefix-cache keys, also those a disk tier keeps across restarts, tell adapters apart
        by content, never by a name or a per-process number."""
        cached = self.__dict__.get("_digest")
        if cached is None:
            h = hashlib.blake2b(digest_size=16)
            for module in sorted(self.modules):
                for part, (a, b) in sorted(self.modules[module].items()):
                    h.update(f"{module}:{part}:{tuple(a.shape)}:{tuple(b.shape)}:{a.dtype}".encode())
                    for t in (a, b):
                        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
            cached = self.__dict__["_digest"] = h.hexdigest()
        return cached


class AdapterReader:
    """Reads PEFT adapter folders for one model: its wrapped layers, the model plugin's
    checkpoint-name mapping, the rank limit, (tensor parallel) each tensor's slice rule and
    (pipeline parallel) which module names the stage holds: an adapter's modules on the other
    stages' layers are left to them."""

    def __init__(self, layers: dict[str, LoraLinear], max_rank: int, targets: tuple[str, ...],
                 checkpoint_name: Callable[[str], str | None] = lambda n: n,
                 slice_rule: Callable[[str], Any] | None = None, held: Callable[[str], bool] | None = None):
        self.layers = layers
        self.max_rank = max_rank
        self.targets = targets
        self.checkpoint_name = checkpoint_name
        self.slice_rule = slice_rule
        self.held = held

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        folder = Path(path).expanduser()
        config = _adapter_config(name, folder)
        tensors = _adapter_tensors(name, folder)
        embedding = next((key for key in tensors if "lora_embedding" in key), None)
        if embedding is not None:
            raise LoraAdapterError(f"LoRA adapter {name!r} adapts an embedding ({embedding!r}); tessellm applies "
                                   f"LoRA to the decoder layers' projections only")
        by_module: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            module, kind = _split_key(name, key)
            by_module.setdefault(module, {})[kind] = tensor
        adapter = LoraAdapter(name, str(folder), 0, base_model=config.get("base_model_name_or_path"))
        for module, pair in sorted(by_module.items()):
            if set(pair) != {"lora_A", "lora_B"}:
                raise LoraAdapterError(f"LoRA adapter {name!r}: module {module!r} has {sorted(pair)} but needs both "
                                       f"lora_A and lora_B")
            self._add_module(adapter, config, module, pair["lora_A"], pair["lora_B"])
        if not adapter.modules:
            raise LoraAdapterError(f"LoRA adapter {name!r} ({str(folder)!r}) holds no lora_A/lora_B weights")
        return adapter

    def _add_module(self, adapter: LoraAdapter, config: dict[str, Any], module: str, lora_a: torch.Tensor,
                    lora_b: torch.Tensor) -> None:
        name = adapter.name
        ours = self.checkpoint_name(module + ".weight")
        ours = ours[:-len(".weight")] if ours and ours.endswith(".weight") else ours
        if ours and self.held is not None and not self.held(f"{ours}.weight"):
            return  # another pipeline stage's layer
        layer, part = self._target(name, module, ours)
        rank = int(lora_a.shape[0])
        if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_b.shape[1] != rank:
            raise LoraAdapterError(f"LoRA adapter {name!r}: {module} has lora_A {list(lora_a.shape)} and lora_B "
                                   f"{list(lora_b.shape)}; expected [r, in] and [out, r]")
        if rank > self.max_rank:
            raise LoraAdapterError(f"LoRA adapter {name!r}: {module} has rank {rank}, above lora.max_rank "
                                   f"{self.max_rank}; raise lora.max_rank (--max-lora-rank) to serve it")
        scale = _scaling(name, config, module, rank)
        lora_a, lora_b = lora_a.float(), lora_b.float() * scale
        if self.slice_rule is not None:
            lora_a, lora_b = _shard(lora_a, lora_b, self.slice_rule(f"{ours.rsplit('.', 1)[0]}.{layer.parts[part][0]}"
                                                                    f".weight"))
        width = layer.parts[part][1]
        if lora_a.shape[1] != layer.in_features or lora_b.shape[0] != width:
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: {module} maps {lora_a.shape[1]} features to {lora_b.shape[0]}, but this "
                f"model's {layer.parts[part][0]} maps {layer.in_features} to {width}: the adapter was trained "
                f"for another base model (its base: {adapter.base_model or 'not stated'})")
        adapter.modules.setdefault(_path_of(self.layers, layer), {})[part] = (lora_a.contiguous(),
                                                                              lora_b.contiguous())
        adapter.rank = max(adapter.rank, rank)

    def _target(self, name: str, module: str, ours: str | None) -> tuple[LoraLinear, int]:
        """The wrapped layer and part an adapter module (checkpoint name) applies to."""
        served = ", ".join(self.targets)
        if ours is None or _LAYER_MODULE.match(ours) is None:
            what = "a mixture-of-experts expert" if ours and ".experts." in ours else "not a decoder-layer projection"
            raise LoraAdapterError(f"LoRA adapter {name!r} targets {module!r} ({what}); tessellm applies LoRA to "
                                   f"the decoder layers' projections: {served}")
        if ours in self.layers and self.layers[ours].part_index(ours.rsplit(".", 1)[1]) is not None:
            layer = self.layers[ours]
            return layer, layer.part_index(ours.rsplit(".", 1)[1])
        parent, leaf = ours.rsplit(".", 1)
        for path, layer in self.layers.items():
            if path.rsplit(".", 1)[0] == parent and layer.part_index(leaf) is not None:
                return layer, layer.part_index(leaf)
        raise LoraAdapterError(f"LoRA adapter {name!r} targets {module!r}, which this pipeline does not wrap for "
                               f"LoRA (lora.target_modules: {served})")


def _path_of(layers: dict[str, LoraLinear], layer: LoraLinear) -> str:
    return next(path for path, candidate in layers.items() if candidate is layer)


def _adapter_config(name: str, folder: Path) -> dict[str, Any]:
    file = folder / "adapter_config.json"
    if not file.is_file():
        raise LoraAdapterError(f"LoRA adapter {name!r}: {str(folder)!r} has no adapter_config.json (a PEFT adapter "
                               f"folder holds adapter_config.json and adapter_model.safetensors)")
    try:
        config = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {str(file)!r} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoraAdapterError(f"LoRA adapter {name!r}: {str(file)!r} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoraAdapterError(f"LoRA adapter {name!r}: peft_type is {kind!r}; only LORA adapters are served")
    refusals = {"use_dora": "DoRA (use_dora)", "modules_to_save": "modules_to_save (fully trained copies of layers)",
                "fan_in_fan_out": "fan_in_fan_out (Conv1D base layers)"}
    for key, what in refusals.items():
        if config.get(key):
            raise LoraAdapterError(f"LoRA adapter {name!r}: {what} is not supported; serve a plain LoRA adapter")
    if config.get("bias", "none") != "none":
        raise LoraAdapterError(f"LoRA adapter {name!r}: bias {config['bias']!r} (trained biases) is not supported; "
                               f"only bias 'none' is")
    return config


def _adapter_tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        other = " (adapter_model.bin: save it with safe_serialization=True)" if (folder / "adapter_model.bin").is_file() \
            else ""
        raise LoraAdapterError(f"LoRA adapter {name!r}: {str(folder)!r} has no adapter_model.safetensors{other}")
    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoraAdapterError(f"LoRA adapter {name!r}: cannot read {str(file)!r}: {exc}".split("\n")[0]) from None


_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight$")


def _split_key(name: str, key: str) -> tuple[str, str]:
    """(module, lora_A | lora_B) of a PEFT state-dict key."""
    match = _KEY.match(key)
    if match is None:
        what = "a DoRA magnitude" if "lora_magnitude" in key else \
            "a full copy of a base weight (PEFT saves those for embedding targets and modules_to_save)" \
            if key.endswith("base_layer.weight") else "not a lora_A/lora_B weight"
        raise LoraAdapterError(f"LoRA adapter {name!r}: tensor {key!r} is {what}; only lora_A/lora_B weights of "
                               f"linear projections are served")
    return match.group(1), match.group(2)


def _pattern_value(patterns: dict[str, Any], module: str) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the value of the first key naming ``module`` (a
    suffix on a dot boundary, or a regex matching it whole; a key that is no regex matches as
    a name only)."""
    for key, value in (patterns or {}).items():
        if module == key or module.endswith("." + key):
            return value
        try:
            if re.fullmatch(key, module) or re.fullmatch(rf"(.*\.)?{key}", module):
                return value
        except re.error:
            continue
    return None


def _scaling(name: str, config: dict[str, Any], module: str, rank: int) -> float:
    patterns = config.get("alpha_pattern") or {}
    if not isinstance(patterns, dict):
        raise LoraAdapterError(f"LoRA adapter {name!r}: alpha_pattern must be a mapping, not {patterns!r}")
    alpha = _pattern_value(patterns, module)
    if alpha is None:
        alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoraAdapterError(f"LoRA adapter {name!r}: lora_alpha for {module} is {alpha!r}, not a number")
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _shard(lora_a: torch.Tensor, lora_b: torch.Tensor, rule: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share: a column-parallel layer's B rows, a row-parallel layer's A columns
    (``rule`` as core/parallel/shard.py's ``slice_rule``); a layer kept whole stays whole."""
    if rule is None or isinstance(rule, str):
        return lora_a, lora_b
    if isinstance(rule, list):
        return lora_a, torch.cat([lora_b[lo:hi] for _, lo, hi in rule])
    dim, lo, hi = rule
    return (lora_a, lora_b[lo:hi]) if dim == 0 else (lora_a[:, lo:hi], lora_b)
