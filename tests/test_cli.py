"""The ``tessellm`` command: generate's outputs, and bad input giving one line and exit 2
(from the CLI) or a typed exception (from the API)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tessellm
from tessellm.core import registry as registry_module
from tessellm.core.interfaces.kv import KVLayout
from tessellm.cli import main
from tessellm.core.errors import (ConfigError, InvalidRequestError, ModelLoadError, RequestRejectedError,
                                  TessellmError)
from tessellm.core.registry import PluginRegistry
from tessellm.plugins.cache.contiguous import ContiguousCache


class LatentCache(ContiguousCache):
    """A cache storing MLA latents: no built-in attention backend can read it."""

    name = "latent-test"
    api_version = "1.0"
    auto_priority = None

    @classmethod
    def kv_layout(cls, options, ctx):
        return KVLayout("latent", ctx.max_model_len, ctx.dtype)


class _LatentPlugin:
    @staticmethod
    @tessellm.hookimpl
    def register_cache(register):
        register(LatentCache)


@pytest.fixture
def with_latent_cache(monkeypatch):
    registry = PluginRegistry()
    registry.add_module(_LatentPlugin, package="latent-test-pkg")
    monkeypatch.setattr(registry_module, "_default", registry)


@pytest.fixture(scope="module")
def corrupt_models(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corrupt")
    folder = root / "bad-safetensors"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    garbage = root / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file" * 100)
    from tessellm.core.model.loader import resolve_model

    truncated = root / "truncated.gguf"
    truncated.write_bytes(resolve_model("smollm2-135m").read_bytes()[: 2 << 20])
    text = root / "notes.txt"
    text.write_text("not a model")
    return {"safetensors": folder, "garbage": garbage, "truncated": truncated, "text": text}


BAD_INPUT = {
    # name: (CLI arguments after "generate", expected exception, words the message must contain)
    "unknown plugin": (["--set", "attention.name=flashy", "hi"], ConfigError, ["attention.name", "flashy", "sdpa"]),
    "wrong option type": (["--set", "cache.options.max_seqs=many", "hi"], ConfigError,
                          ["cache.options.max_seqs", "many"]),
    "unknown option": (["--set", "cache.options.blok_size=4", "hi"], ConfigError, ["blok_size", "max_seqs"]),
    "incompatible combination": (["--set", "cache.name=latent-test", "--set", "attention.name=sdpa", "hi"],
                                 ConfigError, ["sdpa", "latent"]),
    "prompt over the context window": (["--set", "max_model_len=8", "word " * 20], InvalidRequestError,
                                       ["max_model_len", "8"]),
    "prompt + max tokens over the window": (["--set", "max_model_len=64", "--max-tokens", "100", "hi"],
                                            RequestRejectedError, ["max_model_len", "64", "max_tokens"]),
    "empty prompt": ([""], InvalidRequestError, ["empty"]),
    "max tokens 0": (["--max-tokens", "0", "hi"], InvalidRequestError, ["max_tokens", "0"]),
    "max tokens negative": (["--max-tokens", "-5", "hi"], InvalidRequestError, ["max_tokens", "-5"]),
    "missing model path": (["--set", "model=/no/such/model", "hi"], ModelLoadError, ["/no/such/model"]),
    "not a model file": (["--set", "model={text}", "hi"], ModelLoadError, ["notes.txt", ".gguf"]),
    "corrupt safetensors": (["--set", "model={safetensors}", "hi"], ModelLoadError, ["safetensors"]),
    "garbage gguf": (["--set", "model={garbage}", "hi"], ModelLoadError, ["GGUF", "garbage.gguf"]),
    "truncated gguf": (["--set", "model={truncated}", "hi"], ModelLoadError, ["GGUF", "truncated.gguf"]),
    "bad temperature": (["--temperature", "-1", "hi"], InvalidRequestError, ["temperature"]),
    "bad top-p": (["--top-p", "1.5", "hi"], InvalidRequestError, ["top_p"]),
}


def _args(args: list[str], models: dict[str, Path]) -> list[str]:
    return [a.format(**{k: str(v) for k, v in models.items()}) for a in args]


@pytest.fixture(autouse=True)
def _conversion_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSELLM_CACHE_DIR", str(tmp_path / "cache"))  # corrupt files must not pollute it


def _smollm2_cached(monkeypatch, smollm2_dir):
    """Point model conversions at the session's converted SmolLM2 (no second conversion)."""
    monkeypatch.setenv("TESSELLM_CACHE_DIR", str(smollm2_dir.parent.parent))


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_2(case, capsys, corrupt_models, with_latent_cache, monkeypatch, smollm2_dir):
    _smollm2_cached(monkeypatch, smollm2_dir)
    args, _, words = BAD_INPUT[case]
    status = main(["generate", "--set", "device=cpu", *_args(args, corrupt_models)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    message = err[-1]
    assert message.startswith("tessellm: error: "), err
    assert "Traceback" not in "\n".join(err)
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_raises_typed_exception_from_api(case, corrupt_models, with_latent_cache, monkeypatch, smollm2_dir):
    from tessellm.cli import build_parser
    from tessellm.core.engine.llm import LLM

    _smollm2_cached(monkeypatch, smollm2_dir)
    args, expected, _ = BAD_INPUT[case]
    ns = build_parser().parse_args(["generate", "--set", "device=cpu", *_args(args, corrupt_models)])
    with pytest.raises(expected) as info:
        llm = LLM(None, overrides=ns.overrides)
        llm.generate(ns.prompts, {"max_tokens": ns.max_tokens, "temperature": ns.temperature, "top_p": ns.top_p})
    assert isinstance(info.value, TessellmError) and "\n" not in str(info.value)


def test_malformed_config_file(tmp_path, capsys):
    path = tmp_path / "pipeline.yaml"
    path.write_text("model: smollm2-135m\nattention: {name: sdpa\n")
    assert main(["generate", "--config", str(path), "hi"]) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("tessellm: error: config file") and "malformed" in message and "\n" not in message


def test_subprocess_exit_status_and_no_traceback(tmp_path):
    """A config typo is reported before any model is converted or loaded (the cache dir is empty)."""
    env_cmd = [sys.executable, "-m", "tessellm", "generate", "--set", "attention.name=nope", "hi"]
    proc = subprocess.run(env_cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("tessellm: error: attention.name")


def test_generate_json_lines(capsys, monkeypatch, smollm2_dir):
    _smollm2_cached(monkeypatch, smollm2_dir)
    status = main(["generate", "--set", "device=cpu", "--max-tokens", "6", "--json", "Hello,", "The sky is"])
    assert status == 0
    lines = capsys.readouterr().out.strip().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["prompt"] for r in records] == ["Hello,", "The sky is"]
    for r in records:
        assert {"prompt", "text", "token_ids", "finish_reason", "ttft_ms", "e2e_ms"} <= r.keys()
        assert r["finish_reason"] in ("stop", "length") and 1 <= len(r["token_ids"]) <= 6


def test_generate_stop_string_and_chat(capsys, monkeypatch, smollm2_dir):
    _smollm2_cached(monkeypatch, smollm2_dir)
    assert main(["generate", "--set", "device=cpu", "--max-tokens", "40", "--json", "--chat",
                 "What is the capital of France?"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert "Paris" in record["text"]
    assert main(["generate", "--set", "device=cpu", "--max-tokens", "40", "--json", "--chat", "--stop", "Paris",
                 "What is the capital of France?"]) == 0
    stopped = json.loads(capsys.readouterr().out)
    assert stopped["finish_reason"] == "stop" and "Paris" not in stopped["text"]
    assert record["text"].startswith(stopped["text"])


def test_plain_output_reports_tokens_per_second(capsys, monkeypatch, smollm2_dir):
    _smollm2_cached(monkeypatch, smollm2_dir)
    assert main(["generate", "--set", "device=cpu", "--max-tokens", "4", "Hi"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("=== Hi\n")
    assert "tokens/s" in captured.err


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "generate" in capsys.readouterr().out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert textwrap.dedent(capsys.readouterr().out).startswith("tessellm ")
