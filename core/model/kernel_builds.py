"""Counting Triton kernel builds, so a compile inside a serving or benchmark run shows.

Triton compiles a kernel once per *variant*: its constexpr values, launch options and the
specialisation of its other arguments (an integer equal to 1 or divisible by 16, a pointer
aligned to 16 bytes). A variant first met mid-run stalls that step for the compile, from a
few hundred milliseconds to seconds; on a GPU it can cost more than a thousand decode steps.
The engine warms its kernels up at start-up (``ModelRunner.warm_up``) so this should not
happen; ``KernelBuildLog`` makes it visible when it does (``EngineStats.kernel_builds``,
the benchmark reports, a log line naming the kernel).

It listens on Triton's ``jit_cache_hook`` (``triton.knobs.runtime``, Triton 3.4 and later),
which fires once for every variant new to this process, whether Triton then compiles it or
loads it from its on-disk cache. An earlier hook someone else installed keeps being called.
Under ``TRITON_INTERPRET=1`` nothing is compiled and nothing is counted.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

logger = logging.getLogger(__name__)


class KernelBuildLog:
    """Process-wide count of Triton kernel variants built, by kernel name.

    ``total`` only grows; callers compare it before and after a span of work.
    ``install()`` is idempotent and returns False where Triton (or its hook) is missing.
    """

    def __init__(self) -> None:
        self.total = 0
        self.by_kernel: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._installed = False
        self._previous: Any = None

    def install(self) -> bool:
        with self._lock:
            if self._installed:
                return True
            try:
                from triton import knobs
            except ImportError:
                return False
            runtime = getattr(knobs, "runtime", None)
            if runtime is None or not hasattr(runtime, "jit_cache_hook"):
                return False
            self._previous = runtime.jit_cache_hook
            runtime.jit_cache_hook = self._hook
            self._installed = True
            return True

    def _hook(self, *args: Any, **kwargs: Any) -> Any:
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or "triton kernel"
        with self._lock:
            self.total += 1
            self.by_kernel[name] += 1
        # a previous hook may skip the compile (returns True); its answer stands
        return self._previous(*args, **kwargs) if self._previous is not None else None


build_log = KernelBuildLog()
"""The one log of this process (Triton has one hook slot)."""
