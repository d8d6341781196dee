"""Pre-quantized checkpoints: a compressed-tensors pack-quantized W4A16 folder (written by
compressed-tensors' own quantize and packing code, tessellm.testing.prequantized) loads into
`int4-weight` as it is, chosen automatically, and gives the logits and greedy tokens of
transformers reading the same folder. GPTQ (v1 and v2, symmetric and not, act-order) and AWQ
GEMM folders, packed as those formats document, give the logits of the float model of the
weights they stand for (a round trip: no reader of those formats installs on a CPU-only
machine). Formats nobody reads, and a quantizer named that does not read the folder, are
refused with the reason."""

from __future__ import annotations

import json

import pytest
import torch

from tessellm import LLM
from tessellm.core.errors import ConfigError, ModelLoadError
from tessellm.plugins.quant.int4.checkpoints import checkpoint_support, compressed_tensors_support, unpack_int32_nibbles
from tessellm.plugins.quant.int4.linear import Int4WeightLinear

pytest.importorskip("compressed_tensors")

PROMPT = [1, 5, 9, 33, 7, 100, 200, 17, 4]


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory):
    """Factory: (symmetric, group_size) -> a W4A16 folder of one tiny random Llama (built once each)."""
    from tessellm.testing.models import build_tiny
    from tessellm.testing.prequantized import build_compressed_tensors_w4a16

    root = tmp_path_factory.mktemp("w4a16")
    base = build_tiny("llama", root / "base")
    built = {}

    def make(symmetric: bool, group_size: int):
        key = (symmetric, group_size)
        if key not in built:
            built[key] = build_compressed_tensors_w4a16(base, root / f"ct-{symmetric}-{group_size}",
                                                        group_size=group_size, symmetric=symmetric)
        return built[key]

    return make


def transformers_reading(folder):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=CompressedTensorsConfig(dequantize=True),
                                                dtype=torch.float32)


@pytest.mark.parametrize("symmetric,group_size", [(True, 32), (False, 32), (False, 64)])
def test_w4a16_gives_the_logits_and_tokens_transformers_reads(w4a16, symmetric, group_size):
    folder = w4a16(symmetric, group_size)
    hf = transformers_reading(folder)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].double()
    hf_tokens = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT):].tolist()
    llm = LLM({"model": str(folder), "device": "cpu", "dtype": "float32", "quant": {"options": {"cpu_kernel": "tiled"}}})
    assert llm.pipeline.resolved.summary()["quant"]["name"] == "int4-weight"  # auto: the plugin that reads it
    layer = llm.pipeline.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int4WeightLinear) and layer.self_attn.qkv_proj.group_size == group_size
    assert type(llm.pipeline.model.lm_head) is torch.nn.Linear  # ignored by the checkpoint: float
    ours = llm.engine.score(PROMPT).double()
    assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()
    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    assert llm.generate([PROMPT], params)[0].token_ids == hf_tokens
    # the default CPU path runs torch's int4 kernel for few rows, in bfloat16: near, not exact
    auto = LLM({"model": str(folder), "device": "cpu", "dtype": "float32"})
    assert auto.pipeline.model.model.layers[0].self_attn.qkv_proj.int4pack_weight is not None
    step = auto.engine.score(PROMPT[:1]).double()[0]
    assert (step - expected[0]).abs().max() <= 0.02 * expected[0].abs().max()


GPTQ_AWQ = {"gptq-v1-asym": dict(method="gptq"), "gptq-v2-sym": dict(method="gptq", symmetric=True, v1=False),
            "gptq-act-order": dict(method="gptq", act_order=True, group_size=16),
            "awq-gemm": dict(method="awq", group_size=16)}


@pytest.mark.parametrize("variant", sorted(GPTQ_AWQ))
def test_gptq_and_awq_give_the_logits_of_the_weights_they_stand_for(variant, tmp_path, tiny_model):
    from tessellm.testing.prequantized import build_gptq_or_awq

    folder = build_gptq_or_awq(tiny_model("llama", vocab_size=512), tmp_path / "q", tmp_path / "ref",
                               **GPTQ_AWQ[variant])
    llm = LLM({"model": str(folder), "device": "cpu", "dtype": "float32", "quant": {"options": {"cpu_kernel": "tiled"}}})
    layer = llm.pipeline.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, Int4WeightLinear) and (layer.input_perm is not None) == ("act-order" in variant)
    expected = LLM({"model": str(tmp_path / "ref"), "device": "cpu", "dtype": "float32"}).engine.score(PROMPT).double()
    ours = llm.engine.score(PROMPT).double()
    assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_gptq_and_awq_support_names_what_it_does_not_read():
    assert checkpoint_support({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"}) is None
    assert "8-bit GPTQ" in checkpoint_support({"quant_method": "gptq", "bits": 8})
    assert "checkpoint_format 'marlin'" in checkpoint_support({"quant_method": "gptq", "bits": 4,
                                                               "checkpoint_format": "marlin"})
    assert checkpoint_support({"quant_method": "awq", "bits": 4, "version": "GEMM", "zero_point": True}) is None
    assert "version 'gemv'" in checkpoint_support({"quant_method": "awq", "bits": 4, "version": "gemv"})
    assert "(compressed-tensors, gptq, awq)" in checkpoint_support({"quant_method": "fp8"})


def test_unpacking_reads_the_lowest_nibble_first():
    words = torch.tensor([[0x76543210, 0x0000000F]], dtype=torch.int32)
    assert unpack_int32_nibbles(words, 9).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 15]]
    negative = torch.tensor([[-1]], dtype=torch.int32)  # every bit set: eight 15s
    assert unpack_int32_nibbles(negative, 8).tolist() == [[15] * 8]


def _config(fmt="pack-quantized", bits=4, strategy="group", activations=None, **extra):
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": activations,
                                          "weights": {"num_bits": bits, "type": "int", "strategy": strategy,
                                                      "group_size": 32, **extra}}}}


def test_support_names_what_it_does_not_read():
    assert compressed_tensors_support(_config()) is None
    assert compressed_tensors_support(_config(strategy="channel")) is None
    assert "int4-weight reads pack-quantized" in compressed_tensors_support(_config(fmt="float-quantized"))
    assert "8-bit int" in compressed_tensors_support(_config(bits=8))
    assert "actorder 'group'" in compressed_tensors_support(_config(actorder="group"))
    assert "activations too" in compressed_tensors_support(_config(activations={"num_bits": 8}))
    assert "compressed-tensors" in compressed_tensors_support({"quant_method": "bitsandbytes"})


def test_a_format_no_plugin_reads_is_refused_at_load(w4a16, tmp_path):
    import shutil

    folder = shutil.copytree(w4a16(True, 32), tmp_path / "nvfp4")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = _config(fmt="nvfp4-pack-quantized")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"quantized with 'compressed-tensors' is not supported; fp8: config group "
                                             r"'group_0' has format 'nvfp4-pack-quantized' \(fp8 reads float-quantized\); "
                                             r"int4-weight: config group 'group_0' has format 'nvfp4-pack-quantized'"):
        LLM({"model": str(folder), "device": "cpu", "dtype": "float32"})


def test_a_named_quantizer_that_does_not_read_the_checkpoint_is_refused(w4a16):
    with pytest.raises(ConfigError, match=r"quant.name 'int8-weight' cannot load this 'compressed-tensors' "
                                          r"checkpoint \(int8-weight: it reads no pre-quantized checkpoint\); "
                                          r"quant plugins that can: int4-weight"):
        LLM({"model": str(w4a16(True, 32)), "device": "cpu", "dtype": "float32", "quant": {"name": "int8-weight"}})


def test_compressed_tensors_w8a8_loads_into_w8a8(w4a16, tmp_path):
    """int-quantized W8A8 (int8 weights per channel, activations per token at run time): the
    checkpoint's own int8 weights and scales, and the greedy tokens of transformers reading
    the folder; the logits differ by activation quantization alone (transformers'
    dequantizing reader runs float activations), a few percent of their range here."""
    from tessellm.plugins.quant.int8.w8a8 import W8A8Linear
    from tessellm.testing.prequantized import build_compressed_tensors

    base = w4a16(True, 32).parent / "base"
    folder = build_compressed_tensors(base, tmp_path / "w8a8", dict(num_bits=8, type="int", symmetric=True,
                                                                   strategy="channel"), "int-quantized",
                                      input_activations=dict(num_bits=8, type="int", symmetric=True, strategy="token",
                                                             dynamic=True))
    llm = LLM({"model": str(folder), "device": "cpu", "dtype": "float32"})
    assert llm.pipeline.resolved.summary()["quant"]["name"] == "w8a8"
    layer = llm.pipeline.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, W8A8Linear) and layer.weight_int8.dtype == torch.int8
    hf = transformers_reading(folder)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].double()
    ours = llm.engine.score(PROMPT).double()
    assert (ours - expected).abs().max() <= 0.05 * expected.abs().max()
    hf_tokens = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT):].tolist()
    assert llm.generate([PROMPT], {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True})[0].token_ids == hf_tokens


def test_w8a8_names_the_activation_schemes_it_does_not_read():
    from tessellm.plugins.quant.int8.w8a8 import W8A8Quantizer

    def config(**acts):
        return {"quant_method": "compressed-tensors", "format": "int-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel",
                                                    "symmetric": True},
                                        "input_activations": acts or None}}}

    assert W8A8Quantizer.checkpoint_support(config(num_bits=8, type="int", strategy="token", dynamic=True)) is None
    assert "per token, dynamic" in W8A8Quantizer.checkpoint_support(config(num_bits=8, type="int", strategy="tensor",
                                                                           dynamic=False))
    assert "per token, dynamic" in W8A8Quantizer.checkpoint_support(config())  # weight-only int8: not w8a8's


def test_tessellm_generate_runs_a_prequantized_folder(w4a16, capsys):
    """`tessellm generate --set model=FOLDER` on a W4A16 folder: transformers' greedy tokens."""
    from transformers import AutoTokenizer

    from tessellm.cli import main

    folder = w4a16(False, 32)
    status = main(["generate", "--set", "device=cpu", "--set", "dtype=float32", "--set", f"model={folder}",
                   "--set", "quant.options.cpu_kernel=tiled", "--max-tokens", "6", "--temperature", "0", "--json",
                   "t5 t6 t7 t8"])
    assert status == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = AutoTokenizer.from_pretrained(folder)("t5 t6 t7 t8")["input_ids"]
    hf = transformers_reading(folder)
    expected = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    assert record["token_ids"][:len(expected)] == expected[:len(record["token_ids"])] and record["token_ids"]


def test_speculative_decoding_over_a_prequantized_model_keeps_its_greedy_tokens(w4a16):
    """Layer-skip drafts from the int4 model itself: exact verification gives plain greedy's tokens."""
    folder = str(w4a16(True, 32))
    params = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    plain = LLM({"model": folder, "device": "cpu", "dtype": "float32"}).generate([PROMPT], params)[0].token_ids
    spec = LLM({"model": folder, "device": "cpu", "dtype": "float32",
                "decoding": {"name": "speculative", "options": {"proposer": "layer-skip", "k": 3}}})
    out = spec.generate([PROMPT], params)[0]
    assert out.token_ids == plain


def test_prequantized_projections_stack_and_act_order_ones_stay_apart(w4a16, tmp_path, tiny_model):
    """At load a checkpoint's stored q/k/v and gate/up join into one int4 product each (packed
    weights, scales and offsets concatenated; the logits are transformers', as above); GPTQ
    act-order layers, each permuting its input its own way, stay apart with the same logits."""
    from tessellm.testing.prequantized import build_gptq_or_awq

    layer = LLM({"model": str(w4a16(True, 32)), "device": "cpu", "dtype": "float32"}).pipeline.model.model.layers[0]
    assert [name for name, _ in layer.self_attn.qkv_proj.stacked_parts] == ["q_proj", "k_proj", "v_proj"]
    assert isinstance(layer.mlp.gate_up_proj, Int4WeightLinear) and layer.mlp.gate_up_proj.int4pack_weight is not None
    folder = build_gptq_or_awq(tiny_model("llama", vocab_size=512), tmp_path / "q", tmp_path / "ref",
                               **GPTQ_AWQ["gptq-act-order"])
    llm = LLM({"model": str(folder), "device": "cpu", "dtype": "float32", "quant": {"options": {"cpu_kernel": "tiled"}}})
    attn = llm.pipeline.model.model.layers[0].self_attn
    assert attn.qkv_proj is None and attn.q_proj.input_perm is not None
    assert Int4WeightLinear.stack([attn.q_proj, attn.k_proj]) is None


def test_lora_adapters_run_over_a_prequantized_model(tmp_path, tiny_model):
    """A PEFT adapter served over an AWQ checkpoint (the layers it targets are int4): the
    logits of the same adapter over the float model of the weights the checkpoint stands for."""
    from tessellm.testing.lora import build_tiny_lora
    from tessellm.testing.prequantized import build_gptq_or_awq

    base = tiny_model("llama", vocab_size=512)
    folder = build_gptq_or_awq(base, tmp_path / "q", tmp_path / "ref", method="awq", group_size=16)
    adapter = build_tiny_lora(base, tmp_path / "qv", rank=4, seed=1, target_modules=("q_proj", "v_proj"))

    def scores(model_folder):
        llm = LLM({"model": str(model_folder), "device": "cpu", "dtype": "float32",
                   "quant": {"options": {"cpu_kernel": "tiled"}} if model_folder == folder else {},
                   "lora": {"adapters": {"qv": str(adapter)}}})
        params = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        return [o.token_ids for o in llm.generate([PROMPT, PROMPT], params, lora=["qv", None])]

    ours, expected = scores(folder), scores(tmp_path / "ref")
    assert ours == expected


def test_a_packed_tensor_that_does_not_fit_the_model_is_a_load_error(w4a16, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(w4a16(True, 32), tmp_path / "bad")
    state = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight_packed"
    state[name] = state[name][:, :12].contiguous()  # 96 input channels' worth, where the model has 128
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model.layers.0.mlp.down_proj: weight_packed is \[64, 12\], not the "
                                             r"\[64, 16\] the model's \[64, 128\] layer packs to"):
        LLM({"model": str(folder), "device": "cpu", "dtype": "float32"})
