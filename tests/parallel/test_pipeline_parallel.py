"""Pipeline parallelism on the CPU (gloo): the stage and micro-batch arithmetic, a stage's
module, checkpoint reads and KV cache holding its own layers only, the micro-batch path's
logits equal to one batch's in one process, and torchrun launches whose greedy tokens equal
one rank's: every built-in architecture's tiny checkpoint at P = 2 and P = 2 x T = 2 (one
launch each), P = 4 (middle stages), beams, penalties and drafts. LoRA, scoring, bench and
serving under stages, and a failing stage, are in test_tensor_parallel.py beside tensor
parallelism's. Bad sizes name the allowed ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

from tessellm.core.errors import ConfigError
from tessellm.core.parallel.stages import PipelineStage, plan_stages, split_for_microbatches
from tessellm.testing.launch import (PROMPTS, generate_args, one_rank, run_several_pipelines, token_ids,
                                     torchrun, write_config)
from tessellm.testing.models import TINY_SHAPES, build_tiny, build_tiny_llama


# ---------------------------------------------------------------- stages and micro-batches


def test_stages_split_layers_evenly_with_the_extra_ones_first():
    assert plan_stages(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert plan_stages(2, 2) == [(0, 1), (1, 2)]
    assert plan_stages(5, 2, [1, 4]) == [(0, 1), (1, 5)]


@pytest.mark.parametrize("stages, layers, message", [
    (3, None, r"parallel.pipeline 3 is more stages than this model's 2 decoder layers; allowed: 1 to 2"),
    (2, [2, 1], r"stage_layers \[2, 1\] must .* sum to the model's 2 decoder layers"),
    (2, [2, 0], r"at least one layer"),
    (2, [1, 1, 0], r"each of the 2 stages"),
])
def test_bad_stage_plans_name_what_is_allowed(stages, layers, message):
    with pytest.raises(ConfigError, match=message):
        plan_stages(2, stages, layers)


@given(st.integers(1, 64), st.integers(1, 8), st.data())
def test_stage_plans_cover_every_layer_once(num_layers, stages, data):
    if stages > num_layers:
        return
    bounds = plan_stages(num_layers, stages)
    assert [i for lo, hi in bounds for i in range(lo, hi)] == list(range(num_layers))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 8))
def test_micro_batches_are_contiguous_nonempty_and_balanced(counts, parts):
    bounds = split_for_microbatches(counts, parts)
    assert len(bounds) == min(parts, len(counts))
    assert bounds[0][0] == 0 and bounds[-1][1] == len(counts)
    assert all(lo < hi for lo, hi in bounds) and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    share = sum(counts) / len(bounds)
    assert all(sum(counts[lo:hi]) <= share + max(counts) for lo, hi in bounds)  # a run closes at its share


# ---------------------------------------------------------------- what one stage holds


def stage(index: int, size: int, layers: tuple[int, int]) -> PipelineStage:
    return PipelineStage(index, size, 1, index, None, torch.device("cpu"), None, layers)


@pytest.mark.parametrize("tied", [True, False])
def test_a_stage_reads_and_holds_only_its_layers(tmp_path, tied):
    from tessellm.core.model.loader import build_model, load_hf_config, load_state_dict
    from tessellm.core.registry import get_registry

    folder = build_tiny_llama(tmp_path / "m", num_hidden_layers=3, tie_word_embeddings=tied)
    arch = get_registry().architecture_for(load_hf_config(folder))
    spec = arch.load_spec(load_hf_config(folder))
    for s, want_layers in ((stage(0, 2, (0, 2)), {0, 1}), (stage(1, 2, (2, 3)), {2})):
        state = load_state_dict(folder, keep=lambda n, s=s: s.holds(n, tied))
        layers = {int(k.split(".")[2]) for k in state if k.startswith("model.layers.")}
        assert layers == want_layers
        assert ("model.embed_tokens.weight" in state) == (s.first or tied)
        assert ("model.norm.weight" in state) == s.last
        model = build_model(spec, state, torch.device("cpu"), torch.float32, stage=s)
        params = dict(model.named_parameters())
        assert {int(k.split(".")[2]) for k in params if k.startswith("model.layers.")} == want_layers
        assert len(model.held_layers()) == len(want_layers)
        assert ("lm_head.weight" in params or (tied and s.last)) == s.last


def test_a_stage_cache_stores_its_own_layers_and_counts_blocks_for_them():
    from tessellm.core.interfaces.cache import CacheSpec
    from tessellm.core.interfaces.kv import KVLayout
    from tessellm.plugins.cache.paged import PagedCache

    def cache(layers: tuple[int, ...]):
        spec = CacheSpec(4, 2, 16, torch.float32, torch.device("cpu"), 256, layers=layers)
        options = PagedCache.Options(block_size=16, cpu_memory_bytes=4 * 2 * 2 * 16 * 16 * 4 * 65)
        return PagedCache(options, spec, KVLayout("kv", options.block_size, torch.float32))

    whole, half = cache(()), cache((2, 3))
    assert half.layer(0) is None and half.layer(2) is not None
    assert half.layer_groups == [(2, 3)]
    assert half.num_blocks == 2 * whole.num_blocks + 1  # one scratch block less per layer's worth
    assert half.bytes_for_sequence(16) * 2 == whole.bytes_for_sequence(16)


def test_micro_batches_give_one_batchs_logits_and_logprobs(tiny_model, cpu_config):
    """One process as a lone stage, each step cut into three micro-batches: the same tokens,
    logprobs and prompt logprobs as the whole batch (the rows put back in order)."""
    from tessellm import LLM

    config = cpu_config(tiny_model("llama"), dtype="float64", cache={"name": "paged", "options": {"num_blocks": 64}},
                        scheduler={"name": "continuous"})
    params = {"max_tokens": 6, "ignore_eos": True, "temperature": 0.0, "logprobs": 3, "prompt_logprobs": 2}
    prompts = ["hello there world", "a b c d e f g", "x", "one two three four"]
    want = LLM(config).generate(prompts, params)
    llm = LLM(config)
    runner = llm.pipeline.runner
    runner.stage = stage(0, 1, (0, llm.pipeline.spec.num_layers))
    runner.stage.logits_dtype = torch.float64
    runner.microbatches = 3
    calls = []
    forward = runner._forward_stage
    runner._forward_stage = lambda batch, parts, layers: calls.append(len(parts)) or forward(batch, parts, layers)
    got = llm.generate(prompts, params)
    assert max(calls) == 3
    def flat(entries):  # (logprob, top ids, top logprobs) per position
        return [None if e is None else (e.logprob, [t for t, _ in e.top], [v for _, v in e.top]) for e in entries]

    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        for mine, theirs in ((flat(a.outputs[0].logprobs), flat(b.outputs[0].logprobs)),
                             (flat(a.prompt_logprobs), flat(b.prompt_logprobs))):
            assert len(mine) == len(theirs)
            for x, y in zip(mine, theirs):
                assert (x is None) == (y is None)
                if x is not None:
                    assert x[1] == y[1] and x[0] == pytest.approx(y[0], abs=1e-9)
                    assert x[2] == pytest.approx(y[2], abs=1e-9)


# ---------------------------------------------------------------- torchrun launches


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> Path:
    """A 4-layer GQA Llama (6 query heads in 3 KV groups), float64."""
    root = tmp_path_factory.mktemp("pp-llama")
    model = build_tiny_llama(root / "model", hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                             intermediate_size=96, num_hidden_layers=4)
    return write_config(root / "pipeline.json", model)


ARCHITECTURES = [t for t in sorted(TINY_SHAPES) if t != "qwen2"]  # qwen2 is the llama plugin's, as mistral is


@pytest.fixture(scope="module")
def every_architecture(tmp_path_factory) -> tuple[Path, list[dict], dict, list]:
    """Every built-in model plugin's families' tiny checkpoints, their configs, the sampling
    and one rank's greedy tokens for each."""
    from tessellm import LLM

    root = tmp_path_factory.mktemp("pp-arch")
    configs = [json.loads(write_config(root / f"{t}.json", build_tiny(t, root / t, vocab_size=512)).read_text())
               for t in ARCHITECTURES]
    params = {"prompts": PROMPTS, "sampling": {"max_tokens": 12, "ignore_eos": True, "temperature": 0.0}}
    expected = [[o.token_ids for o in LLM(c).generate(PROMPTS, params["sampling"])] for c in configs]
    return root, configs, params, expected


@pytest.mark.parametrize("ranks, parallel", [
    (2, {"pipeline": 2, "microbatch_min_tokens": 1}),
    pytest.param(4, {"pipeline": 2, "tensor": 2, "microbatch_min_tokens": 1}, marks=pytest.mark.extended)],
    ids=["P2", "P2xT2"])
def test_every_architecture_splits_into_stages_as_one_rank(every_architecture, ranks, parallel):
    """Llama, Mistral (a window), Qwen3 and its MoE, Qwen2-MoE, Mixtral, DeepSeek V2 and V3
    (MLA latents, MoE), Gemma 2 and 3 (per-layer windows, softcaps), GPT-OSS (sinks), Phi-3,
    OLMo 2, Granite and SmolLM3: each stage runs its layers, two stages (of two tensor ranks
    each) give one rank's greedy tokens, in one launch per layout; steps are cut into
    micro-batches down to one token each (the tiny prompts are a few tokens long)."""
    root, configs, params, expected = every_architecture
    configs = [{**c, "parallel": {**c["parallel"], **parallel}} for c in configs]
    run = run_several_pipelines(ranks, configs, params, root)
    assert run.returncode == 0, run.stderr[-3000:]
    got = [json.loads(line) for line in run.stdout.strip().splitlines()]
    assert len(got) == len(ARCHITECTURES)  # rank 0 alone prints
    for model_type, tokens, want in zip(ARCHITECTURES, got, expected):
        assert tokens == want, model_type


def test_two_stages_of_two_ranks_and_four_stages_as_one_rank(llama4, tmp_path):
    """P = 2 x T = 2, and P = 4 (two middle stages, which both receive and send), in one
    launch of four ranks; steps cut into micro-batches down to one token."""
    from tessellm import LLM

    base = json.loads(llama4.read_text())
    layouts = [{"pipeline": 2, "tensor": 2}, {"pipeline": 4}]
    configs = [{**base, "parallel": {**base["parallel"], **p, "microbatch_min_tokens": 1}} for p in layouts]
    params = {"prompts": PROMPTS, "sampling": {"max_tokens": 12, "ignore_eos": True, "temperature": 0.0}}
    expected = [o.token_ids for o in LLM(base).generate(PROMPTS, params["sampling"])]
    run = run_several_pipelines(4, configs, params, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [json.loads(line) for line in run.stdout.strip().splitlines()] == [expected, expected]


@pytest.mark.extended
def test_uneven_stages_in_one_micro_batch_as_one_rank(llama4, capsys):
    expected = one_rank(llama4, capsys)
    run = torchrun(2, *generate_args(llama4, "--set", "parallel.pipeline=2", "--set", "parallel.stage_layers=[1,3]",
                                     "--set", "parallel.microbatches=1"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert token_ids(run.stdout) == expected


def test_stages_run_beams_penalties_and_drafts_as_one_rank(llama4, tmp_path):
    """Every rank decodes the last stage's logits: beams regroup, penalties keep their
    state, n-gram drafts and layer-skip drafts (a subset of each stage's layers) are verified
    alike on every stage."""
    from tessellm import LLM

    base = json.loads(llama4.read_text())
    variants = [{"decoding": {"name": "beam", "options": {"num_beams": 3}}},
                {"decoding": {"name": "speculative", "options": {"proposer": "ngram", "k": 3}}},
                {"decoding": {"name": "speculative", "options": {"proposer": "layer-skip", "k": 2,
                                                                 "draft_layers": [0, 2]}}},
                {}]
    configs = [{**base, **v} for v in variants]
    greedy = {"max_tokens": 12, "ignore_eos": True, "temperature": 0.0}
    penalties = {**greedy, "presence_penalty": 1.2, "repetition_penalty": 1.5}
    sampling = [greedy, penalties, penalties, penalties]  # beams take no penalties
    params = {"prompts": PROMPTS + ["t7 t8 t7 t8 t7 t8 t7"], "sampling": sampling}
    expected = [[o.token_ids for o in LLM(c).generate(params["prompts"], s)] for c, s in zip(configs, sampling)]
    staged = [{**c, "parallel": {**c["parallel"], "pipeline": 2, "microbatch_min_tokens": 1}} for c in configs]
    run = run_several_pipelines(2, staged, params, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [json.loads(line) for line in run.stdout.strip().splitlines()] == expected


@pytest.mark.extended
def test_more_stages_than_layers_names_the_allowed_ones(llama4):
    run = torchrun(5, *generate_args(llama4, "--set", "parallel.pipeline=5"), timeout=120)
    assert run.returncode != 0
    assert "parallel.pipeline 5 is more stages than this model's 4 decoder layers; allowed: 1 to 4" in run.stderr


@pytest.mark.parametrize("world, tensor, pipeline, message", [
    (2, 2, 2, "parallel.pipeline x parallel.tensor is 2 x 2 = 4, but torchrun launched 2 process(es); allowed: "
              "pipeline x tensor = 2 for this launch, or torchrun --nproc-per-node 4"),
    (4, 3, 1, "parallel.tensor is 3, but torchrun launched 4 process(es); allowed: parallel.tensor=4 for this "
              "launch, or torchrun --nproc-per-node 3"),
    (4, 2, 2, None),
])
def test_a_launch_of_another_size_names_both(monkeypatch, world, tensor, pipeline, message):
    from tessellm.core.parallel.group import launch_problem

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert launch_problem(tensor, pipeline) == message


def test_pipeline_above_one_outside_torchrun_names_the_launch(monkeypatch, llama4):
    from tessellm import LLM

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match=r"parallel.pipeline x parallel.tensor is 2 x 1 = 2, but this process was "
                                          r"not launched by torchrun; run torchrun --nproc-per-node 2"):
        LLM(json.loads(llama4.read_text()) | {"parallel": {"pipeline": 2}})
