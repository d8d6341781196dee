"""`tessellm serve` driven by the official openai client on 127.0.0.1: completions and chat,
streamed and not, bad input, a disconnect that frees its blocks, an injected engine fault,
and 64 concurrent streaming clients whose greedy outputs equal the offline ones."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from tessellm import LLM
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.serve.app import build_app
from tessellm.testing.serving import serving

KEY = "test-key"
MODEL = "tiny"


def pipeline_config(cpu_config, tiny_model) -> dict:
    return cpu_config(tiny_model("llama"), max_model_len=256,
                      cache={"name": "paged", "options": {"block_size": 8, "num_blocks": 1024}},
                      scheduler={"name": "continuous", "options": {"max_num_seqs": 64, "max_num_batched_tokens": 512}})


@pytest.fixture(scope="module")
def offline(cpu_config, tiny_model):
    return LLM(pipeline_config(cpu_config, tiny_model))


@pytest.fixture(scope="module")
def server(cpu_config, tiny_model):
    """A real server on a free port, with an API key; yields (base_url, llm)."""
    llm = LLM(pipeline_config(cpu_config, tiny_model))
    with serving(build_app(llm, model_name=MODEL, api_key=KEY, max_request_bytes=64 * 1024)) as url:
        yield url, llm


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def wait_idle(llm: LLM, timeout: float = 20.0) -> None:
    """Until the engine holds no request and every block is free again."""
    cache, deadline = llm.pipeline.cache, time.time() + timeout
    while llm.engine.requests or cache.num_free_blocks != cache.num_blocks:
        assert time.time() < deadline, f"{len(llm.engine.requests)} requests, {cache.num_free_blocks} free blocks"
        time.sleep(0.02)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(server[0] + "/health").json()
    assert health["status"] == "ok" and health["engine_core"]["mode"] == "thread" and health["engine_core"]["alive"]


def test_completion_equals_offline_generation(client, offline):
    for prompt in PROMPTS:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        ref = offline.generate([prompt], {"max_tokens": 12})[0]
        assert out.choices[0].text == ref.text
        assert out.choices[0].finish_reason == ref.finish_reason
        assert out.usage.completion_tokens == len(ref.token_ids)
        assert out.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_streamed_completion_concatenates_to_the_same_text(client, offline):
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline.generate([PROMPTS[1]], {"max_tokens": 20})[0].text
    assert len([c for c in chunks if c.choices]) > 1  # really streamed
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streamed_and_not(client, offline):
    messages = [{"role": "user", "content": "Name three fruits."}]
    ref = offline.generate(["Name three fruits."], {"max_tokens": 16}, chat=True)[0].text
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert full.choices[0].message.content == ref and full.choices[0].message.role == "assistant"
    parts = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == ref


def test_n_seed_and_stop(client):
    a = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0.9, n=3, seed=7)
    b = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0.9, n=3, seed=7)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 3
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0).choices[0].text
    stop = full[3:6]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop],
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_logprobs_completions_and_chat(client, offline):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    ref = offline.generate([PROMPTS[0]], {"max_tokens": 6, "logprobs": 2})[0].outputs[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in ref], abs=1e-5)
    assert all(len(t) == 2 for t in lp.top_logprobs) and "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob <= 0 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2,
                                         stream=True)
    chunks = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [v for c in chunks for v in c.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset  # offsets run on across chunks


def test_vllm_style_top_k_and_min_p_reach_the_sampler(client):
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        sampled = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=3,
                                            extra_body=extra)
        assert sampled.choices[0].text == greedy.choices[0].text, extra


@pytest.mark.parametrize("body, words", [
    ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, ["max_tokens"]),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10 ** 9}, ["max_tokens"]),
    ({"model": MODEL, "prompt": "hi", "n": 1000}, ["n"]),
    ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, ["temperature"]),
    ({"model": MODEL, "prompt": "word " * 400}, ["context window"]),
    ({"model": MODEL, "prompt": [1, 2, 10 ** 8]}, ["vocabulary"]),
    ({"model": MODEL, "prompt": ""}, ["empty"]),
    ({"model": MODEL}, ["prompt"]),
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, ["logprobs"]),
    ({"model": MODEL, "prompt": "hi", "min_p": 1.5}, ["min_p"]),
    ({"model": MODEL, "prompt": "hi", "extra_args": {"beam": 2}}, ["decoding plugin 'sample' takes no extra_args",
                                                                   "beam"]),
])
def test_bad_input_is_a_400_with_an_openai_error_body(server, body, words):
    r = httpx.post(server[0] + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and all(w in err["message"] for w in words), err
    wait_idle(server[1])


def test_an_image_for_a_text_only_model_is_a_400_and_the_server_serves_on(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    r = httpx.post(server[0] + "/v1/chat/completions", headers=headers, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "text-only model" in err["message"] and err["param"] == "messages", err
    r = httpx.post(server[0] + "/v1/chat/completions", headers=headers, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert r.status_code == 200, r.text


def test_malformed_json_auth_and_size_limit(server):
    url, headers = server[0] + "/v1/completions", {"Authorization": f"Bearer {KEY}",
                                                    "Content-Type": "application/json"}
    r = httpx.post(url, content=b'{"model": "tiny", "prompt": ', headers=headers)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url, content=json.dumps({"model": MODEL, "prompt": "x" * 70_000}), headers=headers)
    assert r.status_code == 413


def test_disconnect_mid_stream_cancels_and_frees_blocks(server):
    url, llm = server
    wait_idle(llm)
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(g.startswith("data: ") for g in got)
    wait_idle(llm)  # the request was aborted and its blocks returned


def test_a_faulting_request_fails_alone_with_500_and_the_others_finish(server, offline):
    """A forward that raises whenever one request's token is in the batch: the engine reruns
    each sequence alone, fails only that request (500), and the streams beside it, in the
    same steps, finish with the tokens they get without the fault."""
    from openai import AsyncOpenAI

    url, llm = server
    runner = llm.pipeline.runner
    forward = runner.forward

    def faulty(batch, *args, **kwargs):
        if 4242 in batch.input_ids.tolist():
            raise RuntimeError("injected fault")
        return forward(batch, *args, **kwargs)

    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    refs = [o.text for o in offline.generate(prompts, {"max_tokens": 24})]

    async def good(c, prompt):
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def bad():
        await asyncio.sleep(0.05)  # join the others mid-generation
        async with httpx.AsyncClient() as h:
            return await h.post(url + "/v1/completions", json={"model": MODEL, "prompt": [17, 4242, 6], "max_tokens": 4},
                                headers={"Authorization": f"Bearer {KEY}"})

    async def run():
        async with AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as c:
            return await asyncio.gather(bad(), *(good(c, p) for p in prompts))

    runner.forward = faulty
    try:
        failed, *texts = asyncio.run(run())
    finally:
        runner.forward = forward
    assert failed.status_code == 500 and "injected fault" in failed.json()["error"]["message"]
    assert failed.json()["error"]["type"] == "server_error"
    assert texts == refs
    assert httpx.get(url + "/health").status_code == 200
    wait_idle(llm)


def test_offline_generate_raises_the_fault_and_leaves_nothing(cpu_config, tiny_model):
    llm = LLM(pipeline_config(cpu_config, tiny_model))
    forward = llm.pipeline.runner.forward

    def faulty(batch, *args, **kwargs):
        if 4242 in batch.input_ids.tolist():
            raise RuntimeError("injected fault")
        return forward(batch, *args, **kwargs)

    llm.pipeline.runner.forward = faulty
    engine = llm.engine  # in one batch, only the culprit fails; its neighbour's tokens are unchanged
    engine.add_request("bad", [17, 4242, 6], SamplingParams(max_tokens=4, temperature=0.8, seed=1))
    engine.add_request("good", [17, 18, 19], SamplingParams(max_tokens=4, temperature=0.8, seed=1))
    finished = engine.step()
    assert isinstance(engine.failures.pop("bad"), RuntimeError) and "bad" not in engine.requests
    while engine.has_unfinished():
        finished += engine.step()
    alone = LLM(pipeline_config(cpu_config, tiny_model)).generate([[17, 18, 19]], {"max_tokens": 4, "temperature": 0.8,
                                                                                  "seed": 1})[0]
    assert engine.pop_finished("good").seqs[0].output_token_ids == alone.token_ids
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.generate([[17, 4242, 6], [17, 18, 19]], {"max_tokens": 4})
    wait_idle(llm)
    assert not llm.engine.failures
    assert len(llm.generate([[17, 18, 19]], {"max_tokens": 4})[0].token_ids) == 4


def test_64_concurrent_streams_equal_offline_and_leak_nothing(server, offline):
    from openai import AsyncOpenAI

    url, llm = server
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(64)]
    refs = [o.text for o in offline.generate(prompts, {"max_tokens": 12})]

    async def one(c, prompt):
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def all_of_them():
        async with AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(all_of_them()) == refs
    wait_idle(llm)
    metrics = httpx.get(url + "/metrics").text
    assert "tessellm_time_to_first_token_seconds_count" in metrics and "tessellm_kv_blocks_free" in metrics


def test_a_full_waiting_queue_answers_429(cpu_config, tiny_model):
    """One sequence runs at a time and one may wait: a third request is turned away at once."""
    config = pipeline_config(cpu_config, tiny_model)
    config["scheduler"]["options"]["max_num_seqs"] = 1
    llm = LLM(config)
    forward = llm.pipeline.runner.forward

    def slow(batch, *args, **kwargs):  # a tiny model is too quick to be caught waiting
        time.sleep(0.02)
        return forward(batch, *args, **kwargs)

    llm.pipeline.runner.forward = slow
    with serving(build_app(llm, model_name=MODEL, max_waiting=1)) as url:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body) as first:
            lines = first.iter_lines()  # keep it: a dropped iterator closes the connection
            next(lines)  # running
            second = threading.Thread(target=httpx.post, args=(url + "/v1/completions",),
                                      kwargs={"json": {**body, "stream": False, "max_tokens": 4}, "timeout": 120})
            second.start()  # its answer waits for a free sequence slot (then is short: nothing waits on it)
            deadline = time.time() + 20
            while "tessellm_requests_waiting 1.0" not in httpx.get(url + "/metrics").text:
                assert time.time() < deadline
                time.sleep(0.02)
            r = httpx.post(url + "/v1/completions", json={**body, "stream": False})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        second.join(timeout=120)
        wait_idle(llm)


def test_bench_serve_measures_a_running_server(server, cpu_config, tiny_model, tmp_path, capsys):
    """`tessellm bench --serve URL`: Poisson arrivals, then a fixed concurrency; every request
    produces exactly its output length (ignore_eos), and goodput counts those within the SLOs."""
    from tessellm.cli import main

    url, llm = server
    config = tmp_path / "pipeline.json"
    config.write_text(json.dumps(pipeline_config(cpu_config, tiny_model)))
    common = ["bench", "--serve", url, "--config", str(config), "--served-model-name", MODEL, "--api-key", KEY,
              "--num-requests", "12", "--workload-set", "prompt_median=16", "--workload-set", "prompt_max=48",
              "--workload-set", "output_median=8", "--workload-set", "output_max=16", "--json"]
    plot = tmp_path / "serve.png"
    assert main(common + ["--request-rate", "50", "--slo-ttft-ms", "60000", "--plot", str(plot)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_requests"] == 12 and report["requests_meeting_slo"] == 12 and report["goodput_rps"] > 0
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert report[key]["p99"] >= report[key]["p50"] > 0
    from tessellm.bench.workloads import make_workload

    expected = make_workload("mixed", num_requests=12, tokenizer=llm.tokenizer, max_model_len=256, prompt_median=16,
                             prompt_max=48, output_median=8, output_max=16)
    assert report["total_output_tokens"] == sum(r.output_len for r in expected)
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert main(common + ["--max-concurrency", "3", "--slo-ttft-ms", "0.001"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests_meeting_slo"] == 0 and report["pipeline"]["max_concurrency"] == 3
    wait_idle(llm)
    assert main(common + ["--baseline", "hf"]) == 2
    capsys.readouterr()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # a port nobody listens on
    common[2] = f"http://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()
    assert main(common) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot benchmark" in err[0] and "tessellm serve" in err[0], err


def test_an_error_outside_a_step_never_kills_the_engine_loop(cpu_config, tiny_model, monkeypatch):
    """A bug in publishing or gauges after a step is logged; the loop keeps serving."""
    import tessellm.serve.engine_core as core_module

    llm = LLM(pipeline_config(cpu_config, tiny_model))
    app = build_app(llm, model_name=MODEL)
    engine = app.state.engine
    calls, gauges = [], core_module.gauges

    def broken(*args):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("gauges bug")
        return gauges(*args)

    monkeypatch.setattr(core_module, "gauges", broken)
    with serving(app) as url:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
        first = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert first.status_code == 200 and engine.errors == 1 and engine.alive
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == \
            first.json()["choices"][0]["text"]
        assert httpx.get(url + "/health").status_code == 200


def test_async_scheduling_server_streams_the_synchronous_texts(cpu_config, tiny_model, offline):
    """The same concurrent streams through an engine with async scheduling: texts equal
    offline generation, usage counts are exact, and nothing is left behind."""
    from openai import AsyncOpenAI

    config = {**pipeline_config(cpu_config, tiny_model), "async_scheduling": True}
    llm = LLM(config)
    lengths = [5, 17, 9, 24, 12, 3]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(lengths))]
    refs = [offline.generate([p], {"max_tokens": n, "ignore_eos": True})[0].text for p, n in zip(prompts, lengths)]

    async def one(c, prompt, n):
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            text += "".join(choice.text for choice in chunk.choices)
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def run(url):
        async with AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as c:
            return await asyncio.gather(*(one(c, p, n) for p, n in zip(prompts, lengths)))

    with serving(build_app(llm, model_name=MODEL, api_key=KEY)) as url:
        results = asyncio.run(run(url))
    assert [t for t, _ in results] == refs
    assert [n for _, n in results] == lengths
    assert llm.engine.stats.overlapped_steps > 0
    wait_idle(llm)
