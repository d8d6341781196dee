"""An ``LLM`` whose engine a server steps on a thread of the same process (``build_app(llm)``)
may still be called directly: its calls and the server's engine core take turns on the
engine (``Engine.lock``), so neither steps the other's requests half-way nor loses them."""

from __future__ import annotations

import threading

import httpx

from tessellm import LLM
from tessellm.serve.app import build_app
from tessellm.testing.serving import serving

GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def test_direct_calls_and_server_requests_at_once_both_finish_with_their_own_tokens(cpu_config, tiny_model):
    llm = LLM(cpu_config(tiny_model("llama"), max_model_len=128, scheduler={"name": "continuous"},
                         cache={"name": "paged", "options": {"block_size": 8, "num_blocks": 256}},
                         decoding={"name": "greedy"}))
    prompts = [[5 + i, 6, 7 + 2 * i] for i in range(4)]
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    with serving(build_app(llm, model_name="tiny")) as url:
        direct, served, errors = [], [], []

        def call_direct():
            try:
                for _ in range(3):
                    direct.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
            except Exception as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

        def call_server(i: int):
            try:
                for _ in range(3):
                    r = httpx.post(f"{url}/v1/completions", timeout=120,
                                   json={"model": "tiny", "prompt": prompts[i], **GREEDY})
                    served.append((i, r.status_code, r.json()["choices"][0]["text"]))
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=call_direct) for _ in range(2)]
        threads += [threading.Thread(target=call_server, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert direct == [expected] * 6
    assert sorted(s[0] for s in served) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert all(code == 200 and text == llm.tokenizer.decode(expected[i]) for i, code, text in served)
    assert llm.engine.cache.num_free_blocks == llm.engine.cache.num_blocks
