"""One-stream decode steps on the CPU compiled as one graph (torch.compile, Inductor's C++
backend): the norms, rotary embedding, cache store, residual adds and activations of every
layer become a few fused C++ loops called from one compiled function, instead of a Python
call and a torch dispatch per small operation, which at one token a step cost about as much
as the weights' products.

Only steps of one sequence decoding one token are compiled: their shapes differ only by the
context length (dynamic in the graph), so one compile serves the whole stream. Other steps
(prefill, several sequences, drafts) run eagerly. The first such step compiles (tens of
seconds to minutes; torch caches the result on disk for later processes), then times the
compiled forward against the eager one on that same step (running a forward twice stores
the same keys and values in the same slots) and keeps the faster, logged. A compile or a
compiled call that fails falls back to eager for good, logged once.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

TIMED_CALLS = 5
"""Calls of each variant timed when choosing (after one untimed call each)."""


class CompiledDecode:
    """The choice between ``model``'s eager forward and its compiled form for one-stream
    decode steps: ``state`` is "untried" until the first such step, then "compiled" or
    "eager"."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.state = "untried"
        self.timings: dict[str, float] = {}
        """Median seconds of a forward, by variant, from the choosing step."""
        self._compiled: Callable | None = None

    @staticmethod
    def applies(batch, layers) -> bool:
        """Whether a step (no adapters in it) is one sequence decoding one token of a context
        of two or more through all layers: the compiled shape."""
        return layers is None and batch.num_seqs == 1 and batch.query_lens_cpu[0] == 1 \
            and batch.seq_lens_cpu[0] >= 2 and not batch.groups

    def run(self, call: Callable[[Callable], torch.Tensor]) -> torch.Tensor:
        """``call(forward)`` with the chosen forward (choosing on the first step)."""
        if self.state == "eager":
            return call(self.model)
        if self.state == "untried":
            return self._choose(call)
        try:
            return call(self._compiled)
        except Exception as error:  # a recompile torch cannot do: eager from now on
            self._give_up(f"a compiled decode step failed ({type(error).__name__}: {error})")
            return call(self.model)

    def _choose(self, call: Callable[[Callable], torch.Tensor]) -> torch.Tensor:
        try:
            self._compiled = torch.compile(self.model, dynamic=True)
            start = time.perf_counter()
            call(self._compiled)
            compile_s = time.perf_counter() - start
        except Exception as error:
            self._give_up(f"compiling the decode step failed ({type(error).__name__}: {error})")
            return call(self.model)
        self.timings = {name: median_seconds(lambda fn=fn: call(fn))
                        for name, fn in (("eager", self.model), ("compiled", self._compiled))}
        self.state = "compiled" if self.timings["compiled"] < self.timings["eager"] else "eager"
        logger.info("CPU decode step: compiled in %.1f s; a step takes %.2f ms compiled, %.2f ms eager: running %s",
                    compile_s, 1e3 * self.timings["compiled"], 1e3 * self.timings["eager"], self.state)
        return call(self.model if self.state == "eager" else self._compiled)

    def _give_up(self, why: str) -> None:
        logger.warning("%s; CPU decode steps run eagerly", why)
        self.state = "eager"
        self._compiled = None


def median_seconds(fn: Callable[[], object], calls: int = TIMED_CALLS, warmup: int = 1) -> float:
    """The median wall time of ``calls`` calls of ``fn()`` after ``warmup`` untimed ones (a
    compiled function builds, and caches and allocators fill, in the first): what a runtime
    choice between variants on this machine compares."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
