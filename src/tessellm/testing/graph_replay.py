"""CUDA graph semantics on a CPU: record a forward once, then replay what it ran.

A captured CUDA graph replays the kernels its capture launched, on the same memory, with the
same launch parameters: the grid, every Python number and constexpr, every tensor's address.
Whatever the capture decided on the host (a count, a branch, a tensor built from host lists
or cached between steps) is frozen into the graph; between replays only the contents of the
tensors it reads change. Code that is right run eagerly can thus be wrong replayed, and a
test that runs the graph path eagerly (``DecodeGraphs(capture=False)``) never sees it.

``Recording`` reproduces those semantics with plain torch: while recording, every ATen
operation (seen through a ``TorchDispatchMode``) and every Triton launch (under Triton's
interpreter, ``TRITON_INTERPRET=1``) is kept with its arguments, the tensors themselves, as
a graph keeps their addresses. ``replay()`` runs them again in order: in-place and ``out=``
operations write the same tensors, functional ones copy their new result into the tensor
the recording produced, views and bare allocations are not rerun (their tensors are the
recorded ones already), and Triton kernels launch with the recorded grid and arguments.
An operation a capture cannot hold (a device value read on the host: ``.item()``,
``nonzero``, a data-dependent shape) raises ``GraphCaptureError`` while recording, as the
capture would fail on a GPU.

``EmulatedDecodeGraphs`` is core's ``DecodeGraphs`` recording instead of capturing
(``emulate_decode_graphs(runner, ...)`` installs it): a CPU test of everything a decode
graph replays (a LoRA kernel's captured plan, an attention backend's ``graph_plan``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tessellm.core.model.cuda_graphs import DecodeGraphs


class GraphCaptureError(RuntimeError):
    """An operation a CUDA graph capture cannot contain ran while recording."""


HOST_READS = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select", "aten::_unique2",
              "aten::unique_dim", "aten::unique_consecutive", "aten::equal", "aten::is_nonzero"}
"""Operations that read a device value on the host or size their output by the data: a
stream capture fails on them (or would freeze the value read)."""

ALLOCATIONS = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
               "aten::new_empty_strided"}
"""Operations that only allocate: a graph replays nothing for them (the memory is the pool's)."""


def _writes(func: Any) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _is_view(func: Any, args: tuple, kwargs: dict, leaves: list[Any]) -> bool:
    """Whether the output is memory an input already holds: an alias-returning operation
    that did alias (``to`` and friends return their input, or a converted copy)."""
    if not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
        return False
    inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    return all(leaf is None or leaf.numel() == 0 or leaf.untyped_storage().data_ptr() in inputs for leaf in leaves)


class _Recorder(TorchDispatchMode):
    """Runs every ATen operation and keeps the replayable ones in ``steps``."""

    def __init__(self, steps: list[Callable[[], None]]):
        super().__init__()
        self.steps = steps
        self.paused = 0  # > 0 while a recorded Triton launch runs its own host-side copies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        name = func._schema.name
        sized_by_data = (name == "aten::repeat_interleave" and func._overloadname == "Tensor" and
                         kwargs.get("output_size") is None) or (name == "aten::index" and _masked(args))
        if name in HOST_READS or sized_by_data:
            raise GraphCaptureError(f"{name} reads a device value on the host (or sizes its output by one) during "
                                    f"capture; a CUDA graph cannot hold it")
        leaves, _ = tree_flatten(out)
        if any(leaf is not None and not isinstance(leaf, torch.Tensor) for leaf in leaves):
            raise GraphCaptureError(f"{name} returned a host value during capture; a CUDA graph cannot hold it")
        if _writes(func):  # in place or out=: rerun as it is, on the same tensors
            self.steps.append(functools.partial(func, *args, **kwargs))
        elif name not in ALLOCATIONS and not _is_view(func, args, kwargs, leaves):
            self.steps.append(functools.partial(_rerun_into, func, args, kwargs, leaves))
        return out


def _masked(args: tuple) -> bool:
    """Whether an index operation selects by a boolean mask (as many rows as are true)."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _rerun_into(func: Any, args: tuple, kwargs: dict, recorded: list[torch.Tensor]) -> None:
    fresh, _ = tree_flatten(func(*args, **kwargs))
    for old, new in zip(recorded, fresh):
        if old is not None and old is not new:
            old.copy_(new)


@contextlib.contextmanager
def _triton_launches_recorded(steps: list[Callable[[], None]], recorder: _Recorder) -> Iterator[None]:
    """Every interpreted Triton launch kept with its grid and arguments (None to do when
    Triton is absent or compiled: nothing launches through the interpreter then)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        yield
        return
    original = InterpretedFunction.run

    def run(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        recorder.paused += 1
        try:
            result = original(fn, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            recorder.paused -= 1
        if not warmup:
            steps.append(functools.partial(original, fn, *args, grid=grid, warmup=False, **kwargs))
        return result

    InterpretedFunction.run = run
    try:
        yield
    finally:
        InterpretedFunction.run = original


class Recording:
    """What ran inside ``record()``, replayable as a CUDA graph replays its capture."""

    def __init__(self) -> None:
        self.steps: list[Callable[[], None]] = []
        self.inference_mode = False

    @contextlib.contextmanager
    def record(self) -> Iterator["Recording"]:
        self.inference_mode = torch.is_inference_mode_enabled()
        recorder = _Recorder(self.steps)
        with _triton_launches_recorded(self.steps, recorder), recorder:
            yield self

    def replay(self) -> None:
        with torch.inference_mode(self.inference_mode):
            for step in self.steps:
                step()


class EmulatedDecodeGraphs(DecodeGraphs):
    """``DecodeGraphs`` whose sizes are recorded and replayed (``Recording``), not captured:
    each size's forward runs once as the capture's warm-up does, then once recorded."""

    def _new_pool(self) -> Any:
        return None

    def _record(self, size: int, pool: Any, plan: Any, lora_plan: Any) -> Recording:
        self._forward(size, plan, lora_plan)
        recording = Recording()
        with recording.record():
            self._forward(size, plan, lora_plan)
        return recording


def emulate_decode_graphs(runner: Any, max_batch: int, max_model_len: int) -> EmulatedDecodeGraphs:
    """Give ``runner`` (a ``ModelRunner``) recorded decode graphs up to ``max_batch`` rows, as
    ``capture_graphs`` gives it captured ones on a GPU."""
    runner.graphs = EmulatedDecodeGraphs(runner.model, runner.backend, runner.cache, runner.device,
                                         max_batch=max_batch, max_model_len=max_model_len, lora=runner.lora)
    return runner.graphs
