"""``tessellm ab --serve A B`` end to end, on a tiny random model: two arms that must agree
(the paged and the contiguous cache, greedy); every request is mirrored to both, the client
gets A's answer (a streamed one without the usage chunk it did not ask for), GET /ab counts
each request once with both arms' speed and their agreement (a sampled request counts for
speed only), and Ctrl-C (SIGINT to the command alone) prints the report and stops both arms."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

MODEL = "tiny"


def arm_config(model_dir, cache: dict) -> dict:
    return {"model": str(model_dir), "device": "cpu", "dtype": "float32", "max_model_len": 256, "cache": cache,
            "scheduler": {"name": "continuous", "options": {"max_num_seqs": 8}}, "decoding": {"name": "sample"}}


def poll(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} did not happen within {timeout} s")


def ab_report(url: str) -> dict | None:
    try:
        return httpx.get(url + "/ab", timeout=5).json()
    except (httpx.TransportError, ValueError):
        return None


def test_live_ab_mirrors_every_request_and_reports_speed_and_agreement(tmp_path, tiny_model):
    from tessellm.serve.router.launcher import free_port

    model_dir = tiny_model("llama")
    files = []
    for arm, cache in (("a", {"name": "paged", "options": {"block_size": 8, "num_blocks": 256}}),
                       ("b", {"name": "contiguous", "options": {"max_seqs": 8}})):
        files.append(tmp_path / f"{arm}.json")
        files[-1].write_text(json.dumps(arm_config(model_dir, cache)))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tessellm", "ab", "--serve", *map(str, files), "--port", str(port),
                             "--served-model-name", MODEL, "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        poll(lambda: proc.poll() is not None or ab_report(url) is not None, 240, "the live A/B starting")
        assert proc.poll() is None, "tessellm ab --serve exited while starting"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for prompt in ("Once upon a time", "def add(a, b):"):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        chunks = list(client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0,
                                                stream=True))
        assert chunks and all(c.choices for c in chunks)  # no usage chunk: the client did not ask for one
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       temperature=0)
        client.completions.create(model=MODEL, prompt="Sampled:", max_tokens=6, temperature=1.0)
        report = poll(lambda: (r := ab_report(url)) and r["requests"] == 5 and r, 60, "5 mirrored requests")
        assert report["a"]["answered"] == report["b"]["answered"] == 5 and report["pairs"] == 5
        assert report["compared"] == 4 and report["exact_match_rate"] == 1.0 and report["not_comparable"] == 1
        assert report["ratio"] > 0 and len(report["ratio_ci95"]) == 2
        assert report["a"]["ttft_ms"]["p50"] is not None  # the streamed request's time to first token
        os.kill(proc.pid, signal.SIGINT)  # Ctrl-C of the command alone: it stops its arms itself
        out, _ = proc.communicate(timeout=120)
        final = json.loads(out)
        assert final["requests"] == 5 and final["exact_match_rate"] == 1.0
        assert any("greedy" in note for note in final["notes"])
        for replica_url in (final["a"]["url"], final["b"]["url"]):
            with pytest.raises(httpx.TransportError):
                httpx.get(replica_url + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
