"""Multi-LoRA in the engine: each request's greedy tokens equal transformers + PEFT's under
its adapter, alone or in a batch mixing adapters and the base model, through every engine
path (continuous batching, chunked prefill, preemption, speculative decoding, n > 1, the
CUDA-graph decode path, slots shared by more adapters than fit); the prefix cache keeps
adapters apart; adapters load and unload at run time; bad adapters are refused at load."""

from __future__ import annotations

import json

import pytest
import torch

from tessellm import LLM
from tessellm.core.errors import InvalidRequestError, LoraAdapterError
from tessellm.testing.lora import build_tiny_lora, peft_greedy, peft_model
from tessellm.testing.models import build_tiny

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[1, 5, 9, 33, 7], [1, 44, 12], [1, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110], [1, 7]]
MAX_TOKENS = 8
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama, three adapters of different ranks, targets and scalings, and PEFT's
    greedy tokens for every prompt under each (None: the base model)."""
    root = tmp_path_factory.mktemp("lora-llama")
    base = build_tiny("llama", root / "base")
    adapters = {
        "all8": build_tiny_lora(base, root / "all8", rank=8, alpha=16, target_modules=ALL, seed=1),
        "qv4": build_tiny_lora(base, root / "qv4", rank=4, alpha=8, target_modules=("q_proj", "v_proj"), seed=2,
                               use_rslora=True),
        "mlp16": build_tiny_lora(base, root / "mlp16", rank=16, alpha=4, seed=3,
                                 target_modules=("gate_proj", "up_proj", "down_proj", "o_proj"),
                                 rank_pattern={"down_proj": 2}, alpha_pattern={"down_proj": 7}),
    }
    expected = {}
    for name, folder in [*adapters.items(), (None, None)]:
        model = peft_model(base, folder)
        expected[name] = [peft_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    return base, adapters, expected


def config(base, adapters, **extra):
    return {"model": str(base), "device": "cpu", "dtype": "float32", "max_model_len": 128,
            "lora": {"adapters": {k: str(v) for k, v in adapters.items()}, **extra.pop("lora", {})}, **extra}


PAGED = {"cache": {"name": "paged", "options": {"block_size": 4, "num_blocks": 64}},
         "scheduler": {"name": "continuous", "options": {"max_num_batched_tokens": 64}}}


@pytest.fixture(scope="module")
def paged_llm(llama):
    base, adapters, _ = llama
    return LLM(config(base, adapters, **PAGED))


def tokens(outputs):
    return [o.token_ids for o in outputs]


def test_each_adapter_alone_equals_peft(llama, paged_llm):
    _, adapters, expected = llama
    for name in [*adapters, None]:
        assert tokens(paged_llm.generate(PROMPTS, GREEDY, lora=name)) == expected[name], name
    assert expected["all8"] != expected[None] and expected["qv4"] != expected[None]


def test_a_batch_mixing_three_adapters_and_the_base(llama, paged_llm):
    _, _, expected = llama
    names = ["all8", "qv4", None, "mlp16", "qv4", None, "all8", "mlp16"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    got = tokens(paged_llm.generate(prompts, GREEDY, lora=names))
    assert got == [expected[n][i % len(PROMPTS)] for i, n in enumerate(names)]
    adapters = paged_llm.engine.lora
    assert adapters.num_pinned() == 0  # every finished request let go of its slot


def test_prefix_cache_shares_blocks_within_an_adapter_only(llama, paged_llm):
    base, adapters, _ = llama
    prompt = list(range(200, 212))  # 12 tokens no other test runs: three full blocks of 4
    expected = {name: peft_greedy(peft_model(base, adapters.get(name)), prompt, MAX_TOKENS)
                for name in ("all8", "qv4", None)}
    first = paged_llm.generate([prompt], GREEDY, lora="all8")[0]
    again = paged_llm.generate([prompt], GREEDY, lora="all8")[0]
    other = paged_llm.generate([prompt], GREEDY, lora="qv4")[0]
    base_out = paged_llm.generate([prompt], GREEDY)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 8)
    assert (other.num_cached_tokens, base_out.num_cached_tokens) == (0, 0)
    assert [first.token_ids, again.token_ids, other.token_ids, base_out.token_ids] == \
        [expected["all8"], expected["all8"], expected["qv4"], expected[None]]


def test_chunked_prefill_and_preemption_keep_each_adapters_tokens(llama):
    """A 4-token step budget chunks every prompt; 9 blocks of 4 for 8 requests forces
    preemption and recomputation under the adapter."""
    base, adapters, expected = llama
    llm = LLM(config(base, adapters, cache={"name": "paged", "options": {"block_size": 4, "num_blocks": 9}},
                     scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 6}}))
    names = ["all8", None, "qv4", "mlp16", "all8", "qv4", None, "mlp16"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    got = tokens(llm.generate(prompts, GREEDY, lora=names))
    assert got == [expected[n][i % len(PROMPTS)] for i, n in enumerate(names)]
    assert llm.engine.stats.preemptions > 0
    assert llm.pipeline.cache.num_free_blocks == llm.pipeline.cache.num_blocks


def test_more_adapters_than_slots_wait_and_take_turns(llama):
    """One slot for three adapters: requests for an adapter not resident wait while the slot
    is held, the least recently used adapter leaves, and every request gets its tokens."""
    base, adapters, expected = llama
    llm = LLM(config(base, adapters, lora={"max_loras": 1}, **PAGED))
    names = ["all8", "qv4", "all8", None, "mlp16", "qv4"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    got = tokens(llm.generate(prompts, GREEDY, lora=names))
    assert got == [expected[n][i % len(PROMPTS)] for i, n in enumerate(names)]
    lora = llm.engine.lora
    assert lora.loads >= 3 and lora.num_pinned() == 0 and len(lora.resident()) == 1


def test_a_request_waiting_for_a_slot_can_be_aborted(llama):
    base, adapters, expected = llama
    llm = LLM(config(base, adapters, lora={"max_loras": 1}, **PAGED))
    engine = llm.engine
    engine.add_request("held", PROMPTS[0], llm_params(), lora="all8")
    engine.add_request("waits", PROMPTS[1], llm_params(), lora="qv4")  # the one slot is held
    engine.step()
    assert [s.request_id for s in engine.scheduler.unfinished()] == ["held"]
    engine.abort("waits")
    done = {}
    while engine.has_unfinished():
        for state in engine.step():
            done[state.request_id] = state
    assert list(done) == ["held"] and done["held"].seqs[0].output_token_ids == expected["all8"][0]
    assert engine.lora.num_pinned() == 0 and engine.lora.resident() == ["all8"]


@pytest.mark.parametrize("proposer", [{"proposer": "ngram"}, {"proposer": "layer-skip", "draft_layers": [0]}])
def test_speculative_decoding_under_adapters(llama, proposer):
    """Drafts verified under each request's adapter (a layer-skip draft runs it too) give
    plain greedy's tokens."""
    base, adapters, expected = llama
    llm = LLM(config(base, adapters, decoding={"name": "speculative", "options": {**proposer, "k": 3}}, **PAGED))
    names = ["all8", "qv4", None, "mlp16"]
    got = tokens(llm.generate(PROMPTS, GREEDY, lora=names))
    assert got == [expected[n][i] for i, n in enumerate(names)]


def test_parallel_samples_fork_under_the_adapter(llama, paged_llm):
    _, _, expected = llama
    out = paged_llm.generate([PROMPTS[0]], {**GREEDY, "n": 3}, lora="mlp16")[0]
    assert [o.token_ids for o in out.outputs] == [expected["mlp16"][0]] * 3
    assert paged_llm.engine.lora.num_pinned() == 0


@pytest.mark.parametrize("kernel", ["torch", pytest.param("triton", marks=pytest.mark.extended)])
def test_recorded_decode_graphs_with_adapters_equal_peft(llama, kernel, monkeypatch):
    """The padded static-buffer decode path with its graphs recorded at start-up, before any
    adapter is in a slot, and replayed as CUDA graphs are (tessellm.testing.graph_replay:
    launches and host-side values fixed at capture, tensors read as they are at replay) over
    batches the capture never saw: three adapters of ranks 4 to 16 over two slots beside a
    base row (a slot reloaded with another rank and other targets between replays), then base
    rows only. Every request's tokens equal PEFT's. The torch kernel's captured expand once
    read a copy of B made at capture (all zeros), so replays lost the adapters' deltas, as on
    the H200 of 2026-11-28; this test fails on that code."""
    if kernel == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from tessellm.testing.graph_replay import emulate_decode_graphs

    base, adapters, expected = llama
    llm = LLM(config(base, adapters, attention={"name": "flash"}, lora={"name": kernel, "max_loras": 2}, **PAGED))
    graphs = emulate_decode_graphs(llm.pipeline.runner, max_batch=4, max_model_len=128)
    names = ["all8", None, "qv4", "mlp16"]
    got = tokens(llm.generate(PROMPTS, GREEDY, lora=names))
    assert got == [expected[n][i] for i, n in enumerate(names)]
    assert graphs.lora_replays >= MAX_TOKENS - 1 and llm.engine.lora.loads == 3
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected[None]
    assert graphs.replays > graphs.lora_replays


def test_overlapped_steps_with_adapters(llama):
    """Async scheduling launches each decode step before the last one's tokens land; the
    adapters' rows ride along."""
    base, adapters, expected = llama
    llm = LLM(config(base, adapters, async_scheduling=True, decoding={"name": "greedy"}, **PAGED))
    names = ["qv4", "all8", None, "mlp16"]
    assert tokens(llm.generate(PROMPTS, GREEDY, lora=names)) == [expected[n][i] for i, n in enumerate(names)]


def test_warm_up_runs_every_shape_under_an_adapter_slot(paged_llm):
    from tessellm.core.engine.warm_up import warm_up

    runner, cache = paged_llm.pipeline.runner, paged_llm.pipeline.cache
    free = cache.num_free_blocks
    lora, runner.lora = runner.lora, None
    try:
        plain = warm_up(runner, 16, 128)
    finally:
        runner.lora = lora
    assert warm_up(runner, 16, 128) == 2 * plain
    assert cache.num_free_blocks == free


def test_load_use_and_unload_at_run_time(llama):
    base, adapters, expected = llama
    llm = LLM(config(base, {}, lora={"enabled": True, "max_loras": 2}, **PAGED))
    assert llm.lora_adapters == []
    with pytest.raises(LoraAdapterError, match="'qv4' is not loaded; loaded adapters: none"):
        llm.generate([PROMPTS[0]], GREEDY, lora="qv4")
    llm.load_lora("qv4", adapters["qv4"])
    assert tokens(llm.generate(PROMPTS, GREEDY, lora="qv4")) == expected["qv4"]
    with pytest.raises(LoraAdapterError, match="already loaded"):
        llm.load_lora("qv4", adapters["all8"])
    llm.unload_lora("qv4")
    with pytest.raises(LoraAdapterError, match="not loaded"):
        llm.generate([PROMPTS[0]], GREEDY, lora="qv4")
    # the name again, other weights: nothing of the old registration is reused
    llm.load_lora("qv4", adapters["all8"])
    assert tokens(llm.generate(PROMPTS, GREEDY, lora="qv4")) == expected["all8"]


def test_unload_while_a_request_runs_lets_it_finish(llama):
    base, adapters, expected = llama
    llm = LLM(config(base, adapters, **PAGED))
    engine = llm.engine
    engine.add_request("r", PROMPTS[1], llm_params(), lora="all8")
    engine.step()
    engine.unload_lora("all8")
    done = {}
    while engine.has_unfinished():
        for state in engine.step():
            done[state.request_id] = state
    assert done["r"].seqs[0].output_token_ids == expected["all8"][1]
    assert engine.lora.num_pinned() == 0 and engine.lora.resident() == []


def llm_params():
    from tessellm.core.interfaces.sequence import SamplingParams

    return SamplingParams(**GREEDY)


def test_requests_naming_adapters_where_lora_is_off(llama):
    base, _, _ = llama
    llm = LLM({"model": str(base), "device": "cpu", "dtype": "float32"})
    with pytest.raises(InvalidRequestError, match="serves no adapters"):
        llm.generate([PROMPTS[0]], GREEDY, lora="all8")
    with pytest.raises(InvalidRequestError, match="lora must be a string or None"):
        llm.generate([PROMPTS[0]], GREEDY, lora=3)


# ---------------------------------------------------------------- refused at load


def _edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def lora_engine(llama):
    base, _, _ = llama
    return LLM({"model": str(base), "device": "cpu", "dtype": "float32",
                "lora": {"enabled": True, "max_rank": 8, "target_modules": ["q_proj", "v_proj", "o_proj"]}})


def test_rank_above_the_maximum(tmp_path, llama, lora_engine):
    base, _, _ = llama
    folder = build_tiny_lora(base, tmp_path / "big", rank=16, target_modules=("q_proj",))
    with pytest.raises(LoraAdapterError, match=r"rank 16, above lora.max_rank 8"):
        lora_engine.load_lora("big", folder)


def test_target_the_pipeline_does_not_wrap(llama, lora_engine):
    _, adapters, _ = llama
    with pytest.raises(LoraAdapterError, match=r"does not wrap for LoRA \(lora.target_modules: q_proj, v_proj, o_proj"):
        lora_engine.load_lora("all", adapters["all8"])


def test_adapter_of_another_base_model(tmp_path, lora_engine):
    other = build_tiny("llama", tmp_path / "other", hidden_size=32, intermediate_size=48, num_attention_heads=2,
                       num_key_value_heads=1)
    folder = build_tiny_lora(other, tmp_path / "wrong", rank=4, target_modules=("q_proj",))
    with pytest.raises(LoraAdapterError, match="maps 32 features to 32, but this model's q_proj maps 64 to 64: the "
                                               "adapter was trained for another base model"):
        lora_engine.load_lora("wrong", folder)


@pytest.mark.parametrize("change, message", [
    ({"peft_type": "IA3"}, "peft_type is 'IA3'; only LORA adapters are served"),
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias 'all'"),
    ({"lora_alpha": "big"}, "lora_alpha for .*q_proj is 'big', not a number"),
    ({"alpha_pattern": {"q_proj[": 4}, "lora_alpha": "x"}, "lora_alpha for .* is 'x'"),  # no regex: a name only
])
def test_adapter_configs_refused(tmp_path, llama, lora_engine, change, message):
    base, _, _ = llama
    folder = build_tiny_lora(base, tmp_path / "a", rank=4, target_modules=("q_proj",))
    _edit_config(folder, **change)
    with pytest.raises(LoraAdapterError, match=message):
        lora_engine.load_lora("a", folder)
    assert "a" not in lora_engine.lora_adapters


def test_missing_files_and_embedding_targets(tmp_path, llama, lora_engine):
    base, _, _ = llama
    with pytest.raises(LoraAdapterError, match="has no adapter_config.json"):
        lora_engine.load_lora("none", tmp_path)
    folder = build_tiny_lora(base, tmp_path / "emb", rank=4, target_modules=("embed_tokens",))
    with pytest.raises(LoraAdapterError, match="adapts an embedding"):
        lora_engine.load_lora("emb", folder)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraAdapterError, match="has no adapter_model.safetensors"):
        lora_engine.load_lora("emb", folder)


def test_bad_adapter_in_the_config_fails_the_start(tmp_path, llama):
    base, adapters, _ = llama
    with pytest.raises(LoraAdapterError, match="rank 16, above lora.max_rank 8"):
        LLM(config(base, {"big": adapters["mlp16"]}, lora={"max_rank": 8}))


# ---------------------------------------------------------------- other architectures


@pytest.mark.parametrize("model_type, targets", [
    ("qwen3", ALL),  # per-head q/k norms after the adapted projections
    ("phi3", ("qkv_proj", "gate_up_proj", "o_proj", "down_proj")),  # the checkpoint's own stacked projections
    ("mixtral", ("q_proj", "k_proj", "v_proj", "o_proj")),  # attention of a mixture-of-experts model
])
def test_other_architectures_equal_peft(tmp_path, model_type, targets):
    base = build_tiny(model_type, tmp_path / "base")
    folder = build_tiny_lora(base, tmp_path / "a", rank=8, target_modules=targets, seed=4)
    expected = [peft_greedy(peft_model(base, folder), p, MAX_TOKENS) for p in PROMPTS[:2]]
    llm = LLM({"model": str(base), "device": "cpu", "dtype": "float32", "lora": {
        "adapters": {"a": str(folder)}, "target_modules": list(targets)}})
    assert tokens(llm.generate(PROMPTS[:2], GREEDY, lora=["a", "a"])) == expected


def test_experts_are_refused_naming_the_module(tmp_path):
    from safetensors.torch import load_file, save_file

    base = build_tiny("mixtral", tmp_path / "base")
    folder = build_tiny_lora(base, tmp_path / "experts", rank=4, target_modules=("q_proj",))
    tensors = load_file(folder / "adapter_model.safetensors")
    expert = "base_model.model.model.layers.0.block_sparse_moe.experts.0.w1"  # Mixtral's per-expert name
    tensors.update({f"{expert}.lora_A.weight": torch.zeros(4, 64), f"{expert}.lora_B.weight": torch.zeros(48, 4)})
    save_file(tensors, folder / "adapter_model.safetensors")
    with pytest.raises(LoraAdapterError, match="mixture-of-experts expert"):
        LLM({"model": str(base), "device": "cpu", "dtype": "float32", "lora": {"adapters": {"e": str(folder)}}})


def test_the_embedded_smollm2_with_a_random_adapter(smollm2_dir, tmp_path):
    """The real model in float32 under a random rank-8 adapter on every projection: the
    greedy tokens equal transformers + PEFT's (and differ from the base model's)."""
    folder = build_tiny_lora(smollm2_dir, tmp_path / "smol", rank=8, alpha=16, target_modules=ALL, seed=7, std=0.08)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 378, 1296, 253, 655]]
    expected = [peft_greedy(peft_model(smollm2_dir, folder), p, 4) for p in prompts]
    llm = LLM({"model": "smollm2-135m", "device": "cpu", "dtype": "float32",
               "lora": {"adapters": {"smol": str(folder)}}})
    params = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    assert tokens(llm.generate(prompts, params, lora="smol")) == expected
    assert tokens(llm.generate(prompts, params)) != expected


def test_adapters_over_an_int8_base(llama):
    """The wrapped projection's base may be a quantized layer (q/k/v stacked before the
    quantizer replaced them, their parts carried over): the adapter adds to its output."""
    base, adapters, _ = llama
    llm = LLM(config(base, {"all8": adapters["all8"]}, quant={"name": "int8-weight"}))
    wrapped = llm.pipeline.lora.layers["model.layers.0.self_attn.qkv_proj"]
    assert type(wrapped.base).__name__ == "Int8WeightLinear"
    assert tokens(llm.generate(PROMPTS, GREEDY, lora="all8")) != tokens(llm.generate(PROMPTS, GREEDY))


def test_lora_config_errors():
    from tessellm.core.config import config_from_dict
    from tessellm.core.errors import ConfigError

    with pytest.raises(ConfigError, match="lora.adapters is set but lora.enabled is false"):
        config_from_dict({"lora": {"enabled": False, "adapters": {"a": "/x"}}})
    with pytest.raises(ConfigError, match="lora.max_lora: unknown field; allowed: name, options, enabled, adapters, "
                                          "max_loras, max_rank"):
        config_from_dict({"lora": {"max_lora": 2}})


def test_prefix_keys_follow_adapter_weights_not_registrations(llama, paged_llm):
    """The prefix key folds in a digest of the adapter's weights: the same folder read twice
    gives the same key (so a disk tier serves it after a restart), another adapter another."""
    _, adapters, _ = llama
    reader = paged_llm.engine.lora.reader
    first, again = (reader.read("x", adapters.get("all8")) for _ in range(2))
    other = reader.read("x", adapters.get("qv4"))
    assert first.digest() == again.digest() != other.digest()
    assert paged_llm.engine._lora_salt("all8", "t") == f"t\x1flora:{paged_llm.engine.lora.get('all8').digest()}"
