"""Build-at-first-use of the C++ kernels beside this file, cached in tessellm's cache folder.

The library is compiled by ``torch.utils.cpp_extension.load`` (ninja and the machine's C++
compiler) into ``<cache>/cpu-kernels/<name>-<hash>``: the hash covers the sources, torch's
version and the compiler flags, so an edit or a new torch builds afresh and a stale library
is never loaded. Concurrent builds in several processes wait on cpp_extension's lock.
``TESSELLM_CPU_KERNELS=0`` turns the kernels off (torch's paths everywhere);
``TESSELLM_CPU_ISA`` caps the instruction-set variant the library picks by CPUID.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import SimpleNamespace

import torch

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = ("int8_dot.cpp",)
HEADERS = ("int8_dot_body.h",)
CFLAGS = ("-O3", "-fno-math-errno", "-ffp-contract=off")
"""No -march: every instruction set's variant is compiled in its own target region and the
CPU's is chosen when the library loads, so one build serves any x86-64 CPU. No contraction
of a multiply and an add into one rounding where the code does not ask for it: the
activations' int8 digits must equal the torch reference's bit for bit."""


def build_dir(name: str) -> Path:
    """Where ``name``'s build goes: the cache folder, keyed by sources, torch and flags."""
    from tessellm.core.model.loader import default_cache_dir

    digest = hashlib.sha256()
    for file in SOURCES + HEADERS:
        digest.update((HERE / file).read_bytes())
    digest.update(f"{torch.__version__} {CFLAGS} {platform.machine()}".encode())
    return default_cache_dir() / "cpu-kernels" / f"{name}-{digest.hexdigest()[:16]}"


ISA_CAPS = ("avx2", "avx-vnni", "avx512-vnni")
"""What ``TESSELLM_CPU_ISA`` may name: the most capable variant the library may choose (the
CPU's best up to it; unset: the CPU's best)."""


def unavailable_reason() -> str | None:
    """Why the kernels cannot be built here before trying (None: try)."""
    if os.environ.get("TESSELLM_CPU_KERNELS", "1") == "0":
        return "TESSELLM_CPU_KERNELS=0"
    isa = os.environ.get("TESSELLM_CPU_ISA")
    if isa is not None and isa not in ISA_CAPS:
        return f"TESSELLM_CPU_ISA={isa!r} is not one of {', '.join(ISA_CAPS)}"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU is {platform.machine()}, not x86-64"
    return None


why_unavailable: str | None = None
"""Why the last ``kernels()`` found none (None while they load or before the first call)."""


@functools.lru_cache(maxsize=None)
def kernels() -> SimpleNamespace | None:
    """The loaded ops (``torch.ops.tessellm_cpu``) and the instruction set they run
    (``isa``), or None where they cannot run here; the reason is logged once (and kept in
    ``why_unavailable``). Built at most once per cache key, loaded once per process."""
    global why_unavailable
    why_unavailable = None
    reason = unavailable_reason()
    if reason is None:
        try:
            ops = _load()
            isa = ops.isa()
            if isa:
                logger.info("tessellm CPU kernels: int8 dot products with %s", isa)
                return SimpleNamespace(ops=ops, isa=isa)
            reason = "this CPU has no AVX2 and FMA"
        except Exception as error:  # no compiler, no ninja, a failed build: torch's paths remain
            reason = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
    why_unavailable = reason
    logger.warning("tessellm CPU int8 dot-product kernels unavailable (%s); using torch's kernels", reason)
    return None


def _load():
    if not hasattr(torch.ops, "tessellm_cpu") or not hasattr(torch.ops.tessellm_cpu, "isa"):
        from torch.utils.cpp_extension import load

        folder = build_dir("tessellm_int8_dot")
        folder.mkdir(parents=True, exist_ok=True)
        load("tessellm_int8_dot", [str(HERE / f) for f in SOURCES], extra_cflags=list(CFLAGS),
             build_directory=str(folder), is_python_module=False, verbose=False)
        _register_fakes()
    return torch.ops.tessellm_cpu


def _register_fakes() -> None:
    """Shapes of the ops' outputs without running them, so a compiled graph can call them."""
    def matmul(x, weight, *args):
        return x.new_empty(x.shape[0], weight.shape[0])

    torch.library.register_fake("tessellm_cpu::int4_matmul", matmul)
    torch.library.register_fake("tessellm_cpu::int8_matmul", matmul)

    @torch.library.register_fake("tessellm_cpu::quantize_rows")
    def quantize_rows(x, deinterleave, digits):
        m, k = x.shape
        return (x.new_empty(m, k, dtype=torch.int8), x.new_empty(m, k, dtype=torch.int8), x.new_empty(m, k // 32),
                x.new_empty(m, k // 32))
