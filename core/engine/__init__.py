"""The engine: request state (request.py), batch building (batch_builder.py), the step
(engine.py) and the overlapped step (overlap.py), what happens to tokens (outputs.py), fault
isolation (faults.py), counters (stats.py), start-up warm-up (warm_up.py), the collector
freeze (gc_freeze.py), and the ``Pipeline`` and ``LLM`` facades (pipeline.py, llm.py)."""

from tessellm.core.compat import package_getattr

__getattr__ = package_getattr(__name__)  # names of the module this package replaced (deprecated)
