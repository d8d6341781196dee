"""Tensor parallelism on the CPU (gloo): the shard arithmetic, and real torchrun launches of
two (and three) ranks whose greedy outputs equal one rank's for generate, bench and serve
(these two under pipeline parallelism too),
on the default model, a GQA Llama with an uneven head split, a DeepSeek-V2 (MLA + MoE) and
Qwen3, Qwen3-MoE, Qwen2-MoE and Mixtral (one launch for the four); the MoE shard rules on
mapped checkpoint names and on experts stacked as 3-D tensors; bad sizes and a rank that
raises or dies end every rank with a clear error, quickly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

from tessellm.cli import main
from tessellm.core.errors import ConfigError
from tessellm.core.model.spec import ModelSpec
from tessellm.core.parallel.shard import ZERO, allowed_sizes, load_shard, local_spec, plan_shard, slice_rule
from tessellm.testing.launch import (PROMPTS, generate_args, one_rank, run_several_pipelines, token_ids,
                                     torchrun, write_config)
from tessellm.testing.models import TINY_SHAPES, build_tiny, build_tiny_deepseek, build_tiny_llama

FAULT_SCRIPT = Path(__file__).with_name("fault_rank.py")


def spec_of(heads: int, kv: int, intermediate: int = 96) -> ModelSpec:
    return ModelSpec(model_type="llama", vocab_size=64, hidden_size=heads * 8, intermediate_size=intermediate,
                     num_layers=1, num_heads=heads, num_kv_heads=kv, head_dim=8, rms_norm_eps=1e-5,
                     max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False, o_bias=True,
                     mlp_bias=False, sliding_window=None, rope_type="default", hf_config=None)


# ---------------------------------------------------------------- the shard arithmetic


def test_allowed_sizes_of_smollm2_and_the_error_naming_them():
    spec = spec_of(9, 3, 1536)  # SmolLM2-135M: 9 heads in 3 KV groups
    assert allowed_sizes(spec) == [1, 2, 3, 6, 9]
    with pytest.raises(ConfigError, match=r"parallel.tensor 4 does not split .* allowed: 1, 2, 3, 6, 9"):
        plan_shard(spec, 4, 0)


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 12), st.data())
def test_every_head_and_column_lands_on_exactly_one_rank(kv, group, width, data):
    spec = spec_of(kv * group, kv, width)
    size = data.draw(st.sampled_from(allowed_sizes(spec)))
    shards = [plan_shard(spec, size, r) for r in range(size)]
    heads = [h for s in shards for h in range(*s.heads)]
    assert heads == list(range(spec.num_heads))
    assert [c for s in shards for c in range(*s.intermediate)] == list(range(width))
    for s in shards:  # a rank's query heads read only the KV heads it holds
        assert s.heads[1] > s.heads[0] and all(s.kv_heads[0] <= h // group < s.kv_heads[1] for h in range(*s.heads))
        local = local_spec(spec, s)
        assert local.num_heads == s.heads[1] - s.heads[0] and local.hidden_size == spec.hidden_size


def test_slice_rules_column_then_row():
    spec = spec_of(6, 3)
    shard = plan_shard(spec, 2, 1)  # KV heads 1-2, query heads 2-5
    assert shard.kv_heads == (1, 3) and shard.heads == (2, 6)
    assert slice_rule("model.layers.0.self_attn.q_proj.weight", spec, shard) == (0, 16, 48)
    assert slice_rule("model.layers.0.self_attn.k_proj.weight", spec, shard) == (0, 8, 24)
    assert slice_rule("model.layers.0.self_attn.o_proj.weight", spec, shard) == (1, 16, 48)
    assert slice_rule("model.layers.0.self_attn.o_proj.bias", spec, shard) == ZERO
    assert slice_rule("model.layers.0.mlp.down_proj.weight", spec, shard) == (1, 48, 96)
    assert slice_rule("model.layers.0.input_layernorm.weight", spec, shard) is None
    assert slice_rule("model.embed_tokens.weight", spec, shard) is None


def shard_of(model_type: str, size: int, rank: int):
    """A tiny ``model_type`` config's whole spec, rank ``rank``'s shard of ``size``, and the
    slice rule of a checkpoint tensor name (mapped through the model plugin, as load_shard does)."""
    from transformers import AutoConfig

    from tessellm.core.registry import get_registry

    config = AutoConfig.for_model(model_type, vocab_size=64, **TINY_SHAPES[model_type])
    arch = get_registry().architecture_for(config)
    spec = arch.load_spec(config)
    shard = plan_shard(spec, size, rank)
    return spec, shard, lambda name: slice_rule(arch.checkpoint_name(name), spec, shard)


def test_qwen2_moe_shard_splits_the_shared_expert_and_replicates_its_gate():
    spec, shard, rule = shard_of("qwen2_moe", 2, 1)  # experts 24 wide, the shared expert 48, MHA 4 heads
    assert (shard.moe_intermediate, shard.shared_intermediate) == ((12, 24), (24, 48))
    local = local_spec(spec, shard)
    assert (local.moe.intermediate_size, local.moe.shared_intermediate_size, local.moe.num_experts) == (12, 24, 6)
    assert local.moe.shared_gate and local.intermediate_size == 48
    assert rule("model.layers.1.mlp.shared_expert.gate_proj.weight") == (0, 24, 48)
    assert rule("model.layers.1.mlp.shared_expert.up_proj.weight") == (0, 24, 48)
    assert rule("model.layers.1.mlp.shared_expert.down_proj.weight") == (1, 24, 48)
    assert rule("model.layers.1.mlp.experts.5.up_proj.weight") == (0, 12, 24)
    assert rule("model.layers.1.mlp.experts.5.down_proj.weight") == (1, 12, 24)
    assert rule("model.layers.0.mlp.down_proj.weight") == (1, 48, 96)  # a dense layer
    assert rule("model.layers.1.mlp.shared_expert_gate.weight") is None  # replicated, as the router is
    assert rule("model.layers.1.mlp.gate.weight") is None
    assert rule("model.layers.1.mlp.experts.gate_up_proj") is None  # stacked: read whole, sliced once split
    assert rule("model.layers.1.self_attn.q_proj.bias") == (0, 32, 64)
    assert [shard_of("qwen2_moe", 3, r)[1].shared_intermediate for r in range(3)] == [(0, 16), (16, 32), (32, 48)]


def test_mixtral_shard_reads_its_checkpoint_names():
    spec, shard, rule = shard_of("mixtral", 2, 0)  # experts 48 wide, head_dim 32, GQA 4:2
    assert shard.shared_intermediate == (0, 0) and local_spec(spec, shard).moe.shared_intermediate_size == 0
    assert rule("model.layers.0.block_sparse_moe.experts.7.w1.weight") == (0, 0, 24)  # gate_proj
    assert rule("model.layers.0.block_sparse_moe.experts.7.w3.weight") == (0, 0, 24)  # up_proj
    assert rule("model.layers.0.block_sparse_moe.experts.7.w2.weight") == (1, 0, 24)  # down_proj
    assert rule("model.layers.0.block_sparse_moe.gate.weight") is None  # the router
    assert rule("model.layers.0.self_attn.k_proj.weight") == (0, 0, 32)


def test_qwen3_shard_replicates_the_head_norms():
    _, shard, rule = shard_of("qwen3", 2, 1)  # 4 query heads on 1 KV head: both ranks hold it
    assert (shard.heads, shard.kv_heads, shard.moe_intermediate) == ((2, 4), (0, 1), None)
    assert rule("model.layers.0.self_attn.q_norm.weight") is None
    assert rule("model.layers.0.self_attn.k_norm.weight") is None
    assert rule("model.layers.0.self_attn.q_proj.weight") == (0, 48, 96)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "mixtral"])
def test_stacked_experts_load_the_same_shards_as_per_expert_ones(tmp_path, model_type):
    """transformers 5 holds experts stacked (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]); its save_pretrained writes them per expert. A folder of
    the module's own state_dict gives every rank the tensors the per-expert folder does."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from tessellm.core.model.loader import checkpoint_state, load_hf_config
    from tessellm.core.registry import get_registry

    per_expert = build_tiny(model_type, tmp_path / "per-expert", vocab_size=64)
    state = AutoModelForCausalLM.from_pretrained(per_expert).state_dict()
    assert any(k.endswith("experts.gate_up_proj") and v.dim() == 3 for k, v in state.items())
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, stacked / "model.safetensors")
    config = load_hf_config(per_expert)
    arch = get_registry().architecture_for(config)
    spec = arch.load_spec(config)
    for rank in range(2):
        shard = plan_shard(spec, 2, rank)
        want = checkpoint_state(arch, load_shard(per_expert, spec, shard, arch))
        got = checkpoint_state(arch, load_shard(stacked, spec, shard, arch))
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name
        expert = got["model.layers.1.mlp.experts.0.down_proj.weight"]
        assert expert.shape[1] == spec.moe.intermediate_size // 2 and expert.is_contiguous()
        assert expert.untyped_storage().nbytes() == expert.numel() * expert.element_size()  # no whole stack kept


def test_tensor_above_one_outside_torchrun_names_the_launch(monkeypatch, tiny_model, cpu_config):
    from tessellm import LLM

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="not launched by torchrun.*--nproc-per-node 2"):
        LLM(cpu_config(tiny_model("llama"), parallel={"tensor": 2}))


# ---------------------------------------------------------------- torchrun launches


@pytest.fixture(scope="module")
def gqa_config(tmp_path_factory) -> Path:
    """A Llama with 6 query heads in 3 KV groups (two ranks split them 1 + 2), float64."""
    root = tmp_path_factory.mktemp("tp-gqa")
    model = build_tiny_llama(root / "model", hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                             intermediate_size=96, num_hidden_layers=2)
    return write_config(root / "pipeline.json", model)


@pytest.fixture(scope="module")
def mqa_config(tmp_path_factory) -> Path:
    """A Llama with 4 query heads sharing 1 KV head: two ranks both hold it (replicated)."""
    root = tmp_path_factory.mktemp("tp-mqa")
    model = build_tiny_llama(root / "model", num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=2)
    return write_config(root / "pipeline.json", model)


@pytest.mark.parametrize("layout", ["gqa_config", pytest.param("mqa_config", marks=pytest.mark.extended)])
def test_two_ranks_generate_one_ranks_tokens(layout, request, capsys):
    config = request.getfixturevalue(layout)
    expected = one_rank(config, capsys)
    run = torchrun(2, *generate_args(config, "--set", "parallel.tensor=2"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert token_ids(run.stdout) == expected
    assert run.stdout.count("\n") == len(PROMPTS)  # rank 0 alone prints


@pytest.mark.extended  # beams across ranks: test_pipeline_parallel's launch, on every stage
def test_two_ranks_beam_search_as_one_rank(gqa_config, capsys):
    """Beams regroup identically on every rank (each decides from the same gathered logits)."""
    beams = ("--set", "decoding.name=beam", "--set", "decoding.options.num_beams=3")
    expected = one_rank(gqa_config, capsys, *beams)
    run = torchrun(2, *generate_args(gqa_config, "--set", "parallel.tensor=2", *beams))
    assert run.returncode == 0, run.stderr[-3000:]
    assert token_ids(run.stdout) == expected


PREQUANTIZED = {  # checkpoint builder arguments, and the quant options of the run
    "compressed-tensors-w4a16-asym": ("w4a16", {"symmetric": False, "group_size": 32}, {"cpu_kernel": "tiled"}),
    "gptq-v1": ("gptq_or_awq", {"method": "gptq", "group_size": 32}, {"cpu_kernel": "tiled"}),
    "awq-gemm": ("gptq_or_awq", {"method": "awq", "group_size": 32}, {"cpu_kernel": "tiled"}),
    "fp8-block": ("fp8", {"block": (16, 16)}, {}),
}


@pytest.mark.parametrize("fmt", [f if f == "compressed-tensors-w4a16-asym" else pytest.param(f, marks=pytest.mark.extended)
                                 for f in sorted(PREQUANTIZED)])
def test_two_ranks_read_their_share_of_a_prequantized_checkpoint(fmt, tmp_path, capsys):
    """Each rank reads only its slices of the packed tensors, scales and zero points (columns
    of q/k/v and gate/up, rows of o and down): one rank's tokens."""
    from tessellm.testing import prequantized

    base = build_tiny_llama(tmp_path / "base", num_hidden_layers=2)
    kind, build_args, options = PREQUANTIZED[fmt]
    if kind == "w4a16":
        folder = prequantized.build_compressed_tensors_w4a16(base, tmp_path / "q", **build_args)
    elif kind == "fp8":
        folder = prequantized.build_fine_grained_fp8(base, tmp_path / "q", tmp_path / "ref", **build_args)
    else:
        folder = prequantized.build_gptq_or_awq(base, tmp_path / "q", tmp_path / "ref", **build_args)
    config = write_config(tmp_path / "pipeline.json", folder, quant={"options": options})
    expected = one_rank(config, capsys)
    run = torchrun(2, *generate_args(config, "--set", "parallel.tensor=2"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert token_ids(run.stdout) == expected


def test_act_order_cannot_split_a_row_parallel_layer(tmp_path):
    from tessellm.core.errors import ModelLoadError
    from tessellm.plugins.quant.int4.checkpoints import shard_rule

    quant = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}
    assert shard_rule("g_idx", (0, 0, 32), quant) is None  # a share of the outputs reads all of g_idx
    assert shard_rule("qweight", (1, 32, 64), quant) == (0, 4, 8)
    with pytest.raises(ModelLoadError, match="act-order"):
        shard_rule("g_idx", (1, 32, 64), quant)
    with pytest.raises(ModelLoadError, match="split an entry of 32 channels"):
        shard_rule("scales", (1, 16, 48), {**quant, "desc_act": False})


@pytest.mark.extended
def test_two_ranks_apply_logits_processors_as_one_rank(gqa_config, capsys):
    """Penalties and bans keep per-sequence state on every rank; rank 0's tokens feed them
    all, so two ranks give one rank's tokens (which the processors changed)."""
    sampling = ["--sampling", json.dumps({"presence_penalty": 1.2, "frequency_penalty": 0.4, "repetition_penalty": 1.5,
                                           "no_repeat_ngram_size": 2, "bad_words_ids": [[5, 6]], "min_tokens": 4})]
    plain = one_rank(gqa_config, capsys)
    expected = one_rank(gqa_config, capsys, *sampling)
    assert expected != plain
    run = torchrun(2, *generate_args(gqa_config, "--set", "parallel.tensor=2", *sampling))
    assert run.returncode == 0, run.stderr[-3000:]
    assert token_ids(run.stdout) == expected


@pytest.mark.extended
def test_default_model_two_ranks_generate_one_ranks_tokens(smollm2_dir, capsys):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    args = ["generate", "--set", "device=cpu", "--set", f"model={smollm2_dir}", "--max-tokens", "16",
            "--ignore-eos", "--json", *prompts]
    assert main(args) == 0
    expected = token_ids(capsys.readouterr().out)
    run = torchrun(2, *args[:1], "--set", "parallel.tensor=2", *args[1:])
    assert run.returncode == 0, run.stderr[-3000:]
    assert token_ids(run.stdout) == expected


@pytest.mark.extended
def test_deepseek_mla_and_moe_shard(tmp_path, capsys):
    model = build_tiny_deepseek(tmp_path / "model", 2)
    config = write_config(tmp_path / "pipeline.json", model, attention={"name": "mla"})
    expected = one_rank(config, capsys)
    run = torchrun(2, *generate_args(config, "--set", "parallel.tensor=2"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert token_ids(run.stdout) == expected


NEW_ARCHITECTURES = ["qwen3", "qwen3_moe", "qwen2_moe", "mixtral"]
LAYER_FEATURE_FAMILIES = ["gemma2", "gemma3_text", "gpt_oss", "phi3", "granite", "smollm3", "olmo2", "olmo2-mqa"]


@pytest.mark.extended
def test_model_plugins_shard(tmp_path):
    """Every model plugin's family in float64, two ranks giving one rank's greedy tokens,
    in one launch (the pipelines in turn): Qwen3 (per-head q/k norms on a replicated KV
    head), Qwen3-MoE, Qwen2-MoE (the shared expert split, its gate replicated), Mixtral (its
    checkpoint's names mapped); Gemma 2 and 3 (per-layer windows, softcaps, sandwich norms
    reduced before their output norms), GPT-OSS (sinks split with their heads, interleaved
    expert stacks), Phi-3 (fused qkv and gate_up projections, each part split), Granite
    (multipliers), SmolLM3 (layers without RoPE) and OLMo 2 (q/k norms over whole projections,
    their sums of squares reduced over the ranks; with one KV head on both ranks too)."""
    from tessellm import LLM

    model_types = NEW_ARCHITECTURES + LAYER_FEATURE_FAMILIES
    configs = []
    for model_type in model_types:
        family, _, variant = model_type.partition("-")
        extra = {"num_key_value_heads": 1} if variant == "mqa" else {}
        model = build_tiny(family, tmp_path / model_type, vocab_size=512, **extra)
        configs.append(json.loads(write_config(tmp_path / f"{model_type}.json", model).read_text()))
    params = {"prompts": PROMPTS, "sampling": {"max_tokens": 12, "ignore_eos": True, "temperature": 0.0}}
    expected = [[o.token_ids for o in LLM(c).generate(PROMPTS, params["sampling"])] for c in configs]
    two = [{**c, "parallel": {**c["parallel"], "tensor": 2}} for c in configs]
    run = run_several_pipelines(2, two, params, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    got = [json.loads(line) for line in run.stdout.strip().splitlines()]
    assert len(got) == len(model_types)  # rank 0 alone prints
    for model_type, tokens, want in zip(model_types, got, expected):
        assert tokens == want, model_type


@pytest.mark.extended
@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_bench_under_torchrun(gqa_config, split):
    run = torchrun(2, "bench", "--config", str(gqa_config), "--set", f"parallel.{split}=2", "--num-requests", "4",
                   "--workload-set", "prompt_median=12", "--workload-set", "prompt_max=40",
                   "--workload-set", "output_median=6", "--workload-set", "output_max=10", "--json",
                   "--no-progress")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["pipeline"]["parallel"][split] == 2 and report["total_output_tokens"] > 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.extended
@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_serve_under_torchrun_answers_like_one_rank(gqa_config, capsys, split):
    from openai import OpenAI

    expected = one_rank(gqa_config, capsys)
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "tessellm",
           "serve", "--config", str(gqa_config), "--set", f"parallel.{split}=2", "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        deadline = time.time() + 120
        while True:
            try:
                client.models.list()
                break
            except Exception:
                assert server.poll() is None and time.time() < deadline, server.stderr.read()[-3000:]
                time.sleep(0.5)
        for prompt, ids in zip(PROMPTS, expected):
            out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=12,
                                            temperature=0.0, extra_body={"ignore_eos": True})
            assert out.choices[0].text == " ".join(f"t{i}" for i in ids)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.communicate(timeout=60)


def test_a_launch_that_does_not_match_parallel_tensor_names_both(gqa_config):
    run = torchrun(2, *generate_args(gqa_config, "--set", "parallel.tensor=3"), timeout=120)
    assert run.returncode != 0
    assert "parallel.tensor is 3, but torchrun launched 2 process(es)" in run.stderr


@pytest.mark.parametrize("split, rank, mode", [
    ("tensor", 1, "raise"), pytest.param("tensor", 0, "raise", marks=pytest.mark.extended),
    pytest.param("tensor", 1, "exit", marks=pytest.mark.extended), ("pipeline", 1, "raise"),
    pytest.param("pipeline", 0, "exit", marks=pytest.mark.extended)])
def test_a_failing_rank_ends_every_rank_with_a_clear_error(gqa_config, split, rank, mode):
    start = time.time()
    run = torchrun(2, *generate_args(gqa_config, "--set", f"parallel.{split}=2"), script=[str(FAULT_SCRIPT)],
                   env={"TESSELLM_TEST_FAIL_RANK": str(rank), "TESSELLM_TEST_FAIL_AT": "4",
                        "TESSELLM_TEST_FAIL_MODE": mode}, timeout=150)
    assert run.returncode != 0 and time.time() - start < 100  # the group's timeout is 30 s
    if mode == "raise":
        assert f"injected fault on rank {rank}" in run.stderr
    if rank != 0:
        assert "lost its peers" in run.stderr  # rank 0 says what happened


@pytest.mark.parametrize("quant", [pytest.param("int8-weight", marks=pytest.mark.extended),
                                   pytest.param("w8a8", marks=pytest.mark.extended)])
def test_int8_models_shard(gqa_config, capsys, quant):
    """Each rank quantizes its own shard. int8-weight's per-output-channel scales of a
    row-parallel layer then span the rank's columns only, which on this model gives the same
    tokens; w8a8 also scales each rank's share of an activation by its own per-token maximum,
    a different (equally valid) quantization, so its tokens are only checked to be complete."""
    args = ("--set", "dtype=float32", "--set", f"quant.name={quant}")
    expected = one_rank(gqa_config, capsys, *args)
    run = torchrun(2, *generate_args(gqa_config, *args, "--set", "parallel.tensor=2"))
    assert run.returncode == 0, run.stderr[-3000:]
    got = token_ids(run.stdout)
    if quant == "int8-weight":
        assert got == expected
    else:
        assert [len(t) for t in got] == [12] * len(PROMPTS)


@pytest.mark.extended
@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_eval_perplexity_under_torchrun(gqa_config, capsys, split):
    """Scoring (``Engine.score``) goes through the lockstep too: the same perplexity."""
    args = ["eval", "ppl", "--config", str(gqa_config), "--max-tokens", "200"]
    assert main(args) == 0
    expected = capsys.readouterr().out.split(",")[0]
    run = torchrun(2, *args, "--set", f"parallel.{split}=2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split(",")[0] == expected and expected.startswith("perplexity ")


@pytest.mark.extended
@pytest.mark.parametrize("split", ["tensor", "pipeline"])
def test_two_ranks_serve_lora_adapters_as_one_rank(gqa_config, tmp_path, capsys, split):
    """Adapters on every projection are sharded with their layers (B rows of column-parallel
    layers, A columns of row-parallel ones), or read by the stage that holds the layer: two
    ranks give one rank's tokens under each."""
    from tessellm.testing.lora import build_tiny_lora

    config = json.loads(gqa_config.read_text())
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapters = {name: str(build_tiny_lora(Path(config["model"]), tmp_path / name, rank=rank, seed=seed,
                                          target_modules=targets))
                for name, rank, seed in (("a", 8, 1), ("b", 3, 2))}
    path = tmp_path / "lora.json"
    path.write_text(json.dumps({**config, "lora": {"adapters": adapters}}))
    plain = one_rank(path, capsys)
    for name in adapters:
        expected = one_rank(path, capsys, "--lora", name)
        assert expected != plain
        run = torchrun(2, *generate_args(path, "--set", f"parallel.{split}=2", "--lora", name))
        assert run.returncode == 0, run.stderr[-3000:]
        assert token_ids(run.stdout) == expected, name
