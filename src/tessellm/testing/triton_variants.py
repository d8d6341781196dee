"""The Triton kernel variants a piece of code would compile on a GPU, found on a CPU.

Triton compiles one binary per variant of a kernel: its constexpr values, its launch options
(warps, stages) and the specialisation of every other argument (an integer that is 1 or a
multiple of 16, a pointer aligned to 16 bytes, 32- or 64-bit). A variant first met in the
middle of serving stalls that step for the compile. ``VariantRecorder`` computes, for each
launch, the key Triton's own binder would build for a CUDA GPU, so a test can check on a
machine without one that start-up warm-up launches every variant a run does::

    with VariantRecorder(triton_kernels(prefill, decode)) as rec:  # modules holding kernels
        warm_up(runner, ...)                                        # tessellm.core.engine.warm_up
        warm = set(rec.seen)
        llm.generate(...)
    assert rec.seen <= warm

It works on kernels run by Triton's interpreter (``TRITON_INTERPRET=1``) and on compiled
ones (both accept pre-run hooks).

With kernels not interpreted, ``recorded_launches`` and ``compile_launch`` go one step
further: they record a wrapper's launches on CPU tensors and compile each for the GPU, and
``resources`` reads the result's registers, spills and shared memory
(bench/compile_hopper.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from types import ModuleType
from typing import Any, Iterable, Iterator

VariantKey = tuple[str, tuple, tuple]
"""(kernel name, per-argument specialisation, launch options)."""


def hopper_backend(arch: int = 90, warp_size: int = 32) -> Any:
    """Triton's compiler backend for a CUDA GPU of compute capability ``arch`` (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    return make_backend(GPUTarget("cuda", arch, warp_size))


def _binder(kernel: Any, backend: Any) -> Any:
    """Triton's own argument binder for ``kernel``: args -> (bound, specialisation, options).
    An interpreted kernel keeps the decorator's options; its JIT view is rebuilt from them."""
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    return create_function_from_signature(jit.signature, jit.params, backend)


def triton_kernels(*modules: ModuleType) -> list[Any]:
    """Every ``@triton.jit`` kernel defined at the top level of ``modules`` (helpers that are
    only called from other kernels are included; they are simply never launched)."""
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime.interpreter import InterpretedFunction
        kinds: tuple[type, ...] = (JITFunction, InterpretedFunction)
    except ImportError:  # pragma: no cover - every supported Triton has the interpreter
        kinds = (JITFunction,)
    return [v for m in modules for v in vars(m).values() if isinstance(v, kinds)]


class VariantRecorder:
    """Records the variant key of every launch of ``kernels`` while active.

    ``seen`` is the set of keys, ``launches`` the key of each launch in order. Keys are those
    of a CUDA GPU of compute capability ``arch`` (90: Hopper) with ``warp_size`` lanes.
    """

    def __init__(self, kernels: Iterable[Any], arch: int = 90, warp_size: int = 32):
        self.kernels = list(kernels)
        self.backend = hopper_backend(arch, warp_size)
        self.seen: set[VariantKey] = set()
        self.launches: list[VariantKey] = []
        self._hooks: list[tuple[Any, Any]] = []

    def __enter__(self) -> "VariantRecorder":
        for kernel in self.kernels:
            binder = _binder(kernel, self.backend)
            name = kernel.fn.__name__

            def hook(*args: Any, _binder: Any = binder, _name: str = name, **kwargs: Any) -> None:
                options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages", "num_ctas")}
                params = {k: v for k, v in kwargs.items() if k not in options and k not in ("grid", "warmup")}
                _, specialization, _ = _binder(*args, **params)
                key = (_name, tuple(tuple(s) if isinstance(s, list) else s for s in specialization),
                       tuple(sorted(options.items())))
                self.seen.add(key)
                self.launches.append(key)

            kernel.add_pre_run_hook(hook)
            self._hooks.append((kernel, hook))
        return self

    def __exit__(self, *exc: Any) -> None:
        for kernel, hook in self._hooks:
            kernel.pre_run_hooks.remove(hook)
        self._hooks.clear()

    def names(self, keys: Iterable[VariantKey] | None = None) -> set[str]:
        """The kernel names among ``keys`` (default: every key seen)."""
        return {k[0] for k in (self.seen if keys is None else keys)}


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[tuple[Any, tuple, dict]]]:
    """While active, ``kernel[grid](...)`` on a compiled (not interpreted) kernel records
    ``(kernel, args, kwargs)`` instead of launching, so wrappers run on CPU tensors."""
    from triton.runtime.jit import JITFunction

    launches: list[tuple[Any, tuple, dict]] = []
    real = JITFunction.__getitem__
    JITFunction.__getitem__ = lambda self, grid: lambda *args, **kwargs: launches.append((self, args, kwargs))
    try:
        yield launches
    finally:
        JITFunction.__getitem__ = real


def compile_launch(kernel: Any, args: tuple, kwargs: dict, arch: int = 90) -> Any:
    """The variant a recorded launch needs, compiled for a CUDA GPU of ``arch``, as Triton
    would compile it on that GPU."""
    import triton
    from triton.compiler import ASTSource

    backend = hopper_backend(arch)
    bound, specialization, options = _binder(kernel, backend)(*args, **kwargs)
    opts, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=backend.target,
                          options=opts.__dict__)


def resources(compiled: Any) -> dict[str, int]:
    """Registers per thread, stack (spilled) bytes, shared memory, and the PTX's counts of
    wgmma and mma.sync tensor-core instructions, TMA bulk copies, cp.async copies and
    conversions (``cvt`` and ``prmt``, Triton's byte shuffle for int8 -> 16-bit), read from
    the cubin with Triton's bundled cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    usage = dict(re.findall(r"(REG|STACK):(\d+)", text))
    ptx = compiled.asm["ptx"]
    return {"registers": int(usage.get("REG", -1)), "stack_bytes": int(usage.get("STACK", -1)),
            "shared_bytes": compiled.metadata.shared,
            "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
            "tma_loads": ptx.count("cp.async.bulk.tensor"), "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
            "conversions": len(re.findall(r"^\s*(?:cvt|prmt)\.", ptx, re.M))}


def launch_hooks_only(kernel: Any) -> Any:
    """A replacement for an interpreted ``kernel``'s ``run``: each launch calls the kernel's
    pre-run hooks (where ``VariantRecorder`` computes the key, from the same arguments) and
    runs nothing, so a wrapper can be driven on tensors that hold no data (meta) or without
    the interpreter's cost. ``monkeypatch.setattr(kernel, "run", launch_hooks_only(kernel))``."""
    import inspect

    names = set(inspect.signature(kernel.fn).parameters)

    def run(*args: Any, grid: Any, warmup: bool = False, **kwargs: Any) -> None:
        if not warmup:  # the interpreter's GridExecutor passes the hooks the kernel's own arguments only
            kwargs = {k: v for k, v in kwargs.items() if k in names}
            for hook in kernel.pre_run_hooks:
                hook(*args, **kwargs)

    return run
