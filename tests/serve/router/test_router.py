"""The router against fake replicas (conftest.py): streams passed through event by event, a
request retried on another replica when its replica fails before the first byte, an error
event naming the replica when it fails after, a 502 when no replica can answer, a replica
taken out by its health probe and brought back, /metrics relabelled, and the API key."""

from __future__ import annotations

import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai")


def client(url: str, key: str = "none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def poll(condition, timeout: float = 10.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout} s"
        time.sleep(0.02)


def sse_events(resp: httpx.Response) -> list[str]:
    return [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]


def test_a_stream_passes_through_whole_and_round_robin_alternates(fakes, router):
    url = router([u for u, _ in fakes])
    texts = []
    for _ in range(2):
        stream = client(url).completions.create(model="fake", prompt="hi", max_tokens=4, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        texts.append("".join(c.choices[0].text for c in chunks if c.choices))
        assert chunks[-1].usage.completion_tokens == 4  # the usage chunk passed through
    assert texts == ["r0: alpha beta gamma delta", "r1: alpha beta gamma delta"]
    answer = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "hi"})
    assert answer.status_code == 200 and answer.headers["x-tessellm-replica"] == "0"
    assert answer.json()["choices"][0]["text"].startswith("r0:")


def test_a_stream_whose_replica_fails_before_its_first_event_is_retried_elsewhere(fakes, router):
    (url0, state0), (url1, state1) = fakes
    state0.fail = "before_first_byte"
    url = router([url0, url1], health_interval_s=600)  # no probe brings replica 0 back during the test
    answer = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "hi", "stream": True})
    assert answer.status_code == 200 and answer.headers["x-tessellm-replica"] == "1"
    assert "r1:" in answer.text and "r0" not in answer.text and len(state0.bodies) == len(state1.bodies) == 1
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and [r["healthy"] for r in health["replicas"]] == [False, True]
    assert "RemoteProtocolError" in health["replicas"][0]["last_error"]
    assert "tessellm_router_retries_total 1.0" in httpx.get(url + "/metrics").text


def test_a_replica_that_drops_the_connection_is_retried_elsewhere(fakes, router, dropping_url):
    (url1, state1) = fakes[1]
    url = router([dropping_url, url1], health_interval_s=600)  # round-robin: the dropping one first
    answer = client(url).completions.create(model="fake", prompt="hi", max_tokens=4)
    assert answer.choices[0].text.startswith("r1:") and len(state1.bodies) == 1
    assert "tessellm_router_retries_total 1.0" in httpx.get(url + "/metrics").text


def test_a_replica_that_dies_mid_stream_ends_it_with_an_error_naming_it(fakes, router):
    (url0, state0), (url1, _) = fakes
    state0.fail = "mid_stream"
    url = router([url0, url1])
    answer = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "hi", "stream": True})
    events = sse_events(answer)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:3]] == ["r0:", " alpha", " beta"]
    error = json.loads(events[3])["error"]
    assert error["code"] == "replica_failed" and f"replica 0 ({url0})" in error["message"]
    assert events[4:] == ["[DONE]"]
    assert 'tessellm_router_failures_total{reason="replica_lost_mid_answer"} 1.0' in httpx.get(url + "/metrics").text
    # the openai client raises on the error event: the client is never left with a silent, short answer
    stream = client(router([url0])).completions.create(model="fake", prompt="hi", max_tokens=4, stream=True)
    with pytest.raises(openai.APIError, match="replica 0 .* stopped answering mid-stream"):
        for _ in stream:
            pass


def test_no_replica_answering_is_a_502_naming_each(router, dead_url, dropping_url):
    url = router([dropping_url, dead_url], max_retries=3, health_interval_s=600)
    for body in ({"model": "fake", "prompt": "hi"}, {"model": "fake", "prompt": "hi", "stream": True}):
        answer = httpx.post(url + "/v1/completions", json=body)
        assert answer.status_code == 502, answer.text
        error = answer.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "no_healthy_replica"
        assert dead_url in error["message"] and dropping_url in error["message"]
    assert httpx.get(url + "/health").status_code == 503
    with pytest.raises(openai.InternalServerError, match="no replica could answer"):
        client(url).completions.create(model="fake", prompt="hi", max_tokens=4)


def test_a_replica_whose_health_fails_is_taken_out_and_brought_back(fakes, router):
    (url0, state0), (url1, _) = fakes
    url = router([url0, url1])
    state0.healthy = False
    poll(lambda: not httpx.get(url + "/health").json()["replicas"][0]["healthy"], what="replica 0 out")
    served = {httpx.post(url + "/v1/completions", json={"prompt": "x"}).headers["x-tessellm-replica"]
              for _ in range(3)}
    assert served == {"1"}
    assert 'tessellm_router_replica_healthy{replica="0"} 0.0' in httpx.get(url + "/metrics").text
    state0.healthy = True
    poll(lambda: httpx.get(url + "/health").json()["replicas"][0]["healthy"], what="replica 0 back")
    served = {httpx.post(url + "/v1/completions", json={"prompt": "x"}).headers["x-tessellm-replica"]
              for _ in range(2)}
    assert served == {"0", "1"}


def test_metrics_are_each_replicas_relabelled_and_the_routers_own(fakes, router):
    url = router([u for u, _ in fakes])
    for _ in range(3):
        httpx.post(url + "/v1/completions", json={"prompt": "x"})
    text = httpx.get(url + "/metrics").text
    assert 'tessellm_requests_admitted_total{replica="0"} 2.0' in text
    assert 'tessellm_requests_admitted_total{replica="1"} 1.0' in text
    assert text.count("# TYPE tessellm_requests_admitted_total counter") == 1  # one family for both
    assert 'tessellm_router_requests_total{replica="0"} 2.0' in text
    assert 'tessellm_router_replica_healthy{replica="1"} 1.0' in text
    from prometheus_client.parser import text_string_to_metric_families

    assert {f.name for f in text_string_to_metric_families(text)} >= {"tessellm_requests_admitted",
                                                                      "tessellm_router_requests"}


def test_the_api_key_is_checked_at_the_router_and_passed_on(fakes, router):
    (url0, state0), (url1, _) = fakes
    url = router([url0, url1], api_key="secret")
    refused = httpx.post(url + "/v1/completions", json={"prompt": "x"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert state0.bodies == []
    assert [m.owned_by for m in client(url, "secret").models.list().data] in (["r0"], ["r1"])
    client(url, "secret").completions.create(model="fake", prompt="hi", max_tokens=4)
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
    seen = state0.headers[-1] if state0.headers else fakes[1][1].headers[-1]
    assert seen["authorization"] == "Bearer secret"


def test_an_unknown_policy_or_option_is_a_clear_error():
    from tessellm.core.errors import ConfigError
    from tessellm.serve.router.config import load_policy, router_config

    with pytest.raises(ConfigError, match="unknown routing policy 'prefix-awre' \\(did you mean 'prefix-aware'\\?\\); "
                                          "valid choices: least-load, prefix-aware, round-robin"):
        load_policy("prefix-awre", {}, 2)
    with pytest.raises(ConfigError, match="invalid for routing policy 'prefix-aware'.*match_treshold.*its options"):
        load_policy("prefix-aware", {"match_treshold": 0.3}, 2)
    with pytest.raises(ConfigError, match="must start with http"):
        router_config(replicas=["127.0.0.1:8000"])
    with pytest.raises(ConfigError, match="replicas"):
        router_config(replicas=[])


def test_a_client_that_leaves_closes_its_replicas_answer(fakes, router):
    (url0, state0), _ = fakes
    url = router([url0])
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client leaves before the answer
        httpx.post(url + "/v1/completions", json={"prompt": "x", "wait_for_disconnect": True}, timeout=0.5)
    poll(lambda: state0.closed == 1, what="the replica seeing its client leave")
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "x", "stream": True, "endless": True}) as resp:
        next(resp.iter_lines())  # streamed: the client leaves after the first event
    poll(lambda: state0.closed == 2, what="the replica's stream closed")
    poll(lambda: httpx.get(url + "/health").json()["replicas"][0]["in_flight"] == 0, what="nothing in flight")
    assert httpx.get(url + "/health").json()["replicas"][0]["healthy"]  # a client leaving is no replica failure


def test_a_mirror_sends_every_request_to_both_and_answers_with_a(fakes, router):
    from tessellm.serve.router.mirror import Mirror

    (url0, state0), (url1, state1) = fakes
    mirror = Mirror(("r0", "r1"))
    url = router([url0, url1], mirror=mirror)
    answer = client(url).completions.create(model="fake", prompt="hi", max_tokens=4, temperature=0)
    assert answer.choices[0].text.startswith("r0:")
    chunks = list(client(url).completions.create(model="fake", prompt="hi", max_tokens=4, stream=True, seed=1))
    assert all(c.choices for c in chunks)  # the usage chunk the mirror asked for is not passed on
    assert state1.bodies[-1]["stream_options"] == {"include_usage": True}
    client(url).completions.create(model="fake", prompt="hi", max_tokens=4)  # sampled: speed only
    poll(lambda: httpx.get(url + "/ab").json()["requests"] == 3, what="3 mirrored requests")
    report = httpx.get(url + "/ab").json()
    assert len(state0.bodies) == len(state1.bodies) == 3
    assert report["a"]["answered"] == report["b"]["answered"] == 3 and report["pairs"] == 3
    # the fakes answer with their own names: the texts differ on both comparable requests
    assert report["compared"] == 2 and report["exact_match_rate"] == 0.0 and report["not_comparable"] == 1
    assert report["a"]["url"] == url0 and report["a"]["ttft_ms"]["p50"] is not None


def test_a_mirror_whose_b_arm_is_down_still_answers_and_counts_b_failed(fakes, router, dead_url):
    from tessellm.serve.router.mirror import Mirror

    (url0, _) = fakes[0]
    url = router([url0, dead_url], mirror=Mirror())
    answer = httpx.post(url + "/v1/completions", json={"prompt": "hi", "temperature": 0})
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"].startswith("r0:")
    poll(lambda: httpx.get(url + "/ab").json()["requests"] == 1, what="the mirrored request")
    report = httpx.get(url + "/ab").json()
    assert report["a"]["answered"] == 1 and report["b"]["failed"] == 1 and "arm B unreachable" in report["b"]["errors"][0]
