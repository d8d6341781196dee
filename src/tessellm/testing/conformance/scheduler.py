"""The scheduler contract as properties of a whole engine on the tiny model: whatever the
arrival pattern and however small the cache, every admitted request finishes with the tokens
it would have had alone, and an abort gives back everything it held."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import given, strategies as st

from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.testing.conformance.base import ConformanceSuite, property_settings
from tessellm.testing.conformance.pipeline import (admitted_requests, build_llm, require_capacity, selection_context,
                                                   sequence_capacity)
from tessellm.testing.engine import run_arrivals


@st.composite
def arrivals(draw: Any, min_requests: int = 1, max_requests: int = 6, min_prompt: int = 1,
             capacity: int = 52) -> list[tuple[int, list[int], SamplingParams]]:
    """Requests of random prompts and lengths, arriving at random steps (greedy, EOS ignored
    so every request runs exactly ``max_tokens``); some with n > 1 samples. Prompt and
    output of each fit in ``capacity`` tokens (at least ``min_prompt + 1``)."""
    count = draw(st.integers(min_requests, max_requests))
    out = []
    for _ in range(count):
        prompt = draw(st.lists(st.integers(3, 250), min_size=min_prompt, max_size=min(40, capacity - 1)))
        new = draw(st.integers(1, min(12, capacity - len(prompt))))
        params = SamplingParams(max_tokens=new, ignore_eos=True, n=draw(st.sampled_from((1, 1, 2))))
        out.append((draw(st.integers(0, 6)), prompt, params))
    return out


class SchedulerConformance(ConformanceSuite):
    """The contract every scheduler honours (core/interfaces/scheduler.py), checked on the
    plugin named by ``plugin`` (or ``plugin_class``) with ``options``, in a real engine on
    ``tessellm_tiny_model`` with greedy decoding and ``cache``:

    - every admitted request finishes, whatever the arrival steps, with exactly its
      ``max_tokens`` tokens per sample, and greedy outputs equal to those of the request run
      alone (batching never changes a result);
    - with a cache too small for the whole load (``small_cache``), sequences are preempted
      and recomputed, and still nothing is lost: the same outputs;
    - aborting requests mid-run (some waiting, some running) frees every block they held:
      the cache's free blocks return to their number before the run, and the scheduler holds
      nothing.

    Every request fits the pipelines' declared capacities (``max_model_len``, the caches'
    ``max_seq_tokens``): a property never counts the rejection of a request that cannot fit
    as a failure; and a request the engine refuses at admission (``Engine.admit``: the
    decoder of ``engine`` refusing n > 1, say) is left out, the property skipped with the
    engine's reason when none is left.
    """

    kind = "scheduler"
    engine: ClassVar[dict[str, Any]] = {"device": "cpu", "dtype": "float32", "decoding": {"name": "greedy"}}
    cache: ClassVar[dict[str, Any]] = {"name": "paged", "options": {"block_size": 4, "num_blocks": 512}}
    small_cache: ClassVar[dict[str, Any]] = {"name": "paged", "options": {"block_size": 4, "num_blocks": 16}}
    max_examples: ClassVar[int] = 8

    @classmethod
    def _llm(cls, model: Path, cache: dict[str, Any]) -> Any:
        cls.require(selection_context(cls, model, cls.engine), "this pipeline")
        engine = {**cls.engine, "cache": cache}
        return build_llm(cls, model, engine, {"name": cls.under_test().name, "options": dict(cls.options)})

    @pytest.fixture(scope="class")
    @classmethod
    def llm(cls, tessellm_tiny_model: Path) -> Any:
        """The engine under test, with a cache large enough for any case (built once)."""
        return cls._llm(tessellm_tiny_model, cls.cache)

    @pytest.fixture(scope="class")
    @classmethod
    def small_llm(cls, tessellm_tiny_model: Path) -> Any:
        """The same engine over ``small_cache``: preemption is the only way through."""
        return cls._llm(tessellm_tiny_model, cls.small_cache)

    @staticmethod
    def alone(llm: Any, requests: list[tuple[int, list[int], SamplingParams]]) -> dict[str, list[list[int]]]:
        """Each request's outputs run by itself from an idle engine."""
        return {f"r{i}": run_arrivals(llm.engine, [(0, prompt, params)])["r0"]
                for i, (_, prompt, params) in enumerate(requests)}

    def check_all_finish_as_alone(self, llm: Any, reference: Any, requests: list) -> None:
        self.case()
        requests = admitted_requests(type(self), llm, requests)
        together = run_arrivals(llm.engine, requests)
        expected = self.alone(reference, requests)
        assert together.keys() == expected.keys(), \
            f"{self.label()}: requests {sorted(expected.keys() - together.keys())} never finished"
        for rid, (_, prompt, params) in zip(expected, requests):
            assert [len(s) for s in together[rid]] == [params.max_tokens] * params.n, \
                f"{self.label()}: {rid} (prompt {prompt}, {params.max_tokens} tokens, n={params.n}) " \
                f"finished with {[len(s) for s in together[rid]]} tokens"
            assert together[rid] == expected[rid], \
                f"{self.label()}: {rid} (prompt {prompt}) batched gave {together[rid]}, alone {expected[rid]}"

    def test_every_request_finishes_as_if_alone(self, llm: Any) -> None:
        capacity = require_capacity(self, llm, 2, "a one-token prompt and one new token")

        @given(arrivals(capacity=capacity))
        @property_settings(max_examples=self.max_examples)
        def run(requests: list) -> None:
            self.check_all_finish_as_alone(llm, llm, requests)

        run()

    def test_preemption_loses_nothing(self, llm: Any, small_llm: Any) -> None:
        capacity = min(require_capacity(self, small_llm, 17, "a 16-token prompt and one new token"),
                       sequence_capacity(llm))

        @given(arrivals(min_requests=4, max_requests=8, min_prompt=16, capacity=capacity))
        @property_settings(max_examples=self.max_examples)
        def run(requests: list) -> None:
            self.check_all_finish_as_alone(small_llm, llm, requests)

        run()
        preempted = small_llm.engine.stats.preemptions
        if not preempted:
            pytest.skip(f"{self.label()}: no case needed preemption with small_cache {self.small_cache}; "
                        f"give a smaller one")

    def test_abort_frees_everything(self, llm: Any) -> None:
        capacity = require_capacity(self, llm, 2, "a one-token prompt and one new token")

        @given(arrivals(capacity=capacity), st.integers(0, 4), st.data())
        @property_settings(max_examples=self.max_examples)
        def run(requests: list, steps: int, data: Any) -> None:
            self.case()
            engine, cache = llm.engine, llm.pipeline.cache
            requests = admitted_requests(type(self), llm, requests)
            free = cache.num_free_blocks
            for i, (_, prompt, params) in enumerate(requests):
                engine.add_request(f"a{i}", prompt, params)
            for _ in range(steps):
                engine.step()
            doomed = data.draw(st.lists(st.sampled_from([f"a{i}" for i in range(len(requests))]), unique=True))
            for rid in doomed:
                engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
            for rid in list(engine.requests):  # finished and not yet collected
                engine.pop_finished(rid)
            assert cache.num_free_blocks == free, \
                f"{self.label()}: after aborting {doomed} of {len(requests)} requests at step {steps}, " \
                f"{free - cache.num_free_blocks} blocks are still held"
            assert not llm.pipeline.scheduler.unfinished(), \
                f"{self.label()}: the scheduler still holds {llm.pipeline.scheduler.unfinished()} after the aborts"

        run()
