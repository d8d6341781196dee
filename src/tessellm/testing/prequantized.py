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


def _ranges(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(minimum, maximum) of ``w`` [N, K] per the strategy of ``args`` (group, channel,
    tensor or block), shaped as compressed-tensors' scales are."""
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "group":
        grouped = w.view(w.shape[0], -1, args.group_size)
        return grouped.amin(dim=-1), grouped.amax(dim=-1)
    if strategy == "channel":
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    if strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    bn, bk = args.block_structure
    blocks = w.view(w.shape[0] // bn, bn, w.shape[1] // bk, bk)
    return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))


def build_compressed_tensors(source: Path, target: Path, weights: dict, fmt: str,
                             input_activations: dict | None = None) -> Path:
    """``source`` (a float HF folder) as a compressed-tensors folder of format ``fmt``
    ("pack-quantized", "float-quantized", "int-quantized") in ``target``: every decoder-layer
    projection's weight quantized per ``weights`` (QuantizationArgs fields) with min-max
    ranges, by compressed-tensors' own qparams, quantize and compressor code; embeddings,
    norms and lm_head as they are."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    args = QuantizationArgs(**weights)
    activations = None if input_activations is None else QuantizationArgs(**input_activations)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=activations)
    compressor = BaseCompressor.get_value_from_registry(fmt)
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
        prefix, w = name[: -len(".weight")], tensor.float()
        scale, zero_point = calculate_qparams(*_ranges(w, args), args)
        compressed = compressor.compress({"weight": w, "weight_scale": scale.to(tensor.dtype),
                                          "weight_zero_point": zero_point}, scheme)
        out.update({f"{prefix}.{key}": value.contiguous() for key, value in compressed.items()})
    save_file(out, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump(),
                                      "input_activations": None if activations is None else activations.model_dump(),
                                      "output_activations": None, "format": fmt}},
        "ignore": ["lm_head"], "kv_cache_scheme": None}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def build_compressed_tensors_w4a16(source: Path, target: Path, *, group_size: int = 32,
                                   symmetric: bool = True) -> Path:
    """``source`` as a pack-quantized W4A16 folder: 4-bit weights in groups of ``group_size``
    (symmetric, or asymmetric with packed zero points)."""
    return build_compressed_tensors(source, target, dict(num_bits=4, type="int", symmetric=symmetric,
                                                         strategy="group", group_size=group_size), "pack-quantized")


def every_layer_matrix(name: str, tensor: torch.Tensor) -> bool:
    """Every 2-D weight of the decoder layers but the MoE router's (DeepSeek-V3's FP8 choice)."""
    return ".layers." in name and name.endswith(".weight") and tensor.dim() == 2 and not name.endswith("mlp.gate.weight")


def build_fine_grained_fp8(source: Path, target: Path, reference: Path, *, block: tuple[int, int] = (32, 32),
                           quantizes=lambda name, tensor: _is_quantized_linear(name)) -> Path:
    """``source`` as a ``quant_method: fp8`` folder (transformers' fine-grained FP8, DeepSeek-V3's
    layout: e4m3 ``weight`` and float32 ``weight_scale_inv`` per ``block``) in ``target``, and
    in ``reference`` the float folder of exactly the weights it stands for. ``quantizes(name,
    tensor)`` picks the weights stored in FP8 (default: the projections; DeepSeek-V3 style:
    ``every_layer_matrix``)."""
    from safetensors.torch import load_file

    from tessellm.plugins.quant.fp8.linear import dequantize_fp8, quantize_fp8

    state = {}
    for file in sorted(source.glob("*.safetensors")):
        state.update(load_file(file))
    packed, dequantized = {}, {}
    for name, tensor in state.items():
        if not quantizes(name, tensor):
            packed[name] = dequantized[name] = tensor
            continue
        weight, scale = quantize_fp8(tensor, "block", block)
        packed[name], packed[f"{name}_scale_inv"] = weight, scale
        dequantized[name] = dequantize_fp8(weight, scale, block).to(tensor.dtype)
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
    _write_pair(source, target, reference, packed, dequantized, quant)
    return target


def _write_pair(source: Path, target: Path, reference: Path, packed: dict, dequantized: dict, quant: dict) -> None:
    """Write ``packed`` with ``quant`` as its quantization_config into ``target`` and
    ``dequantized`` as a float folder into ``reference``, each with ``source``'s other files."""
    from safetensors.torch import save_file

    config = json.loads((source / "config.json").read_text())
    for folder, tensors in ((target, packed), (reference, dequantized)):
        folder.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
                shutil.copy(f, folder / f.name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": quant}, indent=2))
    (reference / "config.json").write_text(json.dumps(config, indent=2))


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
    from safetensors.torch import load_file

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
    quant = ({"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": symmetric,
              "checkpoint_format": "gptq" if v1 else "gptq_v2"} if method == "gptq" else
             {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"})
    _write_pair(source, target, reference, packed, dequantized, quant)
    return target
