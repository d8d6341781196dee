"""Pre-quantized checkpoints for tests: a float model folder turned into a compressed-tensors
``pack-quantized`` W4A16 folder (llm-compressor's output format) by compressed-tensors' own
quantize, qparams and packing code, with min-max ranges per group (what llm-compressor's
data-free ``oneshot`` computes for W4A16); and into GPTQ and AWQ folders packed as those
formats document, beside a float folder of exactly the weights they stand for (no GPTQ or
AWQ reader installs on a CPU-only machine without building from source)."""

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


def pack_int32_nibbles(values: torch.Tensor) -> torch.Tensor:
    """[R, C] integers in 0..15 (C a multiple of 8) -> [R, C / 8] int32, eight a word, the
    lowest nibble first (GPTQ's, AWQ's and compressed-tensors' word layout)."""
    words = values.to(torch.int64).view(values.shape[0], -1, 8) << torch.arange(0, 32, 4)
    return words.sum(dim=-1).to(torch.int32)


def _min_max_int4(w: torch.Tensor, groups: torch.Tensor, count: int, symmetric: bool):
    """(q [N, K], zero [N, G], scale [N, G] float16-representable) of w [N, K] with input
    channel k in group ``groups[k]``: GPTQ's min-max grid (symmetric: zero 8)."""
    n = w.shape[0]
    lo = torch.full((n, count), float("inf")).scatter_reduce(1, groups.expand(n, -1), w, "amin")
    hi = torch.full((n, count), float("-inf")).scatter_reduce(1, groups.expand(n, -1), w, "amax")
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    if symmetric:
        scale = (torch.maximum(-lo, hi) * 2 / 15).clamp(min=1e-6).half().float()
        zero = torch.full_like(scale, 8.0)
    else:
        scale = ((hi - lo) / 15).clamp(min=1e-6).half().float()
        zero = (-lo / scale).round().clamp(0, 15)
    q = (w / scale[:, groups] + zero[:, groups]).round().clamp(0, 15)
    return q, zero, scale


def build_gptq_or_awq(source: Path, target: Path, reference: Path, *, method: str, group_size: int = 32,
                      symmetric: bool = False, act_order: bool = False, v1: bool = True, seed: int = 0) -> Path:
    """``source`` (a float HF folder) as a 4-bit GPTQ (``method`` "gptq": act-order or not,
    format gptq (v1, zero - 1 stored) or gptq_v2) or AWQ GEMM ("awq") folder in ``target``,
    packed as those formats document, with min-max grids (no GPTQ error correction: the
    packing, not the rounding, is what a reader must get right); and in ``reference`` the
    float folder of exactly the weights the packed tensors stand for."""
    from safetensors.torch import load_file, save_file

    from tessellm.plugins.quant.int4.checkpoints import AWQ_ORDER

    state = {}
    for file in sorted(source.glob("*.safetensors")):
        state.update(load_file(file))
    g = torch.Generator().manual_seed(seed)
    packed, dequantized = {}, {}
    for name, tensor in state.items():
        if not _is_quantized_linear(name):
            packed[name] = dequantized[name] = tensor
            continue
        prefix, w = name[: -len(".weight")], tensor.float()
        n, k = w.shape
        order = torch.randperm(k, generator=g) if act_order else torch.arange(k)
        groups = torch.empty(k, dtype=torch.long)
        groups[order] = torch.arange(k) // group_size  # act-order: channels grouped in a random order
        q, zero, scale = _min_max_int4(w, groups, k // group_size, symmetric)
        dequantized[name] = ((q - zero[:, groups]) * scale[:, groups]).to(tensor.dtype)
        if method == "gptq":
            stored_zero = (zero - 1) % 16 if v1 else zero
            along_k = q.T.contiguous().view(k // 8, 8, n).transpose(1, 2).reshape(-1, 8)  # word (i, col): q[col, 8i:8i+8]
            packed.update({f"{prefix}.qweight": pack_int32_nibbles(along_k).view(k // 8, n),
                           f"{prefix}.qzeros": pack_int32_nibbles(stored_zero.T.contiguous()),
                           f"{prefix}.scales": scale.T.contiguous().half(), f"{prefix}.g_idx": groups.to(torch.int32)})
        else:
            columns = [8 * (c // 8) + AWQ_ORDER[c % 8] for c in range(n)]  # the column each nibble holds
            packed.update({f"{prefix}.qweight": pack_int32_nibbles(q.T[:, columns].contiguous()),
                           f"{prefix}.qzeros": pack_int32_nibbles(zero.T[:, columns].contiguous()),
                           f"{prefix}.scales": scale.T.contiguous().half()})
    config = json.loads((source / "config.json").read_text())
    for folder, tensors in ((target, packed), (reference, dequantized)):
        folder.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
                shutil.copy(f, folder / f.name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    quant = ({"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": symmetric,
              "checkpoint_format": "gptq" if v1 else "gptq_v2"} if method == "gptq" else
             {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"})
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": quant}, indent=2))
    (reference / "config.json").write_text(json.dumps(config, indent=2))
    return target
