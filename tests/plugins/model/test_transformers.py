"""The `transformers` model plugin: transformers' own model code with tessellm's attention.

Selection (native plugins first, the fallback under auto with one log line, a native refusal
falling back too); one-line refusals naming why for models it cannot serve exactly; the model
conformance suite against transformers (every engine path: arrivals, prefix hits, chunked
prefill, preemption, n-gram drafts); the engine's other features giving the same tokens as the
native llama plugin on one checkpoint (beams, structured outputs, logits processors,
layer-skip drafts, async scheduling, LoRA, int8 and int4 weights); tensor parallelism along
the model's plan, and its refusal without one; and the committed table of families
(docs/model_families.md) for a representative few of them (all of them: extended). The default
set keeps the selection, the refusals, one family through the conformance suite (OLMo), beam
search against the native plugin, one family of the table (Cohere 2) and the tensor-parallel
plan; the rest is extended."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from tessellm import LLM
from tessellm.core.errors import ConfigError, ModelLoadError
from tessellm.core.registry import get_registry
from tessellm.plugins.model.transformers import TransformersArchitecture
from tessellm.testing.conformance import ModelConformance
from tessellm.testing.models import build_tiny

ROOT = Path(__file__).resolve().parents[3]
TABLE = ROOT / "docs" / "model_families.md"


def tiny_config(model_type: str, **fields):
    from tessellm.testing.transformers_families import tiny_config as shrunk

    config = shrunk(model_type)
    for name, value in fields.items():
        setattr(config, name, value)
    return config


# ----------------------------------------------------------------------------- selection


def test_auto_keeps_native_plugins_and_takes_undeclared_types(caplog):
    registry = get_registry()
    with caplog.at_level(logging.INFO, logger="tessellm.core.registry"):
        native, _ = registry.model_for(tiny_config("llama"))
        assert native.name == "llama" and not caplog.records
        fallback, spec = registry.model_for(tiny_config("olmo"))
    assert fallback.name == "transformers" and spec.architecture == "transformers"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "'olmo'" in lines[0] and "model plugin 'transformers'" in lines[0]


def test_a_variant_the_native_plugin_refuses_falls_back(caplog):
    """Llama with a Mish MLP: the llama plugin's MLP computes SiLU, GELU or ReLU only."""
    with caplog.at_level(logging.INFO, logger="tessellm.core.registry"):
        plugin, _ = get_registry().model_for(tiny_config("llama", hidden_act="mish"))
    assert plugin.name == "transformers"
    assert any("hidden_act 'mish'" in r.getMessage() and "'transformers' instead" in r.getMessage()
               for r in caplog.records)


def test_named_it_takes_any_type_and_named_natives_keep_theirs():
    registry = get_registry()
    assert registry.architecture_for(tiny_config("llama"), "transformers").name == "transformers"
    with pytest.raises(ConfigError, match="model plugin 'llama' builds model types llama, mistral, qwen2, not "
                                          "this checkpoint's 'olmo'"):
        registry.architecture_for(tiny_config("olmo"), "llama")


@pytest.mark.parametrize("model_type, fields, words", [
    ("mamba", {}, ["'mamba'", "Mamba"]),
    ("jamba", {}, ["'jamba'", "Mamba"]),
    ("bart", {}, ["encoder-decoder"]),
    ("bloom", {}, ["BloomForCausalLM", "_supports_attention_backend is False"]),
    ("diffllama", {}, ["call attention more than once"]),
    ("llama4_text", {"attention_chunk_size": 8}, ["create_chunked_causal_mask"]),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     ["rope_type 'dynamic'", "sequence length"]),
    ("bert", {}, ["create_bidirectional_mask"]),
    ("olmo", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, ["pre-quantized", "'gptq'"]),
])
def test_what_it_cannot_serve_exactly_is_a_one_line_refusal(model_type, fields, words):
    with pytest.raises(ModelLoadError) as refused:
        TransformersArchitecture().load_spec(tiny_config(model_type, **fields))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"model plugin 'transformers' cannot serve model_type "
                                                      f"'{model_type}': ")
    for word in words:
        assert word in message


def test_refused_by_both_the_error_gives_both_reasons():
    config = tiny_config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ModelLoadError, match="model plugin 'llama': rope_type 'dynamic'.*; model plugin "
                                             "'transformers': .*rope_type 'dynamic'"):
        get_registry().model_for(config)


def test_the_spec_reads_every_layers_attention():
    """Gemma 2: sliding and global layers, softcaps, a scale of 1/sqrt(24); GPT-OSS: sinks."""
    spec = TransformersArchitecture().load_spec(tiny_config("gemma2"))
    windows = [spec.attention_of(i).sliding_window for i in range(spec.num_layers)]
    assert windows == [8, None, 8, 8] and spec.attention_scale == pytest.approx(24 ** -0.5)
    assert {spec.attention_of(i).softcap for i in range(4)} == {2.0}
    assert spec.attention_features() == {"per_layer_window": [0, 2, 3], "softcap": [0, 1, 2, 3]}
    oss = TransformersArchitecture().load_spec(tiny_config("gpt_oss"))
    assert oss.attention_features()["sinks"] == [0, 1, 2, 3]


def test_a_model_that_drops_the_step_is_named():
    from tessellm.plugins.model.transformers.attention import tessellm_attention

    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="Linear called attention implementation 'tessellm' without "
                                           "'tessellm_step'"):
        tessellm_attention(torch.nn.Linear(1, 1), q, q, q)


def test_a_failure_while_building_or_probing_is_a_one_line_load_error():
    from tessellm.plugins.model.transformers.module import failures_as_load_error

    with pytest.raises(ModelLoadError, match=r"^cannot build \(KeyError: 'rope'\), so no model$") as failed:
        with failures_as_load_error("cannot build ({}), so no model"):
            raise KeyError("rope")
    assert isinstance(failed.value.__cause__, KeyError)
    with pytest.raises(ModelLoadError, match="^no layer_idx$"):  # tessellm's own refusal passes unwrapped
        with failures_as_load_error("cannot build ({})"):
            raise ModelLoadError("no layer_idx")
    with pytest.raises(ModelLoadError, match=r"\(ValueError: first line\)$"):
        with failures_as_load_error("cannot build ({})"):
            raise ValueError("first line\nsecond line")


# ----------------------------------------------------------------------------- against transformers


class TestConformance(ModelConformance):
    """A family no native plugin declares (OLMo: q/k/v clipping, non-parametric norms); the
    families whose layers differ are in the extended set."""

    plugin = "transformers"
    model_types = ("olmo",)
    shapes = {"olmo": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=512, clip_qkv=0.5,
                           tie_word_embeddings=False)}


@pytest.mark.extended
class TestConformanceExtended(TestConformance):
    """Sinks with windows and MoE experts stored per expert (GPT-OSS), softcaps and two rotary
    tables (Gemma 2 and 3), MLA with value heads narrower than the keys (DeepSeek-V3, padded in
    the cache), fused q/k/v (Phi-3), experts (Mixtral, Qwen3-MoE), Llama itself."""

    model_types = ("gpt_oss", "llama", "gemma2", "gemma3_text", "deepseek_v3", "phi3", "mixtral", "qwen3_moe", "granite")


# ----------------------------------------------------------------------------- the engine's features


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny Llama with a word-level tokenizer over 512 ids."""
    return build_tiny("llama", tmp_path_factory.mktemp("llama") / "model")


@pytest.fixture(scope="module")
def chat_llama_folder(tiny_model):
    """A tiny Llama with SmolLM2's tokenizer (real words, for structured outputs)."""
    return tiny_model("llama")


def pipeline(folder: Path, architecture: str, **sections) -> LLM:
    config = {"model": str(folder), "device": "cpu", "dtype": "float32", "architecture": {"name": architecture},
              "cache": {"name": "paged", "options": {"block_size": 8, "num_blocks": 256}},
              "scheduler": {"name": "continuous"}, **sections}
    return LLM(json.loads(json.dumps(config)))


@pytest.fixture(scope="module")
def both():
    """Factory: (native llama, transformers) pipelines on one folder and config (built once)."""
    built: dict[str, tuple[LLM, LLM]] = {}

    def make(folder: Path, **sections) -> tuple[LLM, LLM]:
        key = json.dumps([str(folder), sections], sort_keys=True)
        if key not in built:
            built[key] = pipeline(folder, "llama", **sections), pipeline(folder, "transformers", **sections)
        return built[key]

    return make


PROMPTS = ["t5 t6 t7 t8 t9", "t100 t3", "t9 t9 t9 t9 t41 t300 t2 t17"]
SCHEMA = {"type": "object", "properties": {"pick": {"enum": ["left", "right"]}, "n": {"enum": [1, 2, 3]}},
          "required": ["pick", "n"], "additionalProperties": False}


@pytest.mark.parametrize("sections, params", [
    pytest.param({"decoding": {"name": "beam"}}, {"max_tokens": 8, "n": 2, "extra_args": {"num_beams": 3}},
                 id="beams"),
    pytest.param({"decoding": {"name": "sample"}}, {"max_tokens": 12, "repetition_penalty": 1.3,
                                                    "presence_penalty": 0.5, "logit_bias": {11: 5.0},
                                                    "no_repeat_ngram_size": 2},
                 id="logits-processors", marks=pytest.mark.extended),
    pytest.param({"decoding": {"name": "sample"}}, {"max_tokens": 12, "temperature": 0.8, "seed": 7},
                 id="seeded-sampling", marks=pytest.mark.extended),
    pytest.param({"decoding": {"name": "speculative", "options": {"proposer": "layer-skip", "k": 3,
                                                                  "draft_layers": [0]}}},
                 {"max_tokens": 12}, id="layer-skip-drafts", marks=pytest.mark.extended),
    pytest.param({"async_scheduling": True}, {"max_tokens": 12}, id="async-scheduling", marks=pytest.mark.extended),
])
def test_engine_features_give_the_native_plugins_tokens(llama_folder, both, sections, params):
    native, theirs = both(llama_folder, **sections)
    params = {"ignore_eos": True, "temperature": 0.0, **params}
    ours = [[o.token_ids for o in r.outputs] for r in theirs.generate(PROMPTS, params)]
    assert ours == [[o.token_ids for o in r.outputs] for r in native.generate(PROMPTS, params)]


@pytest.mark.extended
def test_structured_outputs_give_the_native_plugins_tokens(chat_llama_folder, both):
    native, theirs = both(chat_llama_folder)
    params = {"max_tokens": 24, "temperature": 0.0, "structured_output": {"kind": "json_schema",
                                                                          "source": json.dumps(SCHEMA)}}
    prompts = ["The answer is", "Pick one:"]
    ours = theirs.generate(prompts, params)
    assert [r.token_ids for r in ours] == [r.token_ids for r in native.generate(prompts, params)]
    assert all(set(json.loads(r.outputs[0].text)) == {"pick", "n"} for r in ours)


@pytest.mark.extended
def test_lora_on_its_projections_gives_the_native_plugins_tokens(llama_folder, both, tmp_path):
    from tessellm.testing.lora import build_tiny_lora

    adapter = build_tiny_lora(llama_folder, tmp_path / "adapter", target_modules=("q_proj", "v_proj", "down_proj"))
    lora = {"adapters": {"tuned": str(adapter)}, "max_rank": 8}
    native, theirs = both(llama_folder, lora=lora)
    params = {"max_tokens": 10, "ignore_eos": True, "temperature": 0.0}
    for which in (None, "tuned"):
        ours = [o.token_ids for o in theirs.generate(PROMPTS, params, lora=which)]
        assert ours == [o.token_ids for o in native.generate(PROMPTS, params, lora=which)], which
    base = [o.token_ids for o in theirs.generate(PROMPTS, params)]
    assert base != [o.token_ids for o in theirs.generate(PROMPTS, params, lora="tuned")]


@pytest.mark.extended
@pytest.mark.parametrize("quant", [{"name": "int8-weight"}, {"name": "int4-weight", "options": {"group_size": 32}}])
def test_weight_quantizers_replace_its_linear_layers(llama_folder, both, quant):
    from torch import nn

    native, theirs = both(llama_folder, quant=quant)
    linears = [m for m in theirs.pipeline.model.modules() if type(m) is nn.Linear]
    assert [type(m).__name__ for m in linears] == ["Linear"]  # the tied LM head alone stays float
    params = {"max_tokens": 10, "ignore_eos": True, "temperature": 0.0}
    ours = [o.token_ids for o in theirs.generate(PROMPTS, params)]
    assert ours == [o.token_ids for o in native.generate(PROMPTS, params)]


# ----------------------------------------------------------------------------- tensor parallelism


def test_tensor_parallel_follows_the_plan_or_is_refused():
    from tessellm.core.parallel.shard import plan_shard, tensor_rule

    plugin = TransformersArchitecture()
    spec = plugin.load_spec(tiny_config("olmo"))
    shard = plan_shard(spec, 2, 1)
    assert tensor_rule("model.layers.0.self_attn.q_proj.weight", spec, shard, plugin) == (0, 32, 64)
    assert tensor_rule("model.layers.1.mlp.down_proj.weight", spec, shard, plugin) == (1, 64, 128)
    assert tensor_rule("model.embed_tokens.weight", spec, shard, plugin) is None
    gpt2 = plugin.load_spec(tiny_config("gpt2"))
    with pytest.raises(ConfigError, match="parallel.tensor: .*'gpt2' config declares none .*set parallel.tensor=1"):
        tensor_rule("transformer.h.0.attn.c_attn.weight", gpt2, plan_shard(gpt2, 2, 0), plugin)


@pytest.mark.extended
def test_two_ranks_give_one_ranks_tokens(tmp_path, capsys):
    from tessellm.testing.launch import generate_args, one_rank, token_ids, torchrun, write_config

    folder = build_tiny("olmo", tmp_path / "olmo", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config = write_config(tmp_path / "olmo.json", folder, architecture={"name": "transformers"})
    alone = one_rank(config, capsys)
    run = torchrun(2, *generate_args(config, "--set", "parallel.tensor=2"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert token_ids(run.stdout) == alone


# ----------------------------------------------------------------------------- the families' table


def table_rows() -> dict[str, str]:
    """The families table's rows by model_type (the native plugins' table above it is not read)."""
    from tessellm.testing.transformers_families import TABLE_HEADER

    lines = TABLE.read_text().splitlines()
    rows = {}
    for line in lines[lines.index(TABLE_HEADER.splitlines()[0]) + 2:]:
        match = re.match(r"\| `([^`]+)` \|", line)
        if not match:
            break
        rows[match[1]] = line
    return rows


REPRESENTATIVE = ("cohere2", pytest.param("gpt2", marks=pytest.mark.extended),
                  pytest.param("starcoder2", marks=pytest.mark.extended),
                  pytest.param("falcon_h1", marks=pytest.mark.extended),
                  pytest.param("jetmoe", marks=pytest.mark.extended), pytest.param("moshi", marks=pytest.mark.extended))
"""A family no native plugin declares, with windows on some layers (Cohere 2), in the default
set; plain GPT-2, Starcoder 2, a hybrid declined by name (Falcon-H1), MoE attention (JetMoE),
and Moshi, whose cached generate in transformers departs from its own forward (checked
against the uncached one), in the extended set."""


@pytest.mark.parametrize("model_type", REPRESENTATIVE)
def test_representative_families_are_as_the_table_says(model_type, tmp_path):
    from tessellm.testing.transformers_families import check_family

    result = check_family(model_type, tmp_path)
    assert result.state in ("served", "declined", "not built"), result
    assert result.row() == table_rows()[model_type]


@pytest.mark.extended
def test_every_family_is_as_the_table_says():
    """Every causal-LM family of the installed transformers: none gives wrong text or fails
    once served, and each family docs/model_families.md lists is as its row says (regenerate
    the table with ``python -m tessellm.testing.transformers_families --write
    docs/model_families.md``)."""
    from tessellm.testing.transformers_families import walk

    rows = table_rows()
    results = list(walk())
    assert [r for r in results if r.state in ("differs", "fails")] == []
    walked = {r.model_type: r.row() for r in results}
    assert {model_type: walked.get(model_type) for model_type in rows} == rows


def test_the_decode_graph_path_gives_the_eager_tokens(llama_folder):
    """Decode steps from static, padded buffers (core/model/cuda_graphs.py; captured on CUDA,
    run eagerly here): logits written into the graph's static output, padded rows that write
    only the scratch block, the flash backend's graph plan."""
    pytest.importorskip("triton")
    sections = {"attention": {"name": "flash"}, "decoding": {"name": "greedy"}, "cuda_graphs": False,
                "cache": {"name": "paged", "options": {"block_size": 4, "num_blocks": 96}}}
    eager = pipeline(llama_folder, "transformers", **sections)
    graphed = pipeline(llama_folder, "transformers", **sections)
    graphed.pipeline.runner.capture_graphs(max_batch=4, max_model_len=64, capture=torch.cuda.is_available())
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 6, 8, 2)]
    params = [{"max_tokens": m, "ignore_eos": True} for m in (9, 4, 7, 6, 5)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == \
        [o.token_ids for o in eager.generate(prompts, params)]
    assert graphed.pipeline.runner.graphs.replays > 0
    assert graphed.pipeline.cache.num_free_blocks == graphed.pipeline.cache.num_blocks
