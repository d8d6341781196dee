"""Serving benchmark: a workload's requests sent to a running OpenAI-compatible server, as
Poisson arrivals at a request rate or at a fixed concurrency, each streamed and timed.

``run_serving(url, requests, ...)`` returns the same ``BenchResult`` as the offline run
(TTFT, TPOT and end-to-end latency per request, from the moment each request was due to be
sent), so reports, JSON and plots are shared. Requests go to /v1/completions as token ids
with ``ignore_eos`` (tessellm's extension, as vLLM's), so each produces exactly its output
length; the token count is the server's own (the usage chunk).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from tessellm.bench.offline import BenchResult, RequestTiming
from tessellm.bench.workloads import BenchRequest
from tessellm.core.errors import TessellmError
from tessellm.extras import require


class ServingError(TessellmError, RuntimeError):
    """The server could not be reached, answered a request with an error, or broke a stream."""


async def _one(client: Any, url: str, model: str, r: BenchRequest, due: float, headers: dict) -> RequestTiming:
    body = {"model": model, "prompt": r.prompt_token_ids, "max_tokens": r.output_len, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": r.ignore_eos}
    first = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise ServingError(f"request {r.request_id}: HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise ServingError(f"request {r.request_id}: {event['error']['message']}")
            if event.get("choices") and first is None:
                first = time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    return RequestTiming(len(r.prompt_token_ids), tokens, None if first is None else first - due,
                         (end - first) / (tokens - 1) if first is not None and tokens > 1 else None, end - due)


async def _run(url: str, requests: list[BenchRequest], model: str, rate: float | None, concurrency: int | None,
               seed: int, api_key: str | None, progress: bool) -> BenchResult:
    httpx = require("httpx", "bench")

    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, len(requests)) if rate else np.zeros(len(requests))
    gaps[0] = 0.0
    offsets = np.cumsum(gaps)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(concurrency or len(requests))
    bar = tqdm(total=len(requests), desc="serving", unit="req", disable=not progress, leave=False)
    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()

        async def scheduled(r: BenchRequest, offset: float) -> RequestTiming:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with limit:  # at a fixed concurrency a request is due when a slot frees up
                due = max(start + offset, time.perf_counter()) if concurrency else start + offset
                timing = await _one(client, url, model, r, due, headers)
            bar.update(1)
            return timing

        try:
            timings = await asyncio.gather(*(scheduled(r, float(o)) for r, o in zip(requests, offsets)))
        except httpx.HTTPError as exc:  # unreachable, refused, dropped mid-stream
            raise ServingError(f"cannot benchmark {url}: {type(exc).__name__}: {exc or 'no detail'}; is "
                               f"`tessellm serve` running there?") from None
        elapsed = time.perf_counter() - start
    bar.close()
    return BenchResult(list(timings), elapsed)


def run_serving(url: str, requests: list[BenchRequest], *, model: str, request_rate: float | None = None,
                max_concurrency: int | None = None, seed: int = 0, api_key: str | None = None,
                progress: bool = False) -> BenchResult:
    """Send ``requests`` to the server at ``url``: Poisson arrivals at ``request_rate``
    requests/s (None: all at once), at most ``max_concurrency`` in flight (None: no limit)."""
    return asyncio.run(_run(url.rstrip("/"), requests, model, request_rate, max_concurrency, seed, api_key,
                            progress))


def goodput(result: BenchResult, ttft_ms: float | None, tpot_ms: float | None) -> dict[str, Any]:
    """Requests per second that met both latency objectives (DistServe's goodput)."""
    ok = [r for r in result.requests
          if (ttft_ms is None or (r.ttft_s is not None and r.ttft_s * 1000 <= ttft_ms))
          and (tpot_ms is None or r.tpot_s is None or r.tpot_s * 1000 <= tpot_ms)]
    return {"slo_ttft_ms": ttft_ms, "slo_tpot_ms": tpot_ms, "requests_meeting_slo": len(ok),
            "goodput_rps": round(len(ok) / result.elapsed_s, 4)}
