"""Where a Triton plugin can run: compiled on CUDA, and on a CPU only under Triton's
interpreter (``TRITON_INTERPRET=1``, set before the first kernel call), slowly, for tests.
Every plugin whose kernels are Triton answers ``unsupported_reasons`` with these."""

from __future__ import annotations

import importlib.util
import os

from tessellm.core.plugin import SelectionContext


def interpreting() -> bool:
    """Whether Triton kernels run interpreted on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_device_reasons(ctx: SelectionContext) -> list[str]:
    """Why a Triton plugin cannot serve ``ctx``'s device: Triton missing; a CPU under
    ``auto`` (interpreted kernels are for tests: such a plugin is only used there when
    named) or without the interpreter; a device that is neither CPU nor CUDA."""
    reasons = []
    if importlib.util.find_spec("triton") is None:
        reasons.append("needs triton, which is not installed")
    if ctx.device.type == "cpu" and ctx.auto:
        reasons.append("auto uses it on CUDA only (on a CPU it runs interpreted; name it to use it)")
    elif ctx.device.type == "cpu" and not interpreting():
        reasons.append("runs on CPU only under Triton's interpreter: set TRITON_INTERPRET=1 (slow; for testing)")
    elif ctx.device.type not in ("cpu", "cuda"):
        reasons.append(f"runs on cuda (or cpu under TRITON_INTERPRET=1), not {ctx.device.type}")
    return reasons
