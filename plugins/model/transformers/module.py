"""The module the runner runs: the checkpoint's transformers causal-LM model, built with
tessellm's attention, whose ``forward`` keeps ``DecoderForCausalLM``'s contract.

The model is transformers' own object (its parameter names are the checkpoint's, so
quantizers, LoRA and tensor-parallel slicing see the usual names), its class swapped for a
subclass that puts ``TransformersForward`` first: one forward per step over the packed
tokens [1, T], positions as ``position_ids``, the step's attention in ``tessellm_step`` and
the rows to compute logits for as ``logits_to_keep``, so the family's own final norm, head,
logit scaling and softcapping apply."""

from __future__ import annotations

import contextlib
import copy
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from tessellm.core.errors import ModelLoadError

from .attention import ATTN_IMPLEMENTATION, STEP_KWARG, AttentionLayout, StepAttention


def uses_own_code(config: Any) -> bool:
    """Whether ``config`` was made by a checkpoint's own code (read with trust_remote_code):
    then its model class comes from that code too."""
    return type(config).__module__.startswith("transformers_modules")


def build_causal_lm(config: Any, experts: str | None = None) -> nn.Module:
    """transformers' causal-LM model for (a copy of) ``config``, with tessellm's attention
    implementation, made on the current device (the caller's meta device), in eval mode."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    kwargs: dict[str, Any] = dict(attn_implementation=ATTN_IMPLEMENTATION, trust_remote_code=uses_own_code(config))
    with failures_as_load_error("transformers cannot build a causal-LM model of it with an attention implementation "
                                "of its own ({})"):
        if experts is not None:
            try:
                model = AutoModelForCausalLM.from_config(config, experts_implementation=experts, **kwargs)
                return quiet_padding_check(model.eval())
            except (ValueError, TypeError):
                pass  # a model whose experts do not switch implementation
        return quiet_padding_check(AutoModelForCausalLM.from_config(config, **kwargs).eval())


@contextlib.contextmanager
def failures_as_load_error(what: str) -> Iterator[None]:
    """Any exception inside (a ModelLoadError passes as it is) raised as a ModelLoadError whose
    message is ``what`` with ``{}`` replaced by the exception's type and first line."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as exc:
        message = str(exc).split("\n")[0][:300]
        raise ModelLoadError(what.format(f"{type(exc).__name__}: {message}")) from exc


def quiet_padding_check(model: nn.Module) -> nn.Module:
    """``model`` without transformers' check for padding in unmasked inputs: a packed step
    has no padding, its ids may equal the pad id all the same, and the check reads the ids on
    the host (a sync per forward; on the meta device, an error)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            module.warn_if_padding_and_no_attention_mask = _no_padding_check
    return model


def _no_padding_check(*args: Any, **kwargs: Any) -> None:
    return None


@dataclass
class ForwardPlan:
    """What ``TransformersForward`` needs of the model beyond transformers' class."""

    hf_forward: Any
    """The transformers class's own forward."""
    layout: AttentionLayout
    keeps_logits: bool
    """Whether that forward takes ``logits_to_keep`` (else every row's logits are computed)."""
    layers_path: str | None
    """Where the decoder's layer list is (``model.layers``), for running a subset of layers."""
    row_parallel: tuple[str, ...] = ()
    """On a tensor-parallel rank: the modules it holds rows of (their outputs are partial sums)."""
    cuda_graphs: bool = False
    """Whether decode steps may replay from CUDA graphs (the plugin's option)."""


class TransformersForward:
    """Put before a transformers causal-LM class: tessellm's model contract over it."""

    supports_fused = False
    tessellm: ForwardPlan

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor, backend: Any,
                cache: Any, plan: Any, layers: Sequence[int] | None = None, logits_out: torch.Tensor | None = None,
                native_logits: bool = False) -> torch.Tensor:
        """input_ids, positions [T] -> logits [len(logits_indices), vocab], float32 (float64 in
        a float64 model; the head's dtype with ``native_logits``), as DecoderForCausalLM."""
        run = self.tessellm
        kwargs: dict[str, Any] = {STEP_KWARG: StepAttention(backend, cache, plan, run.layout), "use_cache": False}
        if run.keeps_logits:
            kwargs["logits_to_keep"] = logits_indices
        with self.only_layers(layers):
            out = run.hf_forward(self, input_ids=input_ids[None], position_ids=positions[None], **kwargs)
        logits = (out.logits if hasattr(out, "logits") else out[0])[0]
        if not run.keeps_logits:
            logits = logits[logits_indices]
        if logits_out is not None:
            return logits_out.copy_(logits)
        if native_logits or logits.dtype == torch.float64:
            return logits
        return logits.float()

    @contextlib.contextmanager
    def only_layers(self, layers: Sequence[int] | None) -> Iterator[None]:
        """Inside: the decoder's layer list holds ``layers`` only (self-drafting by layer
        skipping); each layer keeps its index, so attention reads and writes its own cache."""
        path = self.tessellm.layers_path
        if layers is None:
            yield
            return
        if path is None:
            raise ModelLoadError(f"{type(self).__name__}: no decoder layer list was found, so a subset of its layers "
                                 f"cannot run (layer-skip drafting); use the ngram or draft proposer")
        parent_path, _, name = path.rpartition(".")
        parent = self.get_submodule(parent_path) if parent_path else self
        whole = getattr(parent, name)
        setattr(parent, name, nn.ModuleList([whole[i] for i in layers]))
        try:
            yield
        finally:
            setattr(parent, name, whole)

    def set_tensor_parallel(self, tp: Any) -> None:
        """Sum the outputs of the row-parallel modules over the ranks of ``tp``."""
        for path in self.tessellm.row_parallel:
            self.get_submodule(path).register_forward_hook(lambda module, args, out: tp.all_reduce(out))

    def cuda_graphs_unsupported(self) -> str | None:
        """Off unless the plugin's ``cuda_graphs`` option is on; a mixture of experts in
        transformers' code sizes its work on the host."""
        if not self.tessellm.cuda_graphs:
            return "model plugin 'transformers' captures no CUDA graphs unless its option cuda_graphs is on"
        if any(name.endswith("experts") for name, _ in self.named_modules()):
            return "the model's mixture-of-experts layers (transformers' code) size their work on the host"
        return None


_subclasses: dict[type, type] = {}


def adopt(model: nn.Module, layout: AttentionLayout, num_layers: int) -> nn.Module:
    """``model`` with its class swapped for one running ``TransformersForward`` first."""
    cls = type(model)
    if cls not in _subclasses:
        # the class's own name and module: transformers finds a model's checkpoint conversions
        # by its class name, and tells its own classes from a checkpoint's code by the module
        _subclasses[cls] = type(cls.__name__, (TransformersForward, cls),
                                {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    keeps = "logits_to_keep" in inspect.signature(cls.forward).parameters
    plan = ForwardPlan(cls.forward, layout, keeps, _layers_path(model, num_layers))
    model.__class__ = _subclasses[cls]
    model.tessellm = plan
    return model


def _layers_path(model: nn.Module, num_layers: int) -> str | None:
    """The path of the ModuleList of ``num_layers`` decoder layers (the first such list)."""
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers and \
                any(hasattr(m, "layer_idx") for m in module[0].modules()):
            return path
    return None


_registering = threading.Lock()


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside: modules are made on the CPU, but every parameter and persistent buffer they
    register goes to the meta device as it is registered; non-persistent buffers (rotary
    tables, scales a module computes for itself) keep their values. (It patches
    ``nn.Module``'s registration for the block's duration: one such block at a time.)"""
    with _registering, _patched_registration():
        yield


@contextlib.contextmanager
def _patched_registration() -> Iterator[None]:
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def parameter(module: nn.Module, name: str, param: Any) -> None:
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register_parameter(module, name, param)

    def buffer(module: nn.Module, name: str, tensor: Any, persistent: bool = True) -> None:
        if persistent and tensor is not None:
            tensor = tensor.to("meta")
        register_buffer(module, name, tensor, persistent)

    nn.Module.register_parameter, nn.Module.register_buffer = parameter, buffer
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = register_parameter, register_buffer


def fill_buffers(model: nn.Module, config: Any, device: torch.device, dtype: torch.dtype) -> None:
    """Give the buffers ``model`` computes for itself (its non-persistent ones, left on the
    meta device) their values: from a twin of the model made as transformers makes one in
    ``dtype`` (parameters on the meta device, buffers computed), moved to ``device``."""
    missing = {name for name, b in model.named_buffers() if b.is_meta}
    if not missing:
        return
    with parameters_on_meta():
        from transformers import AutoModelForCausalLM

        twin_config = copy.deepcopy(config)
        twin = AutoModelForCausalLM.from_config(twin_config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
                                                trust_remote_code=uses_own_code(config))
    values = dict(twin.named_buffers())
    for name in sorted(missing):
        value = values.get(name)
        if value is None or value.is_meta:
            continue  # left on meta: the loader names it
        parent_path, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        parent._buffers[leaf] = value.to(device)
