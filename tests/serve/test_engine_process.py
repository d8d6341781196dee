"""The engine core in its own process (``tessellm serve``'s default): everything the server
does crosses the process boundary as messages and answers as the in-process engine does
(completions, chat, streams, logprobs, echo scoring, structured outputs, the Responses API,
tokenize, LoRA loads and unloads, metrics); a client that leaves aborts its request before
the core's next step; a killed core fails every request in flight with a clear error, the
server answers 503 and /health says why, and the core is restarted (counted in /metrics);
without restarts the server gives up. One core process serves the whole module."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("zmq")
pytest.importorskip("peft")

from tessellm import LLM  # noqa: E402
from tessellm.serve.app import build_app  # noqa: E402
from tessellm.serve.engine_client import EngineClient  # noqa: E402
from tessellm.serve.engine_process import EngineStartError, ProcessTransport  # noqa: E402
from tessellm.serve.supervise import CoreSupervisor  # noqa: E402
from tessellm.testing.lora import build_tiny_lora  # noqa: E402
from tessellm.testing.models import build_tiny  # noqa: E402
from tessellm.testing.serving import serving  # noqa: E402

MODEL = "tiny"
PROMPTS = [[1, 5, 9, 33, 7], [1, 44, 12, 90], [1, 7, 7, 100, 3, 8]]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("engine-process")
    base = build_tiny("llama", root / "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(base)
    return base, build_tiny_lora(base, root / "sql", rank=8, seed=1)


def config(base) -> dict:
    return {"model": str(base), "device": "cpu", "dtype": "float32", "max_model_len": 256,
            "cache": {"name": "paged", "options": {"block_size": 8, "num_blocks": 512}},
            "scheduler": {"name": "continuous", "options": {"max_num_seqs": 16}}, "decoding": {"name": "sample"},
            "lora": {"runtime_updates": True, "max_rank": 8}}


@pytest.fixture(scope="module")
def offline(folders):
    return LLM(config(folders[0]))


@pytest.fixture(scope="module")
def server(folders):
    """A server whose engine core is a child process (restarted quickly when killed)."""
    from tessellm.core.model.loader import load_tokenizer

    transport = ProcessTransport(config(folders[0]))
    transport.start()
    client = EngineClient(transport, load_tokenizer(folders[0]))
    app = build_app(client, model_name=MODEL)
    supervisor = CoreSupervisor(client, first_backoff_s=0.1)
    with serving(app) as url:
        yield url, client, supervisor


def post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, **body}, timeout=120)


def metric(url: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(url + "/metrics", timeout=30).text, re.M)
    assert match, name
    return float(match.group(1))


def wait_idle(url: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while metric(url, "tessellm_requests_running") or metric(url, "tessellm_kv_blocks_used"):
        assert time.time() < deadline, "the engine core did not go idle"
        time.sleep(0.05)


def test_health_names_the_core_process(server):
    url, client, _ = server
    health = httpx.get(url + "/health").json()
    core = health["engine_core"]
    assert health["status"] == "ok" and core["mode"] == "process" and core["alive"]
    assert core["pid"] == client.info.pid and core["pid"] != __import__("os").getpid()
    assert httpx.get(url + "/ping").status_code == 200
    assert httpx.get(url + "/version").json()["version"]


def test_completions_chat_and_streams_equal_the_in_process_engine(server, offline):
    url = server[0]
    for prompt in PROMPTS:
        ref = offline.generate([prompt], {"max_tokens": 10, "ignore_eos": True})[0]
        body = post(url, "/v1/completions", prompt=prompt, max_tokens=10, temperature=0, ignore_eos=True).json()
        assert body["choices"][0]["text"] == ref.text and body["usage"]["completion_tokens"] == 10
        events = []
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, "stream": True,
                                "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["text"] for e in events for c in e["choices"]) == ref.text
        assert events[-1]["usage"]["completion_tokens"] == 10
    chat = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "t5 t9 t33"}], max_tokens=6,
                temperature=0).json()
    ids = offline.tokenizer("t5 t9 t33", add_special_tokens=False)["input_ids"]
    assert chat["choices"][0]["message"]["content"] == offline.generate([ids], {"max_tokens": 6})[0].text


def test_logprobs_echo_scoring_and_structured_outputs_cross(server, offline):
    url = server[0]
    body = post(url, "/v1/completions", prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=2).json()
    lps = body["choices"][0]["logprobs"]["token_logprobs"]
    ref = offline.generate([PROMPTS[0]], {"max_tokens": 1, "prompt_logprobs": 2})[0].prompt_logprobs
    assert lps[0] is None and lps[1:] == pytest.approx([r.logprob for r in ref[1:]], abs=1e-4)
    chat = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "t5"}], max_tokens=4,
                temperature=0, logprobs=True, top_logprobs=3).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] and len(content[0]["top_logprobs"]) == 3
    choice = post(url, "/v1/completions", prompt=PROMPTS[1], max_tokens=8, temperature=0,
                  structured_outputs={"choice": ["t5", "t44"]}).json()
    assert choice.get("choices", [{}])[0].get("text") in ("t5", "t44"), choice
    bad = post(url, "/v1/completions", prompt=PROMPTS[1], max_tokens=4, n=2, temperature=0, use_beam_search=True)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "use_beam_search"


def test_errors_name_their_field_across_the_boundary(server):
    url = server[0]
    long = post(url, "/v1/completions", prompt=list(range(3, 300)), max_tokens=4)
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"
    vocab = post(url, "/v1/completions", prompt=[1, 99999], max_tokens=4)
    assert vocab.status_code == 400 and vocab.json()["error"]["param"] == "prompt"


def test_responses_tokenize_and_detokenize(server, offline):
    url = server[0]
    r = post(url, "/v1/responses", input="t5 t9", max_output_tokens=5, temperature=0).json()
    assert r["status"] in ("completed", "incomplete") and r["usage"]["output_tokens"] >= 1
    tok = httpx.post(url + "/tokenize", json={"prompt": "t5 t9"}).json()
    assert tok["tokens"] == offline.tokenizer("t5 t9")["input_ids"] and tok["max_model_len"] == 256
    assert httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"].endswith("t5 t9")


def test_lora_adapters_load_and_unload_in_the_core(server, folders, caplog):
    import logging

    url = server[0]
    caplog.set_level(logging.INFO, logger="tessellm.server")
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(folders[1])})
    assert r.status_code == 200, r.text
    assert "sql" in [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    base = post(url, "/v1/completions", prompt=PROMPTS[0], max_tokens=6, temperature=0, ignore_eos=True).json()
    lora = httpx.post(url + "/v1/completions", json={"model": "sql", "prompt": PROMPTS[0], "max_tokens": 6,
                                                      "temperature": 0, "ignore_eos": True}).json()
    assert lora["model"] == "sql" and lora["choices"][0]["text"] != base["choices"][0]["text"]
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
    gone = httpx.post(url + "/v1/completions", json={"model": "sql", "prompt": PROMPTS[0], "max_tokens": 2})
    assert gone.status_code == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "tessellm.server"]
    assert any("'sql' loaded" in line for line in lines) and any("'sql' unloaded" in line for line in lines)


@contextlib.contextmanager
def streamed_past_first_event(url: str, prompt: list[int], max_tokens: int) -> Iterator[Iterator[str]]:
    """A streamed completion of ``prompt`` (``ignore_eos``); yields its lines after the first
    event, and closes the stream on exit."""
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                            "stream": True}) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            continue
        yield lines


def test_a_client_that_leaves_is_aborted_before_the_next_step(server):
    url, client, _ = server
    since = len(client.aborts)
    with streamed_past_first_event(url, PROMPTS[2], max_tokens=200):
        pass  # the client leaves after the first event
    deadline = time.time() + 30
    while len(client.aborts) == since:
        assert time.time() < deadline, "no abort reached the core"
        time.sleep(0.02)
    _, asked, done = client.aborts[-1]
    assert done - asked <= 1  # the core's steps started when the API asked, against when it did it
    wait_idle(url)
    assert metric(url, "tessellm_requests_admitted_total") == metric(url, 'tessellm_requests_finished_total{finish_reason="stop"}') + \
        metric(url, 'tessellm_requests_finished_total{finish_reason="length"}') + \
        metric(url, 'tessellm_requests_aborted_total{reason="cancelled"}') + \
        metric(url, 'tessellm_requests_aborted_total{reason="failed"}')


def test_a_killed_core_fails_in_flight_requests_then_is_restarted(server):
    """Last in the module: it replaces the core process."""
    import os
    import signal

    url, client, supervisor = server
    old = client.info.pid
    with streamed_past_first_event(url, PROMPTS[0], max_tokens=240) as lines:
        os.kill(old, signal.SIGKILL)
        rest = list(lines)
    errors = [json.loads(line[6:])["error"] for line in rest if line.startswith("data: {") and '"error"' in line]
    assert errors and f"engine core process (pid {old}) exited with status -9" in errors[0]["message"], rest[-3:]
    assert rest[-1] == "data: [DONE]" or rest[-2:] == ["data: [DONE]", ""]
    down = post(url, "/v1/completions", prompt=PROMPTS[0], max_tokens=2)
    health = httpx.get(url + "/health")
    if client.info.pid == old:  # not back yet
        assert down.status_code == 503 and down.json()["error"]["code"] == "engine_unavailable"
        assert health.status_code == 503 and "exited with status -9" in health.json()["error"]["message"]
    deadline = time.time() + 300
    while client.info.pid == old or not client.alive:
        assert time.time() < deadline, "the core was not restarted"
        time.sleep(0.2)
    assert post(url, "/v1/completions", prompt=PROMPTS[0], max_tokens=3, temperature=0).status_code == 200
    assert metric(url, "tessellm_engine_core_exits_total") == 1 and metric(url, "tessellm_engine_core_restarts_total") == 1
    assert httpx.get(url + "/health").json()["engine_core"]["pid"] == client.info.pid != old
    assert supervisor.restarts == 1


def test_without_restarts_a_dead_core_makes_the_server_give_up():
    """The supervisor's decision, without a process: restarts off, or too many quick exits."""
    class Client:
        metrics = None
        on_core_exit = on_core_ready = None
        transport = None

    why: list[str] = []
    CoreSupervisor(Client(), restart=False, give_up=why.append).core_exited(-9)
    assert why and "restarts are off" in why[0]
    why.clear()
    supervisor = CoreSupervisor(Client(), max_restarts=0, give_up=why.append)
    supervisor.core_exited(1)
    assert why and "giving up" in why[0]


def test_a_core_that_cannot_build_its_pipeline_says_why(tmp_path):
    transport = ProcessTransport({"model": str(tmp_path / "missing"), "device": "cpu"}, start_timeout_s=300)
    try:
        with pytest.raises(EngineStartError, match="could not start: ModelLoadError"):
            transport.start()
    finally:
        transport.stop()


@pytest.mark.extended
def test_serve_without_restarts_exits_1_when_its_core_dies(folders, tmp_path):
    """``tessellm serve --no-restart``: a killed core ends the server with status 1 and a line
    saying why (``--keep-running`` would keep it up answering 503)."""
    import os
    import signal
    import subprocess

    from tessellm.testing.serving import ServeProcess

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config(folders[0])))
    with ServeProcess(["--config", str(path), "--no-restart"], stderr=subprocess.PIPE) as server:
        os.kill(httpx.get(server.url + "/health").json()["engine_core"]["pid"], signal.SIGKILL)
        assert server.proc.wait(timeout=120) == 1
        err = server.proc.stderr.read().decode()
        assert "exited with status -9" in err and "tessellm: stopped:" in err and "restarts are off" in err, err
