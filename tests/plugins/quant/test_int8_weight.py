"""`int8-weight`: quantization error bounds on random shapes with outlier channels, each
matmul path against the float64 matmul of the dequantized operands, the layer and the
quantizer's choices (lm_head kept, group sizes checked), and a pipeline that runs it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from tessellm import LLM
from tessellm.core.errors import ConfigError
from tessellm.plugins.quant.int8 import cpu
from tessellm.plugins.quant.int8.linear import Int8WeightLinear
from tessellm.plugins.quant.int8.quantize import dequantize, quantize_per_channel, reference_matmul
from tessellm.plugins.quant.int8.weight_only import Int8WeightOptions, Int8WeightQuantizer


@st.composite
def weights(draw, group_sizes=(None, 32, 64)):
    """A random weight [N, K] with a few outlier output and input channels, and a group size
    that divides K."""
    group = draw(st.sampled_from(group_sizes))
    n = draw(st.integers(1, 40))
    k = (group or 1) * draw(st.integers(1, 4)) if group else draw(st.integers(1, 96))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    rows = torch.randint(0, n, (max(1, n // 8),), generator=g)
    cols = torch.randint(0, k, (max(1, k // 16),), generator=g)
    w[rows] *= 50.0  # outlier output channels
    w[:, cols] *= 20.0  # outlier input channels
    return w, group, seed


@given(weights())
def test_quantize_dequantize_error_is_at_most_half_a_step(case):
    w, group, _ = case
    q, scale = quantize_per_channel(w, group)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    steps = scale[:, None].expand_as(w) if scale.dim() == 1 else \
        scale.repeat_interleave(group, dim=1)
    error = (dequantize(q, scale) - w).abs()
    assert bool((error <= steps / 2 * (1 + 1e-5) + 1e-12).all())


def matmul_bound(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 rounding room for x @ deq.T: a few ulps of the sum of absolute products."""
    return (x.double().abs() @ dequantize(q, scale).double().abs().T) * 2e-6 + 1e-6


@pytest.mark.parametrize("path", ["tiled", "reduction"])
@given(case=weights(), rows=st.integers(1, 9))
def test_each_path_matches_the_float64_reference(path, case, rows):
    w, group, seed = case
    q, scale = quantize_per_channel(w, group)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(seed + 1))
    out = cpu.tiled_matmul(x, q, scale) if path == "tiled" else cpu.int8_weight_matmul(x, q, scale, compiled=False)
    assert out.shape == (rows, w.shape[0]) and out.dtype == x.dtype
    assert bool(((out.double() - reference_matmul(x, q, scale)).abs() <= matmul_bound(x, q, scale)).all())


@settings(max_examples=4)
@given(case=weights(group_sizes=(None, 32)), rows=st.integers(1, 4))
def test_the_compiled_reduction_matches_the_reference(case, rows):
    w, group, seed = case
    q, scale = quantize_per_channel(w, group)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(seed + 1))
    out = cpu.int8_weight_matmul(x, q, scale)
    assert bool(((out.double() - reference_matmul(x, q, scale)).abs() <= matmul_bound(x, q, scale)).all())


def test_tiles_cover_every_output_channel(monkeypatch):
    monkeypatch.setattr(cpu, "TILE_ROWS", 7)  # tiles that do not divide N
    w = torch.randn(30, 64)
    q, scale = quantize_per_channel(w, 32)
    x = torch.randn(5, 64)
    assert torch.allclose(cpu.tiled_matmul(x, q, scale).double(), reference_matmul(x, q, scale), atol=1e-5)


@pytest.mark.parametrize("rows, compiled", [(1, True), (4, True), (5, False)])
def test_the_layer_keeps_shapes_and_picks_its_path_by_rows(monkeypatch, rows, compiled):
    linear = nn.Linear(64, 24, bias=True)
    layer = Int8WeightLinear(linear, None, small_batch_rows=4, compile=True)
    calls = []
    monkeypatch.setattr("tessellm.plugins.quant.int8.linear.int8_weight_matmul",
                        lambda x, q, s: calls.append("reduction") or cpu.int8_weight_matmul(x, q, s, compiled=False))
    x = torch.randn(rows, 1, 64)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (rows, 1, 24)
    assert (calls == ["reduction"]) == compiled
    q, scale = quantize_per_channel(linear.weight, None)
    expected = reference_matmul(x.view(rows, 64), q, scale, linear.bias).view(rows, 1, 24)
    assert torch.allclose(out.double(), expected, atol=1e-5)
    assert not any(p.dtype.is_floating_point and p.shape == linear.weight.shape for p in layer.buffers())


def quantizer(**options) -> Int8WeightQuantizer:
    return Int8WeightQuantizer(Int8WeightOptions(**options), torch.device("cpu"), torch.float32)


class Tiny(nn.Module):
    def __init__(self, in_features: int = 64):
        super().__init__()
        self.proj = nn.Linear(in_features, 32)
        self.lm_head = nn.Linear(32, 100, bias=False)


def test_lm_head_stays_float_unless_asked():
    model = quantizer().apply(Tiny())
    assert isinstance(model.proj, Int8WeightLinear) and type(model.lm_head) is nn.Linear
    model = quantizer(quantize_lm_head=True).apply(Tiny())
    assert isinstance(model.lm_head, Int8WeightLinear)


def test_a_group_size_that_does_not_divide_is_a_config_error():
    with pytest.raises(ConfigError, match="group_size: 64 does not divide proj's in_features 96"):
        quantizer(group_size=64).apply(Tiny(96))
    with pytest.raises(ValueError):
        Int8WeightOptions(group_size=48)


def test_a_pipeline_runs_it_by_config(cpu_config, tiny_model):
    folder = tiny_model("llama")
    llm = LLM(cpu_config(folder, quant={"name": "int8-weight", "options": {"compile": False}}))
    assert llm.pipeline.resolved.choices["quant"].entry.name == "int8-weight"
    assert isinstance(llm.pipeline.model.model.layers[0].mlp.down_proj, Int8WeightLinear)
    out = llm.generate([[5, 6, 7, 8]], {"max_tokens": 4, "ignore_eos": True})
    assert len(out[0].token_ids) == 4


@settings(max_examples=5)
@given(case=weights(group_sizes=(None, 32)), rows=st.sampled_from([1, 3, 17]), splits=st.sampled_from([None, 1, 3]))
def test_the_triton_kernel_matches_the_reference(case, rows, splits):
    """Compiled on a GPU, under the interpreter on a CPU (conftest sets TRITON_INTERPRET=1
    without a GPU); K split among programs as the device would, or one or three ways (more
    splits than K tiles: each split keeps one)."""
    from tessellm.plugins.quant.int8.triton_matmul import triton_int8_weight_matmul

    w, group, seed = case
    q, scale = quantize_per_channel(w, group)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(seed + 1))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = triton_int8_weight_matmul(x.to(device), q.to(device), scale.to(device), splits=splits).cpu()
    assert out.shape == (rows, w.shape[0])
    assert bool(((out.double() - reference_matmul(x, q, scale)).abs() <= matmul_bound(x, q, scale) * 10).all())


@given(case=weights(group_sizes=(None,)), rows=st.integers(1, 9))
@settings(max_examples=10)
def test_torch_int8pack_matches_the_reference(case, rows):
    w, _, seed = case
    q, scale = quantize_per_channel(w)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(seed + 1))
    out = cpu.int8pack_matmul(x, q, scale)
    assert bool(((out.double() - reference_matmul(x, q, scale)).abs() <= matmul_bound(x, q, scale) * 4).all())


class Tiny3(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 32), nn.Linear(32, 96)


def test_auto_keeps_the_few_rows_path_that_measured_fastest(monkeypatch):
    """``cpu_kernel: auto`` times the candidates once, at load, and every layer takes the
    winner; a named kernel is taken as named; int8pack with groups is refused; no compile:
    the tiled path."""
    from tessellm.plugins.quant.int8 import weight_only

    seen = []
    monkeypatch.setattr(weight_only, "fastest", lambda candidates: seen.append(sorted(candidates)) or "int8pack")
    from tessellm.plugins.quant.cpu.build import kernels

    dot = ["int8-dot"] if kernels() is not None else []  # where the C++ kernel builds, it is a candidate
    model = quantizer().apply(Tiny3())
    assert seen == [sorted(["compiled", "int8pack", "tiled"] + dot)]
    assert model.a.small_kernel == model.b.small_kernel == "int8pack"
    assert quantizer(cpu_kernel="tiled").apply(Tiny3()).b.small_kernel == "tiled"
    assert quantizer(compile=False).apply(Tiny3()).a.small_kernel == "tiled"
    seen.clear()
    quantizer(group_size=32).apply(Tiny3())
    assert seen == [sorted(["compiled", "tiled"] + dot)]  # int8pack takes per-channel scales only
    with pytest.raises(ConfigError, match="'int8pack' takes per-channel scales only"):
        quantizer(group_size=32, cpu_kernel="int8pack").apply(Tiny3())


def test_auto_measures_for_real_and_the_layer_runs_the_winner():
    model = quantizer().apply(Tiny3())
    assert model.b.small_kernel in Int8WeightLinear.SMALL_KERNELS
    x = torch.randn(2, 64)
    with torch.inference_mode():
        out = model.b(model.a(x))
    assert out.shape == (2, 96) and torch.isfinite(out).all()
