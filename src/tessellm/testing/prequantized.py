"""Pre-quantized checkpoints for tests, written by the field's own libraries: a float model
folder turned into a compressed-tensors ``pack-quantized`` W4A16 folder (llm-compressor's
output format) by compressed-tensors' own quantize, qparams and packing code, with min-max
ranges per group (what llm-compressor's data-free ``oneshot`` computes for W4A16)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_quantized_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEAR_SUFFIXES and ".layers." in name


def build_compressed_tensors_w4a16(source: Path, target: Path, *, group_size: int = 32,
                                   symmetric: bool = True) -> Path:
    """``source`` (a float HF folder with one safetensors file) as a compressed-tensors
    pack-quantized W4A16 folder in ``target``: every decoder-layer projection quantized to 4
    bits in groups of ``group_size`` (symmetric, or asymmetric with packed zero points), the
    embeddings, norms and lm_head left as they are."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, target / f.name)
    state = {}
    for file in sorted(source.glob("*.safetensors")):
        state.update(load_file(file))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if not _is_quantized_linear(name):
            out[name] = tensor
            continue
        prefix = name[: -len(".weight")]
        w = tensor.float()
        grouped = w.view(w.shape[0], -1, group_size)
        scale, zero_point = calculate_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), args)
        compressed = PackedQuantizationCompressor.compress(
            {"weight": w, "weight_scale": scale.to(tensor.dtype), "weight_zero_point": zero_point}, scheme)
        out.update({f"{prefix}.{key}": value.contiguous() for key, value in compressed.items()})
    save_file(out, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump(), "input_activations": None,
                                      "output_activations": None, "format": "pack-quantized"}},
        "ignore": ["lm_head"], "kv_cache_scheme": None}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
