"""Reading what a checkpoint says about pooling (``CheckpointPooling``): sentence-transformers'
files where the folder has them, else its config.json's architecture.

A sentence-transformers folder lists its modules in ``modules.json``: the Transformer (the
folder itself), a ``Pooling`` module (``1_Pooling/config.json``: its ``pooling_mode``, or the
older ``pooling_mode_*_token(s)`` flags, and ``include_prompt``), optional ``Dense`` modules
(their config.json and weights) and a ``Normalize`` module. ``config_sentence_transformers.json``
holds the named prompts and the similarity function; ``sentence_bert_config.json`` the
tokenizer's ``max_seq_length`` and ``do_lower_case``. A cross-encoder is a
``*ForSequenceClassification`` checkpoint; its config.json may name the activation its scores
go through (``sentence_transformers.activation_fn``). Nothing here imports
sentence-transformers: the files are plain JSON and safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tessellm.core.errors import ModelLoadError
from tessellm.core.interfaces.pooling import DENSE_ACTIVATIONS, CheckpointPooling, DenseLayer

LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
                "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
"""sentence-transformers' older per-mode flags, and the mode each turns on."""

ACTIVATION_PATHS = {"Identity": "identity", "Tanh": "tanh", "ReLU": "relu", "GELU": "gelu", "Sigmoid": "sigmoid",
                    "SiLU": "silu", "Softmax": "softmax"}
"""torch.nn activation class names (the last part of a stored dotted path) and ours."""


def read_checkpoint_pooling(folder: Path, hf_config: Any, bidirectional: bool = False) -> CheckpointPooling:
    """What ``folder`` says about pooling. An encoder (``bidirectional``) with no
    sentence-transformers files and no classification head pools its first token (CLS) into
    a unit-length embedding, as an embedding server treats a bare BERT."""
    folder = Path(folder)
    st = _read_sentence_transformers(folder)
    if st is not None:
        return st
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return CheckpointPooling(mode="classify", source=f"config.json's architectures ({architectures[0]})",
                                 num_labels=int(getattr(hf_config, "num_labels", 1) or 1),
                                 activation=_classifier_activation(hf_config))
    if bidirectional:
        return CheckpointPooling(mode="cls", normalize=True, source="an encoder without sentence-transformers files "
                                                                     "(its first token, normalised)")
    return CheckpointPooling()


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {str(path)!r}: {exc}") from None


def _read_sentence_transformers(folder: Path) -> CheckpointPooling | None:
    """The pooling a sentence-transformers folder's modules.json describes (None: no such file,
    or no Pooling module in it)."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _json(modules_file)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{str(modules_file)!r} is not a list of modules")
    pooling = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
    if pooling is None:
        return None
    config = _json(folder / pooling.get("path", "1_Pooling") / "config.json")
    mode = config.get("pooling_mode")
    if mode is None:
        active = [name for key, name in LEGACY_MODES.items() if config.get(key)]
        mode = active if len(active) != 1 else active[0]
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else "+".join(mode)  # several concatenated: no pooler implements that
    dense = tuple(_dense(folder / m.get("path", ""), m) for m in modules if str(m.get("type", "")).endswith("Dense"))
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    extra = _json(folder / "config_sentence_transformers.json") if (folder / "config_sentence_transformers.json").is_file() else {}
    bert = _json(folder / "sentence_bert_config.json") if (folder / "sentence_bert_config.json").is_file() else {}
    return CheckpointPooling(
        mode=str(mode), source=f"{pooling.get('path', '1_Pooling')}/config.json", normalize=normalize, dense=dense,
        include_prompt=bool(config.get("include_prompt", True)), prompts=dict(extra.get("prompts") or {}),
        default_prompt_name=extra.get("default_prompt_name"), similarity=extra.get("similarity_fn_name") or "cosine",
        max_seq_length=bert.get("max_seq_length"), do_lower_case=bool(bert.get("do_lower_case", False)))


def _dense(path: Path, module: dict[str, Any]) -> DenseLayer:
    """A Dense module's weights (model.safetensors; the older pytorch_model.bin is refused:
    it is a pickle) and activation."""
    config = _json(path / "config.json")
    name = _activation_name(config.get("activation_function", "torch.nn.modules.linear.Identity"))
    if name not in DENSE_ACTIVATIONS or config.get("use_residual"):
        raise ModelLoadError(f"sentence-transformers Dense module {module.get('path')!r}: activation "
                             f"{config.get('activation_function')!r}{' with a residual' if config.get('use_residual') else ''} "
                             f"is not supported; supported: {', '.join(DENSE_ACTIVATIONS)}")
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise ModelLoadError(f"sentence-transformers Dense module {module.get('path')!r} has no model.safetensors "
                             f"(a pytorch_model.bin is a pickle and is not read); save it with safe_serialization")
    from safetensors.torch import load_file

    state = load_file(str(weights))
    weight = state.get("linear.weight")
    if weight is None:
        raise ModelLoadError(f"sentence-transformers Dense module {module.get('path')!r}: no linear.weight in "
                             f"its model.safetensors")
    return DenseLayer(weight.to(torch.float32), None if state.get("linear.bias") is None
                      else state["linear.bias"].to(torch.float32), name)


def _activation_name(path: str) -> str:
    return ACTIVATION_PATHS.get(str(path).rsplit(".", 1)[-1], str(path))


def _classifier_activation(hf_config: Any) -> str | None:
    """The activation a cross-encoder's config.json names for its scores (None: unnamed)."""
    extra = getattr(hf_config, "sentence_transformers", None) or {}
    path = extra.get("activation_fn") if isinstance(extra, dict) else None
    path = path or getattr(hf_config, "sbert_ce_default_activation_function", None)
    return _activation_name(path) if path else None
