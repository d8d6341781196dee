"""Run-time contract checks (core/engine/contracts.py): a plugin that returns quietly with
something wrong is one line naming it, the rule and the docs section, at its first run;
the command exits 2, and the engine keeps nothing of the failed requests."""

from __future__ import annotations

import numpy as np
import pytest

import tessellm
from tessellm import ContractError, LLM
from tessellm.cli import main
from tessellm.core.interfaces.batch import SchedulerOutput
from tessellm.plugins.attention.sdpa import SdpaAttention
from tessellm.plugins.cache.contiguous import ContiguousCache
from tessellm.plugins.decoding.greedy import GreedyDecoder
from tessellm.plugins.scheduler.static import StaticScheduler

DOCS = "docs/plugins.md#contract-checks-at-run-time"


class _NoStore:
    """A layer's KV storage whose ``store`` does nothing."""

    def __init__(self, kv):
        self._kv = kv

    def store(self, k, v, slot_mapping):
        pass

    def __getattr__(self, name):
        return getattr(self._kv, name)


class ForgetfulAttention(SdpaAttention):
    """Attends without storing the step's K/V (the author trial's first mistake)."""

    name = "forgetful"
    api_version = "1.6"
    auto_priority = None

    def forward(self, layer, q, k, v, kv, plan):
        return super().forward(layer, q, k, v, _NoStore(kv), plan)


class TwoTokens(GreedyDecoder):
    name = "two-tokens"
    api_version = "1.6"
    auto_priority = None

    def decode(self, logits, batch):
        return [t * 2 for t in super().decode(logits, batch)]


class PlainInts(GreedyDecoder):
    name = "plain-ints"
    api_version = "1.6"
    auto_priority = None

    def decode(self, logits, batch):
        return [t[0] for t in super().decode(logits, batch)]


class NumpyInts(GreedyDecoder):
    name = "numpy-ints"
    api_version = "1.6"
    auto_priority = None

    def decode(self, logits, batch):
        return [[np.int64(t[0])] for t in super().decode(logits, batch)]


class NumpyForOne(GreedyDecoder):
    """Breaks its contract only for requests whose prompt holds token 4242."""

    name = "numpy-for-one"
    api_version = "1.6"
    auto_priority = None

    def decode(self, logits, batch):
        tokens = super().decode(logits, batch)
        return [[np.int64(t[0])] if 4242 in s.seq.token_ids[:3] else t for s, t in zip(batch.samples, tokens)]


class IdleScheduler(StaticScheduler):
    name = "idle"
    api_version = "1.6"
    auto_priority = None

    def schedule(self):
        return SchedulerOutput()


class OneRowCache(ContiguousCache):
    """Gives every sequence the same row of the storage."""

    name = "one-row"
    api_version = "1.6"
    auto_priority = None

    def block_table(self, seq):
        return [0]


@tessellm.hookimpl
def register_attention(register):
    register(ForgetfulAttention)


@tessellm.hookimpl
def register_decoding(register):
    for cls in (TwoTokens, PlainInts, NumpyInts, NumpyForOne):
        register(cls)


@tessellm.hookimpl
def register_scheduler(register):
    register(IdleScheduler)


@tessellm.hookimpl
def register_cache(register):
    register(OneRowCache)


BROKEN = {
    "attention": ({"attention": {"name": "forgetful"}},
                  r"attention plugin 'forgetful' \(module .*\) broke its contract: forward left 3 of the 3 new cache "
                  r"slots of layer 0 unwritten"),
    "decoder count": ({"decoding": {"name": "two-tokens"}},
                      r"decoding plugin 'two-tokens' .* decode returned 2 tokens for sample slot 0, which verifies 0 "
                      r"drafts"),
    "decoder type": ({"decoding": {"name": "plain-ints"}},
                     r"decoding plugin 'plain-ints' .* decode returned the int \d+ for sample slot 0; each slot's "
                     r"entry is a list"),
    "decoder token type": ({"decoding": {"name": "numpy-ints"}},
                           r"decode returned a numpy.int64 \(\d+\), not a Python int for sample slot 0"),
    "scheduler": ({"scheduler": {"name": "idle"}},
                  r"scheduler plugin 'idle' .* schedule returned an empty batch while 2 requests wait and 0 run"),
    "cache": ({"cache": {"name": "one-row", "options": {"max_seqs": 4}}},
              r"cache plugin 'one-row' .* slot 0 was handed to two query tokens of one step"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_plugin_is_one_line_at_its_first_run_and_nothing_is_left(case, authors_plugins, tiny_model,
                                                                          cpu_config):
    overrides, message = BROKEN[case]
    llm = LLM(cpu_config(tiny_model("llama"), **{"decoding": {"name": "greedy"}, **overrides}))
    with pytest.raises(ContractError, match=message) as raised:
        llm.generate([[5, 6, 7], [9, 10, 11]], {"max_tokens": 3})
    assert "\n" not in str(raised.value) and DOCS in str(raised.value)
    engine = llm.engine
    assert not engine.requests and not engine.failures and not engine.has_unfinished()
    assert engine.cache.num_free_blocks == engine.cache.num_blocks


def test_the_command_prints_one_line_and_exits_2(authors_plugins, tiny_model, capsys):
    status = main(["generate", "--set", f"model={tiny_model('llama')}", "--set", "device=cpu",
                   "--set", "dtype=float32", "--set", "attention.name=forgetful", "--max-tokens", "2", "hi"])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.count("\n") == 0 and err.startswith("tessellm: error: attention plugin 'forgetful'"), err
    assert "Traceback" not in err


def test_the_server_answers_500_with_the_line_and_serves_the_others(authors_plugins, tiny_model, cpu_config):
    import httpx

    from tessellm.serve.app import build_app
    from tessellm.testing.serving import serving

    llm = LLM(cpu_config(tiny_model("llama"), decoding={"name": "numpy-for-one"},
                         cache={"name": "paged", "options": {"block_size": 8}}, scheduler={"name": "continuous"}))
    with serving(build_app(llm, model_name="tiny")) as url:
        bad = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [17, 4242, 6], "max_tokens": 3, "temperature": 0})
        good = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [17, 42, 6], "max_tokens": 3, "temperature": 0})
    assert bad.status_code == 500, bad.text
    message = bad.json()["error"]["message"]
    assert "decoding plugin 'numpy-for-one'" in message and "broke its contract" in message and DOCS in message
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3


def test_a_correct_pipeline_passes_every_check_of_the_debug_mode(monkeypatch, tiny_model, cpu_config):
    """``TESSELLM_CHECK_CONTRACTS=1``: the backend check on every forward and the held-slot
    check every step, over prefix sharing, forks (n > 1), preemption and chunked prefill."""
    monkeypatch.setenv("TESSELLM_CHECK_CONTRACTS", "1")
    config = cpu_config(tiny_model("llama"), cache={"name": "paged", "options": {"block_size": 4, "num_blocks": 24}},
                        scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 16}})
    llm = LLM(config)
    assert llm.engine._kv_check.always
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13]] * 2 + [[20 + i for i in range(15)], [3, 4]]
    outs = llm.generate(prompts, {"max_tokens": 8, "temperature": 1.0, "seed": 1, "n": 2, "ignore_eos": True})
    assert all(len(c.token_ids) == 8 for o in outs for c in o.outputs)


def test_the_debug_mode_finds_a_block_held_by_another_sequence(monkeypatch, tiny_model, cpu_config):
    """Two sequences sharing a block they both write: only visible across steps, so only the
    per-step check (with ``TESSELLM_CHECK_CONTRACTS``) finds it."""
    from tessellm.plugins.cache.paged.manager import PagedCache

    monkeypatch.setenv("TESSELLM_CHECK_CONTRACTS", "1")
    llm = LLM(cpu_config(tiny_model("llama"), cache={"name": "paged", "options": {"block_size": 4}},
                         scheduler={"name": "continuous"}, decoding={"name": "greedy"}))
    real = PagedCache.block_table
    first = {}

    def shared_first_block(self, seq):  # every sequence's first block is the first one handed out
        table = list(real(self, seq))
        if table:
            first.setdefault("block", table[0])
            table[0] = first["block"]
        return table

    monkeypatch.setattr(PagedCache, "block_table", shared_first_block)
    engine = llm.engine
    greedy = tessellm.SamplingParams(max_tokens=4)
    engine.add_request("a", [5, 6, 7], greedy)
    engine.step()  # a's prompt fills slots 0-2 of the block
    engine.add_request("b", [8, 9], greedy)  # b's prompt would overwrite them
    with pytest.raises(ContractError, match=r"cache plugin 'paged' .* holds a computed token of a live sequence"):
        engine.step()
