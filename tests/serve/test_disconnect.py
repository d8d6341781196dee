"""A client that goes away stops its request: the real server (uvicorn) over real sockets, for
every way a client leaves (a closed socket mid-stream, response.close() of the openai client,
a client timeout, a non-streaming request whose client leaves before the answer). After it
leaves, the engine aborts the request before its next step, and the gauges of /metrics
return to zero: no request left running, no KV block left held. Each departure is logged as
one info line on ``tessellm.server`` naming the request and 499, and nothing else is logged:
no traceback, no warning."""

from __future__ import annotations

import gc
import json
import logging
import re
import socket
import threading
import time
import urllib.request

import httpx
import pytest

uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from tessellm import LLM  # noqa: E402
from tessellm.serve.app import build_app  # noqa: E402

MAX_TOKENS = 3000
STEP_S = 0.004  # each step takes at least this long: a request of MAX_TOKENS would run for seconds
STALL_S = 0.6
READ_TIMEOUT_S = 0.3


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    llm = LLM({"model": str(tiny_model("llama-long")), "device": "cpu", "dtype": "float32",
               "cache": {"name": "paged", "options": {"block_size": 16, "num_blocks": 4096}},
               "scheduler": {"name": "continuous", "options": {"max_num_seqs": 32}}, "decoding": {"name": "sample"}})
    forward = llm.pipeline.runner.forward
    stall = threading.Event()  # set: every step takes STALL_S, longer than a client's read timeout

    def slow_forward(*args, **kwargs):
        time.sleep(STALL_S if stall.is_set() else STEP_S)
        return forward(*args, **kwargs)

    llm.pipeline.runner.forward = slow_forward
    app = build_app(llm, model_name="tiny")
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    port = srv.servers[0].sockets[0].getsockname()[1]
    llm.stall = stall
    yield f"http://127.0.0.1:{port}", app.state.engine, llm
    srv.should_exit = True
    thread.join(timeout=30)


def gauges(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    wanted = ("tessellm_requests_running", "tessellm_requests_waiting", "tessellm_kv_blocks_used")
    return {name: float(value) for name, value in (line.split() for line in text.splitlines()
                                                   if line.split(" ")[0] in wanted)}


def wait_until_idle(url: str, engine_thread, timeout: float = 15.0) -> None:
    """Until no request is left in the engine and the gauges say so; fail after ``timeout``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not engine_thread.engine.requests and gauges(url) == {"tessellm_requests_running": 0.0,
                                                                  "tessellm_requests_waiting": 0.0,
                                                                  "tessellm_kv_blocks_used": 0.0}:
            return
        time.sleep(0.05)
    raise AssertionError(f"still busy {timeout} s after the clients left: {gauges(url)}, "
                         f"requests {list(engine_thread.engine.requests)}")


def assert_cancelled(url: str, engine_thread, since: int, count: int = 1) -> None:
    """The engine goes idle, its gauges read zero, and ``count`` requests were aborted since
    ``since`` aborts, each before the engine's next step after the abort was asked for (at
    most one step, in flight when it was asked, ran)."""
    wait_until_idle(url, engine_thread)
    aborts = list(engine_thread.aborts)[since:]
    assert len(aborts) == count, aborts
    assert all(done - asked <= 1 for _, asked, done in aborts), aborts


@pytest.fixture
def server_log(caplog):
    """Every record the server logs while a test runs: tessellm's at info level and above,
    uvicorn's (its logger does not propagate to the root, so the capture joins it) and
    asyncio's (an exception no task retrieved)."""
    caplog.set_level(logging.INFO, logger="tessellm.server")
    uvicorn_logger = logging.getLogger("uvicorn")
    uvicorn_logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        uvicorn_logger.removeHandler(caplog.handler)


GONE = re.compile(r"^((?:chat)?cmpl-[0-9a-f]{32}) POST /v1/(?:chat/)?completions 499: the client disconnected")


def assert_logged_gone(caplog, count: int, timeout: float = 10.0) -> None:
    """``count`` clients that left were logged, one info line each naming its own request and
    499, and nothing was logged at warning level or above, nor any traceback."""
    deadline = time.time() + timeout
    while len([r for r in caplog.records if r.name == "tessellm.server"]) < count and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # anything logged just after the line
    gc.collect()  # an abandoned task or generator complains when it is collected
    loud = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud and "Traceback" not in caplog.text, loud or caplog.text
    ours = [r for r in caplog.records if r.name == "tessellm.server"]
    ids = [m.group(1) for m in (GONE.match(r.getMessage()) for r in ours) if m]
    assert len(ids) == len(ours) == len(set(ids)) == count, [r.getMessage() for r in ours]


def post(url: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


LONG = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": MAX_TOKENS, "ignore_eos": True}


def test_raw_socket_closed_mid_stream(server, server_log):
    url, engine_thread, llm = server
    since, generated = len(engine_thread.aborts), llm.engine.stats.generated_tokens
    sock = connect(url)
    sock.sendall(post(url, {**LONG, "stream": True}))
    received = b""
    while received.count(b"data:") < 3:
        data = sock.recv(4096)
        assert data, f"the server closed the connection after {received!r}"
        received += data
    sock.close()
    assert_cancelled(url, engine_thread, since)
    assert llm.engine.stats.generated_tokens - generated < MAX_TOKENS // 10
    assert_logged_gone(server_log, 1)


def test_openai_streams_closed_after_three_chunks(server, server_log):
    url, engine_thread, _ = server
    since = len(engine_thread.aborts)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    streams = [client.completions.create(model="tiny", prompt=[5, 6, i], max_tokens=MAX_TOKENS, stream=True,
                                         extra_body={"ignore_eos": True}) for i in range(6)]
    streams += [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"hi {i}"}],
                                               max_tokens=MAX_TOKENS, stream=True, extra_body={"ignore_eos": True})
                for i in range(6)]
    for stream in streams:
        for _, _chunk in zip(range(3), stream):
            pass
        stream.response.close()
    assert_cancelled(url, engine_thread, since, count=12)
    assert_logged_gone(server_log, 12)


def test_client_timeout_on_a_non_streaming_request(server, server_log):
    url, engine_thread, _ = server
    since = len(engine_thread.aborts)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=LONG, timeout=httpx.Timeout(10.0, read=READ_TIMEOUT_S))
    assert_cancelled(url, engine_thread, since)
    assert_logged_gone(server_log, 1)


def test_client_timeout_mid_stream(server, server_log):
    """The engine slows down mid-stream (a long prefill of another request, say) past the
    client's read timeout: the client gives up and closes its connection."""
    url, engine_thread, llm = server
    since = len(engine_thread.aborts)
    try:
        with pytest.raises(httpx.ReadTimeout):
            with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True},
                              timeout=httpx.Timeout(10.0, read=READ_TIMEOUT_S)) as response:
                for events, _ in enumerate(line for line in response.iter_lines() if line.startswith("data:")):
                    if events == 3:
                        llm.stall.set()
    finally:
        llm.stall.clear()
    assert_cancelled(url, engine_thread, since)
    assert_logged_gone(server_log, 1)


def test_non_streaming_socket_closed_before_the_answer(server, server_log):
    url, engine_thread, llm = server
    since = len(engine_thread.aborts)
    sock = connect(url)
    sock.sendall(post(url, LONG))
    deadline = time.time() + 10
    while not llm.engine.requests:  # admitted and running
        assert time.time() < deadline
        time.sleep(0.01)
    sock.close()
    assert_cancelled(url, engine_thread, since)
    assert_logged_gone(server_log, 1)


def test_a_stream_read_to_its_end_is_not_aborted(server, server_log):
    url, engine_thread, _ = server
    since = len(engine_thread.aborts)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    chunks = list(client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=20, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    wait_until_idle(url, engine_thread)
    assert list(engine_thread.aborts)[since:] == []
    assert_logged_gone(server_log, 0)
