"""float32 on CUDA is float32: a check, on a CPU, that Triton kernels given float32 inputs
run their dots in IEEE float32, not TF32.

Compiled for a GPU, ``tl.dot`` on float32 operands rounds them to TF32 (a 10-bit mantissa)
unless told ``input_precision="ieee"``; Triton's interpreter computes every dot in full
float32 whatever it is told, so a CPU test holding a kernel to its reference cannot see the
difference, and a float32 model on a GPU silently drifts from transformers'.
``float32_dots_checked()`` watches interpreted launches instead: in a launch whose
floating-point tensor arguments are all float32 (a float32 model's), every dot of float32
operands must ask for IEEE precision, or the launch raises ``TF32DotError`` naming the
kernel. A launch with 16-bit tensors among its arguments may dot float32 intermediates at
TF32 (a bfloat16 model's LoRA expand does, by design). tests/conftest.py turns the check on
for every test run under the interpreter.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


class TF32DotError(AssertionError):
    """A float32 launch computed a dot at TF32 precision."""


_launches: list[dict[str, Any]] = []  # the interpreted launches under way (innermost last)


def _all_float32(values: Any) -> bool:
    floats = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return bool(floats) and all(v.dtype == torch.float32 for v in floats)


@contextlib.contextmanager
def float32_dots_checked() -> Iterator[None]:
    """Within it, an interpreted Triton launch whose floating-point tensors are all float32
    raises ``TF32DotError`` if a dot of float32 operands ran at TF32 (or TF32x3) precision.
    Nothing is checked where Triton is absent or compiles for a GPU."""
    try:
        from triton._C.libtriton import ir
        from triton.runtime.interpreter import GridExecutor, InterpreterBuilder
    except ImportError:
        yield
        return
    ieee = ir.INPUT_PRECISION.IEEE
    launch, create_dot = GridExecutor.__call__, InterpreterBuilder.create_dot

    def checked_launch(executor: Any, *args: Any, **kwargs: Any) -> Any:
        state = {"float32": _all_float32([*args, *kwargs.values()]), "tf32": 0}
        _launches.append(state)
        try:
            result = launch(executor, *args, **kwargs)
        finally:
            _launches.pop()
        if state["tf32"]:
            name = getattr(executor.fn, "__name__", "a kernel")
            raise TF32DotError(f"Triton kernel {name} ran {state['tf32']} dot(s) of float32 operands at TF32 precision "
                               f"in a launch whose floating-point inputs are all float32: pass "
                               f"input_precision=\"ieee\" to tl.dot when the inputs are float32")
        return result

    def checked_dot(builder: Any, a: Any, b: Any, d: Any, input_precision: Any, *rest: Any) -> Any:
        state = _launches[-1] if _launches else None
        if state is not None and state["float32"] and a.dtype.is_fp32() and b.dtype.is_fp32() and \
                input_precision != ieee:
            state["tf32"] += 1
        return create_dot(builder, a, b, d, input_precision, *rest)

    GridExecutor.__call__, InterpreterBuilder.create_dot = checked_launch, checked_dot
    try:
        yield
    finally:
        GridExecutor.__call__, InterpreterBuilder.create_dot = launch, create_dot
