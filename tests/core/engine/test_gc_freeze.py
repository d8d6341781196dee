"""``frozen_heap`` (core/engine/gc_freeze.py): the heap is frozen while the engine steps, and only then."""

from __future__ import annotations

import gc

import pytest

from tessellm import LLM
from tessellm.core.engine.engine import Engine
from tessellm.core.engine.gc_freeze import frozen_heap


def _is_frozen(obj) -> bool:
    """Whether a tracked object sits in the collector's permanent generation, which
    ``gc.get_objects()`` leaves out. (Counts alone would be flaky: a frozen object freed by
    another thread, or by the context manager's own bookkeeping, lowers the count.)"""
    assert gc.is_tracked(obj)
    return not any(o is obj for o in gc.get_objects())


def test_frozen_heap_nests_and_always_unfreezes():
    gc.unfreeze()
    at_entry = [object()]  # a tracked container alive at entry
    with frozen_heap():
        assert gc.get_freeze_count() > 0 and _is_frozen(at_entry)
        between = [object()]  # created after the outer freeze
        with frozen_heap():  # nested: nothing refrozen, nothing unfrozen on the inner exit
            assert not _is_frozen(between)
        assert _is_frozen(at_entry) and not _is_frozen(between)
    assert gc.get_freeze_count() == 0 and not _is_frozen(at_entry)
    with pytest.raises(RuntimeError):
        with frozen_heap():
            raise RuntimeError("a failed step")
    assert gc.get_freeze_count() == 0  # a failure inside does not leave the heap frozen


def test_a_heap_partly_frozen_by_someone_else_is_frozen_whole_and_stays_frozen():
    gc.unfreeze()
    theirs = [[i] for i in range(10)]
    gc.freeze()  # e.g. a server before forking its workers, or a library freezing its own objects
    try:
        ours = [[i] for i in range(1000)]  # the pipeline, loaded after their freeze
        with frozen_heap():
            assert _is_frozen(ours) and _is_frozen(ours[-1])  # ours frozen too
        assert _is_frozen(theirs[0]) and _is_frozen(ours)  # theirs not unfrozen behind their back
    finally:
        gc.unfreeze()
    assert theirs and ours


def test_generate_steps_with_the_heap_frozen_and_cycles_are_collected_after(tiny_model, cpu_config, monkeypatch):
    llm = LLM(cpu_config(tiny_model("llama")))
    counts = []
    real_step = Engine.step
    monkeypatch.setattr(Engine, "step", lambda self: counts.append(gc.get_freeze_count()) or real_step(self))
    gc.unfreeze()

    class Cycle:
        pass

    cycle = Cycle()
    cycle.me = cycle  # cyclic garbage created before the run: frozen during it, collected after
    collected = []
    import weakref
    ref = weakref.ref(cycle, lambda _: collected.append(True))
    del cycle
    llm.generate([[5, 6, 7]], {"max_tokens": 3, "ignore_eos": True})
    assert counts and all(c > 0 for c in counts)
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None and collected


def test_a_long_collector_pass_while_stepping_is_logged(monkeypatch, caplog):
    """A pass longer than SLOW_PASS_S inside frozen_heap is a warning naming its length,
    generation and the frozen count; outside, the callback is gone."""
    import logging

    from tessellm.core.engine import gc_freeze as heap

    monkeypatch.setattr(heap, "SLOW_PASS_S", -1.0)  # every pass counts as long
    with caplog.at_level(logging.WARNING, logger="tessellm.core.engine.gc_freeze"):
        with frozen_heap():
            gc.collect(2)
        assert any("paused the engine" in r.getMessage() and "generation 2" in r.getMessage()
                   for r in caplog.records)
        caplog.clear()
        gc.collect()
        assert not caplog.records
    assert heap._slow_pass_log not in gc.callbacks
