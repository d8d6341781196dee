"""``tessellm serve --data-parallel 2`` end to end, on a tiny random model: two replica
processes behind the router answer the openai client with the tokens one pipeline gives
(completions and chat, streamed and not); requests sharing a long prompt prefix land on one
replica under prefix-aware routing (and hit its prefix cache, which /metrics shows with a
replica label); killing the replica that serves a stream ends that stream with an error event
naming it, later requests are answered, and the killed replica is logged, restarted on its
port (chosen with --replica-base-port) and counted in /metrics, its process shown in /health."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

MODEL = "tiny"
SYSTEM = "You are the support assistant of the Example Company. " * 12  # ~650 characters, shared


def config(model_dir: Path) -> dict:
    return {"model": str(model_dir), "device": "cpu", "dtype": "float32", "max_model_len": 8192,
            "cache": {"name": "paged", "options": {"block_size": 16, "num_blocks": 1024}},
            "scheduler": {"name": "continuous", "options": {"max_num_seqs": 16}}, "decoding": {"name": "greedy"}}


def wait_for(url: str, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    """Until the router's /health says both replicas are healthy; fail with its output if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"serve --data-parallel exited with {proc.returncode}"
        try:
            health = httpx.get(url + "/health", timeout=2).json()
            if health.get("status") == "ok" and all(r["healthy"] for r in health["replicas"]):
                return
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"the router at {url} was not healthy within {timeout} s")


def free_port() -> int:
    from tessellm.serve.router.launcher import free_port as port

    return port()


def free_ports(count: int) -> int:
    """A base port with ``count`` free ports from it."""
    import socket

    for _ in range(50):
        base, taken = free_port(), []
        try:
            for p in range(base, base + count):
                s = socket.socket()
                taken.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in taken:
                s.close()
    raise AssertionError("no run of free ports")


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama-long")


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir):
    """``tessellm serve --data-parallel 2 --policy prefix-aware`` in its own process group;
    yields (router URL, process)."""
    path = tmp_path_factory.mktemp("dp") / "config.json"
    path.write_text(json.dumps(config(model_dir)))
    port, base = free_port(), free_ports(2)
    log = path.parent / "serve.log"
    command = [sys.executable, "-m", "tessellm", "serve", "--config", str(path), "--data-parallel", "2",
               "--policy", "prefix-aware", "--policy-option", "block_chars=32", "--served-model-name", MODEL,
               "--port", str(port), "--health-interval", "0.2", "--replica-base-port", str(base)]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    proc.log, proc.base = log, base
    try:
        wait_for(url, proc)
        yield url, proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def offline(model_dir):
    from tessellm import LLM

    return LLM(config(model_dir))


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_answers_equal_one_pipelines_streamed_or_not(served, offline):
    url, _ = served
    prompt = "The capital of France is"
    ref = offline.generate([prompt], {"max_tokens": 12, "ignore_eos": True})[0]
    answer = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert answer.choices[0].text == ref.text and answer.usage.completion_tokens == 12
    stream = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == ref.text
    messages = [{"role": "user", "content": "Say something."}]
    chat_ref = offline.generate(["Say something."], {"max_tokens": 10, "ignore_eos": True}, chat=True)[0]
    chat = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == chat_ref.text
    chat_stream = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices) == chat_ref.text


def test_requests_sharing_a_prefix_land_on_one_replica_and_hit_its_cache(served):
    url, _ = served
    replicas = []
    for question in ("What are your opening hours?", "How do I reset my password?", "Where is my order?"):
        resp = httpx.post(url + "/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})
        assert resp.status_code == 200, resp.text
        replicas.append(resp.headers["x-tessellm-replica"])
    assert len(set(replicas)) == 1, replicas
    metrics = httpx.get(url + "/metrics").text
    assert 'tessellm_router_policy{stat="routed_by_prefix"} 2.0' in metrics
    hits = [line for line in metrics.splitlines()
            if line.startswith("tessellm_prefix_cache_hit_tokens_total{") and f'replica="{replicas[0]}"' in line]
    assert hits and float(hits[0].split()[-1]) > 0, hits


def child_serving(router_pid: int, port: int) -> int:
    """The pid of the router's child that listens on ``port`` (its command line names it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == router_pid and str(port).encode() in cmdline:
            return int(entry.name)
    raise AssertionError(f"no child of {router_pid} serves port {port}")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the replica's process in /proc")
def test_a_killed_replica_ends_its_stream_with_an_error_and_the_survivor_serves(served):
    url, proc = served
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 6000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        index = int(resp.headers["x-tessellm-replica"])
        replica_url = httpx.get(url + "/health").json()["replicas"][index]["url"]
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the stream is under way
        os.kill(child_serving(proc.pid, int(replica_url.rsplit(":", 1)[1])), signal.SIGKILL)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
    assert len(errors) == 1 and f"replica {index} ({replica_url})" in errors[0]["message"], events[-3:]
    assert events[-1] == "[DONE]"
    later = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    for _ in range(3):  # every later request is answered (by the survivor while the other restarts)
        answer = httpx.post(url + "/v1/completions", json=later)
        assert answer.status_code == 200, answer.text
    assert replica_url == f"http://127.0.0.1:{proc.base + index}"
    deadline = time.monotonic() + 240
    while True:  # restarted on its port, healthy again
        replica = httpx.get(url + "/health").json()["replicas"][index]
        if replica["healthy"] and replica["process"]["restarts"] == 1:
            break
        assert time.monotonic() < deadline, replica
        time.sleep(0.3)
    assert replica["process"]["exits"] == 1 and replica["process"]["port"] == proc.base + index
    assert replica["url"] == replica_url
    metrics = httpx.get(url + "/metrics").text
    assert f'tessellm_router_replica_exits_total{{replica="{index}"}} 1.0' in metrics
    assert f'tessellm_router_replica_restarts_total{{replica="{index}"}} 1.0' in metrics
    log = proc.log.read_text()
    assert f"replica {index} (pid " in log and "exited with status -9" in log and f"replica {index} restarted" in log
