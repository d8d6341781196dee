"""/metrics adds up: a real server (uvicorn on a free port) gets a mix of requests: finished
ones (stopped by a stop string, or by their length), n > 1, a batch of prompts (one engine
request each), streams the client leaves mid-way, one whose client leaves before its first
token, one the engine fails (500) and one it refuses (400). Then: every admitted engine
request is finished or aborted, TTFT is observed once per engine request that got a first
token, TPOT once per finished sample, the token counters equal the usage the responses
report, and the gauges are back to their idle values (which they also read before the first
request)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tessellm import LLM
from tessellm.serve.app import build_app
from tessellm.testing.serving import serving

MODEL = "tiny"
STEP_S = 0.006  # each step takes at least this long: a long stream is still running when its client leaves,
# and every true TPOT is above the histogram's first bucket (5 ms)
LONG = 1500  # max_tokens of the streams that are left mid-way


FAULT = 4242  # a forward whose batch holds this token raises: the request that holds it fails alone


class Gate:
    """Holds the engine thread inside a step's forward until released."""

    def __init__(self):
        self.closed = threading.Event()
        self.entered = threading.Event()
        self.opened = threading.Event()

    def wrap(self, forward):
        def gated(*args, **kwargs):
            if self.closed.is_set():
                self.entered.set()
                self.opened.wait(30)
            time.sleep(STEP_S)
            if FAULT in args[0].input_ids.tolist():
                raise RuntimeError("injected fault")
            return forward(*args, **kwargs)
        return gated


@pytest.fixture(scope="module")
def server(tiny_model):
    """(base url, app, llm, gate)."""
    llm = LLM({"model": str(tiny_model("llama-long")), "device": "cpu", "dtype": "float32",
               "cache": {"name": "paged", "options": {"block_size": 16, "num_blocks": 1024}},
               "scheduler": {"name": "continuous", "options": {"max_num_seqs": 32}}, "decoding": {"name": "sample"}})
    gate = Gate()
    llm.pipeline.runner.forward = gate.wrap(llm.pipeline.runner.forward)
    app = build_app(llm, model_name=MODEL)
    with serving(app) as url:
        yield url, app, llm, gate


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed ``name{label="value",...}``."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def idle_gauges(llm: LLM) -> dict[str, float]:
    blocks = llm.pipeline.cache.num_blocks
    return {"tessellm_requests_running": 0, "tessellm_requests_waiting": 0, "tessellm_kv_blocks_used": 0,
            "tessellm_kv_blocks_free": blocks}


def wait_idle(url: str, llm: LLM, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.time() + timeout
    while True:
        metrics = scrape(url)
        if not llm.engine.requests and all(metrics[k] == v for k, v in idle_gauges(llm).items()):
            return metrics
        assert time.time() < deadline, {k: metrics[k] for k in idle_gauges(llm)}
        time.sleep(0.05)


def test_gauges_read_true_values_before_the_first_request(server):
    url, _, llm, _ = server
    metrics = scrape(url)
    assert {k: metrics[k] for k in idle_gauges(llm)} == idle_gauges(llm)
    assert metrics["tessellm_kv_blocks_free"] > 0
    for name in ('tessellm_requests_admitted_total', 'tessellm_requests_finished_total{finish_reason="stop"}',
                 'tessellm_requests_aborted_total{reason="cancelled"}',
                 'tessellm_requests_rejected_total{reason="busy"}', "tessellm_prompt_tokens_total", "tessellm_generated_tokens_total",
                 "tessellm_time_to_first_token_seconds_count", "tessellm_e2e_request_latency_seconds_count"):
        assert metrics[name] == 0, name


class Tally:
    """What the responses say, per engine request."""

    def __init__(self):
        self.finished = {"stop": 0, "length": 0}
        self.samples = 0  # finished samples of more than one token
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.aborted = 0
        self.aborted_with_a_token = 0

    def answer(self, body: dict, prompts: int, n: int, tokens_each: int | None = None) -> None:
        """A finished response of ``prompts`` engine requests of ``n`` samples each."""
        for p in range(prompts):
            reasons = [c["finish_reason"] for c in body["choices"][p * n:(p + 1) * n]]
            self.finished["length" if "length" in reasons else "stop"] += 1
        self.samples += prompts * n if tokens_each is None or tokens_each > 1 else 0
        self.prompt_tokens += body["usage"]["prompt_tokens"]
        self.completion_tokens += body["usage"]["completion_tokens"]


def complete(url: str, **body) -> dict:
    response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def send_finished_requests(url: str, llm: LLM, tally: Tally) -> None:
    probe = complete(url, prompt="The capital of France is", max_tokens=16, temperature=0, ignore_eos=True)
    tally.answer(probe, 1, 1, 16)
    text = probe["choices"][0]["text"]
    stopped = complete(url, prompt="The capital of France is", max_tokens=16, temperature=0, ignore_eos=True,
                       stop=[text[len(text) // 2:len(text) // 2 + 2]])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    tally.answer(stopped, 1, 1, stopped["usage"]["completion_tokens"])
    tally.answer(complete(url, prompt="Once upon a time", max_tokens=6, n=3, temperature=1.0, seed=3,
                          ignore_eos=True), 1, 3, 6)
    batch = ["one two", "three four five", "six"]
    tally.answer(complete(url, prompt=batch, max_tokens=5, n=2, temperature=1.0, seed=4, ignore_eos=True), 3, 2, 5)
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as r:
        usage = [line for line in r.iter_lines() if '"prompt_tokens"' in line]
    tally.answer({"choices": [{"finish_reason": "length"}], "usage": json.loads(usage[-1][5:])["usage"]}, 1, 1, 4)


def leave_streams(url: str, llm: LLM, tally: Tally, count: int) -> None:
    """``count`` streams of LONG tokens, each closed after its third chunk."""
    for i in range(count):
        prompt = f"a long story number {i}"
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": LONG, "ignore_eos": True,
                                "stream": True}) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data:")
                if chunks == 3:
                    break
        tally.aborted += 1
        tally.aborted_with_a_token += 1
        tally.prompt_tokens += len(llm.encode(prompt))


def leave_before_the_first_token(url: str, app, llm: LLM, gate: Gate, tally: Tally) -> None:
    """While the engine is held inside a step (another stream's), a request arrives and its
    client leaves: the engine admits and aborts it before its next step, so it has no token."""
    engine = app.state.engine
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "held", "max_tokens": LONG, "ignore_eos": True,
                            "stream": True}) as held:
        lines = held.iter_lines()
        while not next(lines).startswith("data:"):
            pass
        gate.closed.set()
        assert gate.entered.wait(30)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 8},
                       timeout=httpx.Timeout(10.0, read=0.3))
        deadline = time.time() + 10
        while engine.transport._inbox.qsize() < 2:  # its add and its abort, queued behind the held step
            assert time.time() < deadline, "the server did not abort the request whose client left"
            time.sleep(0.01)
        gate.closed.clear()
        gate.opened.set()
    tally.aborted += 2  # the late one, and the held stream, closed here
    tally.aborted_with_a_token += 1
    tally.prompt_tokens += len(llm.encode("late")) + len(llm.encode("held"))


def test_counters_add_up_over_a_mix_of_requests(server):
    url, app, llm, gate = server
    before, generated_before = wait_idle(url, llm), llm.engine.stats.generated_tokens
    tally = Tally()
    send_finished_requests(url, llm, tally)
    leave_streams(url, llm, tally, 2)
    leave_before_the_first_token(url, app, llm, gate, tally)
    refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [10**9], "max_tokens": 4})
    assert refused.status_code == 400
    failed = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [17, FAULT, 6], "max_tokens": 4},
                        timeout=60)
    assert failed.status_code == 500
    tally.prompt_tokens += 3
    after = wait_idle(url, llm)

    def grew(name: str) -> float:
        return after[name] - before[name]

    finished = {r: grew(f'tessellm_requests_finished_total{{finish_reason="{r}"}}') for r in ("stop", "length")}
    assert finished == tally.finished
    assert grew('tessellm_requests_aborted_total{reason="cancelled"}') == tally.aborted
    assert grew('tessellm_requests_aborted_total{reason="failed"}') == 1
    assert grew("tessellm_requests_admitted_total") == sum(finished.values()) + tally.aborted + 1
    assert grew('tessellm_requests_rejected_total{reason="invalid"}') == 1
    assert grew("tessellm_time_to_first_token_seconds_count") == sum(finished.values()) + tally.aborted_with_a_token
    assert grew("tessellm_e2e_request_latency_seconds_count") == sum(finished.values())
    assert grew("tessellm_time_per_output_token_seconds_count") == tally.samples
    assert grew("tessellm_prompt_tokens_total") == tally.prompt_tokens
    # every token that reached the host is counted: the finished requests' usage, and what the aborted ones got
    assert grew("tessellm_generated_tokens_total") == llm.engine.stats.generated_tokens - generated_before
    assert grew("tessellm_generated_tokens_total") > tally.completion_tokens
    # a sample's TPOT spans its own tokens: dividing by all n samples' tokens would fall under 5 ms
    assert grew('tessellm_time_per_output_token_seconds_bucket{le="0.005"}') == 0
