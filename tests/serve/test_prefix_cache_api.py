"""The prefix cache as scoring clients meet it: a prompt sent twice with max_tokens 1 hits the
second time, offline (with plain and speculative decoding) and over HTTP, where the usage
reports the cached tokens and /metrics counts them; ``cache_salt`` in a request body keeps
tenants apart."""

from __future__ import annotations

import re

import httpx
import pytest

from tessellm import LLM
from tessellm.serve.app import build_app
from tessellm.testing.serving import serving

PROMPT = list(range(100, 165))  # 65 token ids: 8 full blocks of 8, then 1


def config(cpu_config, tiny_model, **extra) -> dict:
    extra.setdefault("cache", {"name": "paged", "options": {"block_size": 8, "num_blocks": 256}})
    return cpu_config(tiny_model("llama"), max_model_len=256, scheduler={"name": "continuous"}, **extra)


@pytest.mark.parametrize("decoding", [{"name": "greedy"},
                                      {"name": "speculative", "options": {"proposer": "ngram", "k": 3}}])
def test_offline_max_tokens_1_twice_hits(cpu_config, tiny_model, decoding):
    llm = LLM(config(cpu_config, tiny_model, decoding=decoding))
    params = {"max_tokens": 1, "temperature": 0.0}
    first = llm.generate([PROMPT], params)[0]
    second = llm.generate([PROMPT], params)[0]
    stats = llm.pipeline.cache.prefix_cache_stats()
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 64
    assert stats.queried_tokens == 2 * 65 and stats.hit_tokens == 64
    assert second.token_ids == first.token_ids


@pytest.fixture(scope="module")
def server(cpu_config, tiny_model):
    llm = LLM(config(cpu_config, tiny_model))
    with serving(build_app(llm, model_name="tiny", api_key=None, max_request_bytes=64 * 1024)) as url:
        yield url


def complete(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1,
                                                  "temperature": 0.0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_http_max_tokens_1_hits_reports_cached_tokens_and_metrics(server):
    queried0, hit0 = metric(server, "tessellm_prefix_cache_queried_tokens_total"), \
        metric(server, "tessellm_prefix_cache_hit_tokens_total")
    cached = [complete(server, cache_salt="metrics")["usage"]["prompt_tokens_details"]["cached_tokens"]
              for _ in range(3)]
    assert cached == [0, 64, 64]
    assert metric(server, "tessellm_prefix_cache_queried_tokens_total") - queried0 == 3 * 65
    assert metric(server, "tessellm_prefix_cache_hit_tokens_total") - hit0 == 2 * 64
    assert 0 < metric(server, "tessellm_prefix_cache_hit_rate") <= 1
    assert 0 < metric(server, "tessellm_prefix_cache_hit_rate_window") <= 1


def test_cache_salt_keeps_tenants_apart_over_http(server):
    def cached(salt: str) -> int:
        return complete(server, cache_salt=salt)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # the same prompt, another tenant: nothing shared
    assert cached("tenant-a") == 64  # the same tenant again: its own blocks


def test_cache_salt_reaches_chat_completions_and_bad_salts_are_400(server):
    r = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, "cache_salt": "",
                                                          "messages": [{"role": "user", "content": "t5"}]})
    assert r.status_code == 400 and "cache_salt" in r.text
    r = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "cache_salt": 7})
    assert r.status_code == 400 and "cache_salt" in r.text


def test_chat_completions_take_the_salt_and_report_cached_tokens(server):
    def cached(salt: str) -> int:
        r = httpx.post(server + "/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 1, "temperature": 0.0, "cache_salt": salt,
            "messages": [{"role": "user", "content": "Name the planets of the solar system, in order, please."}]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("chat-a") == 0
    assert cached("chat-b") == 0
    assert cached("chat-a") > 0


def test_restarted_server_answers_a_repeated_prompt_from_its_disk_tier(cpu_config, tiny_model, tmp_path):
    """A server with a disk tier is stopped and a new one started over the same directory: the
    repeated prompt is answered with the same tokens, its cached tokens read from disk, and
    /metrics counts them under tier="disk"."""
    disk = {"name": "paged", "options": {"block_size": 8, "num_blocks": 256, "disk_tier_path": str(tmp_path)}}
    answers = []
    for _ in range(2):
        llm = LLM(config(cpu_config, tiny_model, cache=disk))
        with serving(build_app(llm, model_name="tiny", api_key=None, max_request_bytes=64 * 1024)) as url:
            body = complete(url, max_tokens=6)
            answers.append((body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]))
            hits = metric(url, 'tessellm_kv_tier_hit_tokens_total{tier="disk"}')
    (first, cached_first), (second, cached_second) = answers
    assert second == first and (cached_first, cached_second) == (0, 64) and hits == 64


def test_a_process_that_exits_without_closing_still_leaves_its_blocks(cpu_config, tiny_model, tmp_path):
    """Queued disk writes are flushed at interpreter exit (the writer thread is a daemon)."""
    import json
    import subprocess
    import sys

    cfg = config(cpu_config, tiny_model, cache={"name": "paged", "options": {
        "block_size": 8, "num_blocks": 256, "disk_tier_path": str(tmp_path)}})
    script = ("import json, sys\nfrom tessellm import LLM\n"
              "llm = LLM(json.loads(sys.argv[1]))\n"
              f"llm.generate([{PROMPT!r}], {{'max_tokens': 1, 'temperature': 0.0}})\n")
    subprocess.run([sys.executable, "-c", script, json.dumps(cfg)], check=True, timeout=300)
    assert len(list(tmp_path.rglob("*.kv"))) == 8
    llm = LLM(cfg)
    assert llm.generate([PROMPT], {"max_tokens": 1, "temperature": 0.0})[0].num_cached_tokens == 64
    llm.close()
