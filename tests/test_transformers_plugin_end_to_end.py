"""A user's folder of a family no native plugin builds (OLMo), through every app with nothing
named but the folder: `tessellm generate --set model=FOLDER` gives transformers' own greedy
tokens, chat prompts use the tokenizer's template, `tessellm serve` answers the openai
client (chat and completions) with the offline text, `tessellm bench` and `tessellm eval ppl`
run, and `tessellm ab --a architecture.name=llama --b architecture.name=transformers` on a
Llama agrees exactly. A checkpoint with its own model code is refused unless
``trust_remote_code`` allows it, then served by that code.

The apps' tests load a 49k-token vocabulary and start servers and subprocesses (minutes on a
loaded CPU): extended; the default set keeps the trust_remote_code switch."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from tessellm import LLM
from tessellm.cli import main
from tessellm.core.errors import ModelLoadError
from tessellm.serve.app import build_app
from tessellm.testing.models import save_word_tokenizer
from tessellm.testing.serving import serving

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
SMALL_MIXED = ["--workload-set", "prompt_median=12", "--workload-set", "prompt_max=40",
               "--workload-set", "output_median=6", "--workload-set", "output_min=2",
               "--workload-set", "output_max=10"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def random_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model.eval()


@pytest.fixture(scope="module")
def olmo_folder(tmp_path_factory, tokenizer_dir):
    """A tiny random OLMo (q/k/v clipping, non-parametric norms) with SmolLM2's tokenizer."""
    from transformers import OlmoConfig, OlmoForCausalLM

    folder = tmp_path_factory.mktemp("olmo") / "model"
    config = OlmoConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, clip_qkv=0.6,
                        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    random_weights(OlmoForCausalLM(config)).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def config_file(olmo_folder):
    config = {"model": str(olmo_folder), "device": "cpu", "dtype": "float32", "max_model_len": 256,
              "cache": {"name": "paged", "options": {"block_size": 8}}, "scheduler": {"name": "continuous"}}
    path = olmo_folder.parent / "pipeline.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def offline(config_file):
    llm = LLM(json.loads(config_file.read_text()))
    assert llm.pipeline.spec.architecture == "transformers"
    return llm


def transformers_greedy(folder: Path, ids: list[int], new: int, **kwargs) -> list[int]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), generation_config=config)[0, len(ids):].tolist()


@pytest.mark.extended
def test_generate_set_model_folder_gives_transformers_tokens(olmo_folder, offline, capsys):
    argv = ["generate", "--set", f"model={olmo_folder}", "--set", "device=cpu", "--set", "dtype=float32",
            "--max-tokens", "8", "--temperature", "0", "--ignore-eos", "--json", *PROMPTS]
    assert main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    for prompt, record in zip(PROMPTS, records):
        ids = offline.tokenizer(prompt)["input_ids"]
        assert record["token_ids"] == transformers_greedy(olmo_folder, ids, 8)


@pytest.mark.extended
def test_chat_prompts_use_the_tokenizers_template(offline):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    expected = offline.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user" in expected  # SmolLM2's template
    out = offline.generate(PROMPTS[0], {"max_tokens": 4, "temperature": 0.0}, chat=True)[0]
    assert out.prompt_token_ids == offline.tokenizer(expected, add_special_tokens=False)["input_ids"]


@pytest.mark.extended
def test_serve_answers_chat_and_completions_with_offline_text(offline):
    from openai import OpenAI

    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    completions = [o.outputs[0].text for o in offline.generate(PROMPTS, params)]
    chat = offline.generate(PROMPTS[1], params, chat=True)[0].outputs[0].text
    with serving(build_app(offline, model_name="tiny-olmo", api_key=None, max_request_bytes=64 * 1024)) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for prompt, text in zip(PROMPTS, completions):
            out = client.completions.create(model="tiny-olmo", prompt=prompt, max_tokens=8, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == text
        answer = client.chat.completions.create(model="tiny-olmo", messages=[{"role": "user", "content": PROMPTS[1]}],
                                                max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
        assert answer.choices[0].message.content == chat


@pytest.mark.extended
def test_bench_and_eval_run_on_it(config_file, tmp_path, capsys):
    assert main(["bench", "--config", str(config_file), "--num-requests", "3", *SMALL_MIXED, "--json",
                 "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pipeline"]["architecture"] == "transformers" and report["total_output_tokens"] > 0
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    assert main(["eval", "ppl", "--config", str(config_file), "--text", str(text), "--window", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"] > 1.0


@pytest.mark.extended
def test_ab_native_llama_against_transformers_agrees_exactly(tmp_path, capsys):
    from tessellm.testing.models import build_tiny

    folder = build_tiny("llama", tmp_path / "llama")
    argv = ["ab", "--set", f"model={folder}", "--set", "device=cpu", "--set", "dtype=float32",
            "--set", "max_model_len=256", "--a", "architecture.name=llama", "--b", "architecture.name=transformers",
            "--num-requests", "2", *SMALL_MIXED, "--rounds", "2", "--num-agreement-prompts", "3", "--json",
            "--no-progress"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert "transformers" in json.dumps(report["b"]["config"]["architecture"])
    assert report["exact_match_rate"] == 1.0 and report["divergences"] == []


# ----------------------------------------------------------------------------- a checkpoint's own code

CONFIGURATION = '''
from transformers import LlamaConfig


class ToyConfig(LlamaConfig):
    model_type = "toyllama"
'''
MODELING = '''
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP

from .configuration_toy import ToyConfig


class HalvedMLP(LlamaMLP):
    """Llama's MLP with its output halved: arithmetic only this checkpoint's code has."""

    def forward(self, x):
        return super().forward(x) * 0.5


class ToyForCausalLM(LlamaForCausalLM):
    config_class = ToyConfig

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp = HalvedMLP(config)
        self.post_init()
'''


@pytest.fixture(scope="module")
def own_code_folder(tmp_path_factory, monkeypatch_module):
    """A checkpoint whose config.json's auto_map names its own config and model classes (files
    beside the weights), as custom-code checkpoints on the Hub are."""
    import importlib

    root = tmp_path_factory.mktemp("own-code")
    package = root / "toypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "configuration_toy.py").write_text(textwrap.dedent(CONFIGURATION))
    (package / "modeling_toy.py").write_text(textwrap.dedent(MODELING))
    monkeypatch_module.syspath_prepend(str(root))
    configuration = importlib.import_module("toypkg.configuration_toy")
    modeling = importlib.import_module("toypkg.modeling_toy")
    configuration.ToyConfig.register_for_auto_class()
    modeling.ToyForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    config = configuration.ToyConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
    folder = root / "model"
    random_weights(modeling.ToyForCausalLM(config)).save_pretrained(folder)
    save_word_tokenizer(folder, 512)
    assert "auto_map" in json.loads((folder / "config.json").read_text())
    return folder


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_own_code_is_refused_unless_trusted_then_served_by_it(own_code_folder):
    config = {"model": str(own_code_folder), "device": "cpu", "dtype": "float32"}
    with pytest.raises(ModelLoadError, match="defines its model in its own code .*set trust_remote_code: true"):
        LLM(config)
    llm = LLM({**config, "trust_remote_code": True})
    assert llm.pipeline.spec.model_type == "toyllama" and llm.pipeline.architecture.name == "transformers"
    assert type(llm.pipeline.model).__mro__[2].__module__.startswith("transformers_modules")
    prompt = [5, 17, 300, 42, 9, 9]
    ours = llm.generate([prompt], {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True})[0].token_ids
    assert ours == transformers_greedy(own_code_folder, prompt, 8, trust_remote_code=True)
