"""Keeping the garbage collector's full passes short while the engine steps.

Python's cyclic collector runs a full pass over every tracked object once enough objects
have survived its younger passes. A loaded pipeline holds hundreds of thousands of them (the
model's modules, the tokenizer, transformers and torch themselves), and a full pass over
them takes tens to hundreds of milliseconds (bench/host_overhead.py --heap times it). An
engine step creates per-sequence objects that live a step or two (a batch's sample slots,
the in-flight step under async scheduling); enough of them survive that a run of decode
steps triggers such passes every few dozen steps. On a GPU, where a step takes a few
milliseconds, that is a stall of dozens of steps each time.

``frozen_heap()`` moves every object alive when the stepping starts into the collector's
permanent generation (``gc.freeze``) and back when it ends (``gc.unfreeze``), so full passes
during the run scan only what the run created. Nothing is lost: objects still die by
reference counting as usual, and cyclic garbage among the frozen objects is collected after
the run. vLLM's engine freezes its start-up heap the same way. Passes that still take long
meanwhile are logged (``SLOW_PASS_S``).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_depth = 0
_owned = False  # whether the outermost frozen_heap froze the heap (and so unfreezes it)

SLOW_PASS_S = 0.05
"""A collector pass longer than this while the engine steps is logged as a warning: with the
heap frozen a pass should take well under a millisecond, so a long one is a stall worth
knowing of (how long, which generation, what it collected, how much was frozen)."""


class _SlowPassLog:
    """A ``gc.callbacks`` entry that warns of passes longer than ``SLOW_PASS_S``."""

    def __init__(self) -> None:
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        took = time.perf_counter() - self._start
        if took > SLOW_PASS_S:
            logger.warning("the garbage collector paused the engine for %.0f ms (generation %d, %d objects "
                           "collected, %d frozen)", took * 1e3, info["generation"], info["collected"],
                           gc.get_freeze_count())


_slow_pass_log = _SlowPassLog()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the heap for the duration, and warn of any collector pass longer than
    ``SLOW_PASS_S`` meanwhile. Nestable and thread-safe: the outermost exit unfreezes. Where
    someone else had already frozen part of the heap (a server that froze before forking its
    workers; a library that freezes a few hundred objects of its own), the pipeline's objects
    are frozen all the same (their freeze need not cover them), and the heap stays frozen
    after the exit: Python cannot unfreeze only ours, and unfreezing theirs would undo what
    they froze for."""
    global _depth, _owned
    with _lock:
        if _depth == 0:
            _owned = gc.get_freeze_count() == 0
            gc.freeze()
            gc.callbacks.append(_slow_pass_log)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.callbacks.remove(_slow_pass_log)
                if _owned:
                    gc.unfreeze()
                    _owned = False


class CollectorClock:
    """While active (a context manager): the garbage collector's passes, its full passes
    (``full``), the seconds they took and the longest one's, through ``gc.callbacks``. For
    benchmarks."""

    def __init__(self) -> None:
        self.seconds, self.longest, self.passes, self.full, self._start = 0.0, 0.0, 0, 0, 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            took = time.perf_counter() - self._start
            self.seconds += took
            self.longest = max(self.longest, took)
            self.passes += 1
            self.full += info["generation"] == 2

    def __enter__(self) -> "CollectorClock":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self)
