"""Driving an engine the way a server would: requests arriving at given steps."""

from __future__ import annotations

from typing import Any


def run_arrivals(engine: Any, requests: list[tuple], max_steps: int = 3_000) -> dict[str, list[list[int]]]:
    """Add request i as ``"r{i}"`` at its arrival step and step until every request finishes.

    ``requests[i]`` is ``(arrival_step, prompt_token_ids, params)`` or ``(arrival_step,
    prompt_token_ids, params, priority)``. Returns each request's output token ids, one list
    per sample in sample order. Requests left over from an earlier failed run are aborted
    first, so ids can be reused; more than ``max_steps`` steps is an AssertionError (a hang).
    """
    for request_id in list(engine.requests):
        engine.abort(request_id)
    pending = sorted(enumerate(requests), key=lambda r: r[1][0])
    outputs: dict[str, list[list[int]]] = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params, *rest) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params, priority=rest[0] if rest else 0)
        for state in engine.step():
            done = engine.pop_finished(state.request_id)
            outputs[state.request_id] = [s.output_token_ids for s in sorted(done.seqs, key=lambda s: s.sample_index)]
        step += 1
        assert step < max_steps, f"{len(pending)} requests waiting to arrive, engine still busy after {step} steps"
    return outputs
