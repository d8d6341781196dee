"""The Triton kernel variants a piece of code would compile on a GPU, found on a CPU.

Triton compiles one binary per variant of a kernel: its constexpr values, its launch options
(warps, stages) and the specialisation of every other argument (an integer that is 1 or a
multiple of 16, a pointer aligned to 16 bytes, 32- or 64-bit). A variant first met in the
middle of serving stalls that step for the compile. ``VariantRecorder`` computes, for each
launch, the key Triton's own binder would build for a CUDA GPU, so a test can check on a
machine without one that start-up warm-up launches every variant a run does::

    with VariantRecorder(triton_kernels(flash_kernels)) as rec:
        runner.warm_up(...)
        warm = set(rec.seen)
        llm.generate(...)
    assert rec.seen <= warm

It works on kernels run by Triton's interpreter (``TRITON_INTERPRET=1``) and on compiled
ones (both accept pre-run hooks).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Iterable

VariantKey = tuple[str, tuple, tuple]
"""(kernel name, per-argument specialisation, launch options)."""


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
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.kernels = list(kernels)
        self.backend = make_backend(GPUTarget("cuda", arch, warp_size))
        self.seen: set[VariantKey] = set()
        self.launches: list[VariantKey] = []
        self._hooks: list[tuple[Any, Any]] = []

    def _binder(self, kernel: Any) -> Any:
        from triton.runtime.jit import JITFunction, create_function_from_signature

        # an interpreted kernel keeps the decorator's options; rebuild the JIT view of it
        jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
        return create_function_from_signature(jit.signature, jit.params, self.backend)

    def __enter__(self) -> "VariantRecorder":
        for kernel in self.kernels:
            binder = self._binder(kernel)
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
