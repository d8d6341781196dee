"""The server against the offline engine at GPU step rates, on the CPU: a stub model whose
forward takes a fixed time (``--step-ms``, 2.5 ms: an H200's decode step for 256 sequences of
Llama-3.2-1B shapes, ../shared/gpu/h200-2026-11-28/e2e.json) and returns fixed logits
(src/tessellm/testing/stub_model.py). Everything else is the real engine and server.

For each client count N (64, 256, 512), rounds alternate:

- offline: ``LLM.generate`` of N token-id prompts (``--prompt-len``), ``--max-tokens`` each,
  ``ignore_eos``, in this process;
- server: N concurrent streaming clients of ``tessellm serve`` (one server for the whole
  run, a subprocess, its ``max_num_seqs`` 512), each one /v1/completions request of the same
  prompt and length, sent at once over raw sockets (the client parses no event: it counts
  bytes, takes the time of the first event and reads the usage of the last).

Reported per N (medians over ``--rounds``): output tokens/s of each and their ratio (the
whole run: the server admits its N requests over HTTP while it steps the first ones, the
offline engine all at once), TTFT (p50, p99), and the host time per engine step by phase (the engine's own counters, from the
server's /metrics: schedule, prepare, forward with the stub's sleep, sample, process, output
to the streams) with the CPU seconds per step of the engine loop, of the API side and of the
clients (this process; on uvloop where it is installed, as the server is), the offline
engine's phases per step, the events each stream got (``events_per_stream``: fewer than
its tokens where the API side fell behind and merged them) and the output tokens per CPU
second of the API process (``api_tok_per_cpu_s``, at that merging: an API side with more
CPU writes more, smaller events). On a machine with fewer cores than the three processes,
the client, the API process and the engine core share them, and the server's rate is bounded
by their CPU seconds together.

    flock -x /tmp/tessellm-cpu.lock .venv/bin/python bench/serve_stub.py --json bench/results/serve_stub_cpu.json
    .venv/bin/python bench/serve_stub.py --clients 8 --max-tokens 8 --rounds 1    # the code path only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

# one torch thread everywhere: the stub's own tensors are tiny, and the processes (this one's
# engine or client, the server's API side and its engine core) share the cores
STUB_ENV = {"TESSELLM_PLUGINS": "tessellm.testing.stub_model", "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1"}
os.environ.update(STUB_ENV)  # this process's offline engine loads the stub too

from tessellm import LLM  # noqa: E402
from tessellm.core.model.loader import model_folder, resolve_model  # noqa: E402
from tessellm.bench.offline import cpu_name  # noqa: E402
from tessellm.testing.serving import ServeProcess  # noqa: E402
from tessellm.testing.stub_model import make_stub_model, stub_config  # noqa: E402

VOCAB = 512
MODEL = "stub"


def pipeline_config(folder: Path, step_ms: float) -> dict:
    # flash's plan is what a GPU step plans; its kernels never run (the stub attends to nothing)
    return stub_config(folder, step_ms=step_ms, max_seqs=512, num_blocks=65536, attention={"name": "flash"})


def prompts(n: int, length: int) -> list[list[int]]:
    return [[(i * 31 + j * 7) % (VOCAB - 3) + 3 for j in range(length)] for i in range(n)]


def offline_round(llm: LLM, n: int, prompt_len: int, max_tokens: int) -> dict:
    params = {"max_tokens": max_tokens, "ignore_eos": True}
    before, cpu = engine_counters(llm), time.process_time()
    start = time.perf_counter()
    outs = llm.generate(prompts(n, prompt_len), params, progress=False)
    elapsed = time.perf_counter() - start
    counters = engine_counters(llm) | {"cpu:engine": before["cpu:engine"] + time.process_time() - cpu}
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tok_s": tokens / elapsed, "ttft_ms": sorted(o.ttft_s * 1e3 for o in outs),
            "per_step": per_step(before, counters)}


def engine_counters(llm: LLM) -> dict[str, float]:
    """The offline engine's step counters, named as the server's /metrics are (``scrape``)."""
    stats = llm.engine.stats
    return {"steps": stats.steps, "cpu:engine": 0.0} | {"phase:" + k: v for k, v in stats.phase_seconds.items()}


# ---------------------------------------------------------------------------- the server's client


async def one_stream(port: int, body: bytes, sent: float) -> tuple[float, float, int, int]:
    """POST ``body`` and read the stream to its end: (time to the first event, time to its
    end, completion tokens from the final usage chunk, events with a chunk, usage included)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    first, tail, events = None, b"", 0
    while True:
        chunk = await reader.read(1 << 16)
        if not chunk:
            break
        if first is None and b"data: {" in chunk:
            first = time.perf_counter() - sent
        events += chunk.count(b"data: {")
        tail = (tail + chunk)[-4096:]
    end = time.perf_counter() - sent
    writer.close()
    usage = re.findall(rb'"completion_tokens": (\d+)', tail)
    if first is None or not usage:
        raise RuntimeError(f"a stream ended without events or usage: {tail[-300:]!r}")
    return first, end, int(usage[-1]), events


async def server_round_async(port: int, n: int, prompt_len: int, max_tokens: int) -> dict:
    bodies = [json.dumps({"model": MODEL, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                          "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
              for p in prompts(n, prompt_len)]
    start = time.perf_counter()
    results = await asyncio.gather(*(one_stream(port, b, start) for b in bodies))
    elapsed = time.perf_counter() - start
    return {"tok_s": sum(r[2] for r in results) / elapsed, "ttft_ms": sorted(r[0] * 1e3 for r in results),
            "events": statistics.median(r[3] for r in results)}


def scrape(url: str) -> dict[str, float]:
    """The server's step counters: steps, phase seconds, CPU seconds by part."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "tessellm_engine_steps_total":
                out["steps"] = s.value
            elif s.name == "tessellm_engine_step_phase_seconds_total":
                out["phase:" + s.labels["phase"]] = s.value
            elif s.name == "tessellm_cpu_seconds_total":
                out["cpu:" + s.labels["part"]] = s.value
    return out


def per_step(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    steps = after.get("steps", 0) - before.get("steps", 0)
    if not steps:
        return {}
    return {k: round((after[k] - before.get(k, 0.0)) / steps * 1e3, 3) for k in after if k != "steps"} | \
        {"steps": steps}


def percentile(values: list[float], q: float) -> float:
    return round(values[min(len(values) - 1, int(q * len(values)))], 2)


def summary(rounds: list[dict]) -> dict:
    return {"tok_s": round(statistics.median(r["tok_s"] for r in rounds), 1),
            "tok_s_rounds": [round(r["tok_s"], 1) for r in rounds],
            "ttft_ms_p50": round(statistics.median(percentile(r["ttft_ms"], 0.5) for r in rounds), 2),
            "ttft_ms_p99": round(statistics.median(percentile(r["ttft_ms"], 0.99) for r in rounds), 2)} | \
        ({"events_per_stream": statistics.median(r["events"] for r in rounds)} if "events" in rounds[0] else {})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=2.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve-arg", dest="serve_args", action="append", default=[],
                    help="an argument for tessellm serve (repeatable), e.g. --serve-arg=--engine-core=thread")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tokenizer = model_folder(resolve_model("smollm2-135m"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_stub_model(Path(tmp) / "stub", tokenizer, vocab_size=VOCAB)
        config = pipeline_config(folder, args.step_ms)
        config_path = Path(tmp) / "stub.json"
        config_path.write_text(json.dumps(config))
        llm = LLM(config)
        with ServeProcess(["--config", str(config_path), "--served-model-name", MODEL, *args.serve_args],
                          env={**os.environ, **STUB_ENV}, ready=lambda health: True) as server:
            results = run(args, llm, server)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_name() or platform.machine(),
              "cores": os.cpu_count(), "command": "bench/serve_stub.py " + " ".join(argv or sys.argv[1:]),
              "step_ms": args.step_ms, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "serve_args": args.serve_args, "results": results}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def run_client(coro) -> dict:
    """Run the clients' coroutine on uvloop where it is installed (the server's own loop):
    on a small machine the load generator shares the cores with the server, and the lighter
    it is, the less of the server's time it takes."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def server_round(port: int, n: int, prompt_len: int, max_tokens: int) -> dict:
    """One round of N streaming clients, with the client's own CPU seconds."""
    cpu = time.process_time()
    out = run_client(server_round_async(port, n, prompt_len, max_tokens))
    return out | {"client_cpu_s": time.process_time() - cpu}


def run(args: argparse.Namespace, llm: LLM, server: ServeProcess) -> list[dict]:
    offline_round(llm, 4, args.prompt_len, 4)  # warm-up, not timed
    server_round(server.port, 4, args.prompt_len, 4)
    results = []
    for n in args.clients:
        offline, served, steps = [], [], []
        for _ in range(args.rounds):  # A/B alternating: the machine's load drifts alike for both
            offline.append(offline_round(llm, n, args.prompt_len, args.max_tokens))
            before = scrape(server.url)
            served.append(server_round(server.port, n, args.prompt_len, args.max_tokens))
            steps.append(per_step(before, scrape(server.url)))
            if steps[-1]:
                steps[-1]["cpu:client"] = round(served[-1]["client_cpu_s"] / steps[-1]["steps"] * 1e3, 3)
        a, b = summary(offline), summary(served)
        ratios = [s["tok_s"] / o["tok_s"] for s, o in zip(served, offline)]
        host = {k: round(statistics.median(s.get(k, 0.0) for s in steps), 3) for k in steps[-1]}
        alone = {k: round(statistics.median(o["per_step"].get(k, 0.0) for o in offline), 3)
                 for k in offline[-1]["per_step"]}
        # output tokens per second of the API process's CPU, at the merging of this run
        ceiling = [n * args.max_tokens / (st["cpu:api"] * st["steps"] / 1e3) for st in steps if st.get("cpu:api")]
        results.append({"clients": n, "offline": a, "server": b, "server_over_offline": round(statistics.median(ratios), 3),
                        "ratio_rounds": [round(r, 3) for r in ratios], "server_ms_per_step": host,
                        "offline_ms_per_step": alone,
                        "api_tok_per_cpu_s": round(statistics.median(ceiling), 1) if ceiling else None})
        print(json.dumps(results[-1]), flush=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
