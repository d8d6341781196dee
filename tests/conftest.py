"""Shared fixtures: the real SmolLM2 model, tiny random-weight models of each supported
architecture, and a hypothesis profile that never flakes (no deadline, derandomized)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

if not torch.cuda.is_available():
    # Triton kernels run interpreted on the CPU. Triton reads this when it is first imported
    # (by any test module, or by a library such as transformers at collection): set it before.
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile("ci", deadline=None, derandomize=True, max_examples=15, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

collect_ignore_glob = ["compat/frozen_*"]  # a frozen plugin package; tests/compat runs its tests itself


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _gpu_shared_by_workers():
    """Parallel test workers on one GPU each take an equal share of its memory (a paged
    cache sizes itself within it), so no worker's cache starves another's kernels."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(min(1.0, 0.85 / workers))
    yield


@pytest.fixture(scope="session", autouse=True)
def _cpu_threads_shared_by_workers():
    """Parallel test workers (make test runs two) each take an equal share of the CPU's
    threads, so that two workers' matrix kernels do not fight over the same cores."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    yield


@pytest.fixture(scope="session", autouse=True)
def _float32_dots_are_ieee():
    """Every interpreted Triton launch of float32 tensors computes its dots in IEEE float32, as
    a float32 model needs on a GPU (the interpreter alone would never show TF32)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from tessellm.testing.float32_dots import float32_dots_checked

    with float32_dots_checked():
        yield


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder (converted once)."""
    from tessellm.core.model.loader import model_folder, resolve_model

    return model_folder(resolve_model("smollm2-135m"))


@pytest.fixture(scope="session")
def smollm2_llm():
    """SmolLM2 in float32 on the CPU with the reference plugins."""
    from tessellm import LLM

    return LLM({"model": "smollm2-135m", "device": "cpu", "dtype": "float32",
                "cache": {"name": "contiguous", "options": {"max_seqs": 16}},
                "scheduler": {"name": "static", "options": {"max_batch_size": 16}}})


TINY = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  tie_word_embeddings=True),
    "llama3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=1, max_position_embeddings=512, rms_norm_eps=1e-5,
                   tie_word_embeddings=False,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=False),
    "llama-long": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       tie_word_embeddings=True),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, sliding_window=8),
}


def build_tiny_model(target: Path, arch: str, tokenizer_dir: Path, seed: int = 0, vocab_size: int = 49152) -> Path:
    """A random-weight Hugging Face folder of architecture ``arch`` (a key of TINY) with
    SmolLM2's tokenizer, so pipelines load it like any model."""
    import transformers

    cls_name = {"llama": "Llama", "llama3": "Llama", "llama-long": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[arch]
    config_cls = getattr(transformers, f"{cls_name}Config")
    model_cls = getattr(transformers, f"{cls_name}ForCausalLM")
    config = config_cls(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=2, **TINY[arch])
    if arch == "qwen2":
        config.use_sliding_window = False
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # larger weights than the init's std 0.02 make logits far from ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "bias" in str(p):
                p.normal_(0, 0.1)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, target / name)
    return target


@pytest.fixture(scope="session")
def tokenizer_dir(request) -> Path:
    """SmolLM2's tokenizer files: $TESSELLM_TEST_TOKENIZER_DIR if set (a GPU machine that
    cannot receive the GGUF gets only these), else the converted model's folder."""
    override = os.environ.get("TESSELLM_TEST_TOKENIZER_DIR")
    return Path(override) if override else request.getfixturevalue("smollm2_dir")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tokenizer_dir):
    """Factory: ``tiny_model("qwen2")`` -> folder of a tiny random model (built once per
    arch, seed and vocabulary size; other seeds give other weights of the same shapes)."""
    built: dict[tuple, Path] = {}

    def make(arch: str = "llama", seed: int = 0, vocab_size: int = 49152) -> Path:
        key = (arch, seed, vocab_size)
        if key not in built:
            built[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}-{seed}-{vocab_size}"), arch,
                                          tokenizer_dir, seed, vocab_size)
        return built[key]

    return make


@pytest.fixture(scope="session")
def cpu_config():
    """Factory: ``cpu_config(model, **overrides)`` -> a CPU config dict with the reference plugins."""

    def make(model: Path | str, **overrides) -> dict:
        config = {"model": str(model), "device": "cpu", "dtype": "float32",
                  "cache": {"name": "contiguous", "options": {"max_seqs": 8}},
                  "scheduler": {"name": "static"}, "decoding": {"name": "sample"}}
        config.update(overrides)
        return json.loads(json.dumps(config))

    return make


@pytest.fixture
def authors_plugins(request, monkeypatch):
    """The calling test module's hookimpls, registered as a third-party package
    ('authors-package') in a registry that pipelines built during the test use."""
    from tessellm.core.registry import PluginRegistry

    registry = PluginRegistry()
    registry.add_module(request.module, package="authors-package")
    monkeypatch.setattr("tessellm.core.registry._default", registry)
    return registry


@pytest.fixture
def install_plugin_folder(tmp_path, monkeypatch):
    """Factory: ``install_plugin_folder(folder)`` installs a plugin package folder (one with a
    pyproject.toml, as examples/tessellm-plugin-example) as a real distribution: a dist-info
    with its name, version and ``[tessellm]`` entry points, and the folder on sys.path, so a
    fresh ``PluginRegistry()`` loads it through importlib.metadata. Returns the distribution
    name. The package's modules are dropped from sys.modules afterwards, so another folder
    with the same package name can be installed by a later test."""
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    before = set(sys.modules)
    packages: list[str] = []

    def install(folder: Path) -> str:
        project = tomllib.loads((folder / "pyproject.toml").read_text())
        meta = project["project"]
        info = tmp_path / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
        lines = [f"{name} = {target}" for name, target in meta["entry-points"]["tessellm"].items()]
        (info / "entry_points.txt").write_text("[tessellm]\n" + "\n".join(lines) + "\n")
        packages.extend(project["tool"]["setuptools"]["packages"])
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.syspath_prepend(str(folder))
        return meta["name"]

    yield install
    for name in set(sys.modules) - before:
        if name.split(".")[0] in packages:
            del sys.modules[name]


@pytest.fixture
def install_example(install_plugin_folder, monkeypatch):
    """Factory: ``install_example(folder)`` installs an examples/ plugin package (as
    ``install_plugin_folder``) and makes a fresh registry holding it the one pipelines use;
    returns (distribution name, registry). The registry loads without a failure."""
    from tessellm.core import registry as registry_module
    from tessellm.core.registry import PluginRegistry

    def install(folder: Path):
        dist = install_plugin_folder(folder)
        registry = PluginRegistry()
        assert registry.failures == []
        monkeypatch.setattr(registry_module, "_default", registry)
        return dist, registry

    return install


def imports_beyond_the_plugin_api(folder: Path) -> list[str]:
    """Every ``tessellm.X`` import in the Python files under ``folder`` other than the plugin
    API (``tessellm`` itself and ``tessellm.testing``), as "path: module"."""
    import ast

    found = []
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [f"{path}: {name}" for name in names if name.startswith("tessellm.")
                      and not (name == "tessellm.testing" or name.startswith("tessellm.testing."))]
    return found


@pytest.fixture
def plugin_api_imports():
    """``imports_beyond_the_plugin_api``, for the tests of the examples/ packages."""
    return imports_beyond_the_plugin_api


@pytest.fixture(scope="session")
def int8_dot_kernels():
    """The CPU int8 dot-product kernels (plugins/quant/cpu), built or loaded from the cache
    folder once per session at the first test that asks; the test skips, saying why, where
    they cannot be had (no C++ compiler, not x86-64, no AVX2, TESSELLM_CPU_KERNELS=0)."""
    from tessellm.plugins.quant.cpu import build

    found = build.kernels()
    if found is None:
        pytest.skip(f"the CPU int8 dot-product kernels are unavailable here: {build.why_unavailable}")
    return found
