"""`w8a8`: per-token activation quantization bounds, the int32 product against the float64
product of the dequantized operands, the layer's shapes and paths, a pipeline, and SmoothQuant
(the smoothed product is the same in exact arithmetic and no worse quantized, calibration
hooks record the largest inputs and go away, bad settings are clear errors)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

from tessellm import LLM
from tessellm.core.errors import ConfigError
from tessellm.plugins.quant.int8.quantize import quantize_per_channel
from tessellm.plugins.quant.int8.w8a8 import (W8A8Linear, W8A8Options, W8A8Quantizer, quantize_per_token,
                                              reference_w8a8, w8a8_matmul)
from tessellm.plugins.quant.int8.smooth import calibration_chunks, observe_input_ranges, smoothing_scales


@given(rows=st.integers(1, 20), k=st.integers(1, 80), seed=st.integers(0, 2**16), outlier=st.floats(1.0, 100.0))
def test_per_token_quantization_error_is_at_most_half_a_step(rows, k, seed, outlier):
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[:, 0] *= outlier  # an outlier channel: every token's scale grows with it
    xq, scale = quantize_per_token(x)
    assert xq.dtype == torch.int8 and int(xq.abs().max()) <= 127 and scale.shape == (rows, 1)
    assert bool(((xq.float() * scale - x).abs() <= scale / 2 * (1 + 1e-5) + 1e-12).all())


@given(rows=st.integers(1, 40), n=st.integers(1, 48), k=st.integers(1, 96), seed=st.integers(0, 2**16))
def test_the_int32_product_matches_the_dequantized_float64_product(rows, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    q, scale = quantize_per_channel(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(rows, k, generator=g)
    out = w8a8_matmul(x, q, scale)
    expected = reference_w8a8(x, q, scale)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    # the int32 sum is exact; only the final float32 scaling rounds
    assert bool(((out.double() - expected).abs() <= expected.abs() * 1e-6 + 1e-9).all())


def test_the_layer_keeps_shapes_and_bias_and_drops_the_float_weight():
    linear = nn.Linear(64, 24, bias=True)
    layer = W8A8Linear(linear)
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        out = layer(x)
        full = linear(x)
    assert out.shape == (3, 5, 24)
    assert (out - full).norm() / full.norm() < 0.02
    assert not any(b.dtype.is_floating_point and b.shape == linear.weight.shape for b in layer.buffers())


def test_lm_head_stays_float_unless_asked():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 8)
            self.lm_head = nn.Linear(8, 30, bias=False)

    def apply(**options):
        return W8A8Quantizer(W8A8Options(**options), torch.device("cpu"), torch.float32).apply(Tiny())

    assert isinstance(apply().proj, W8A8Linear) and type(apply().lm_head) is nn.Linear
    assert isinstance(apply(quantize_lm_head=True).lm_head, W8A8Linear)


def test_a_pipeline_runs_it_by_config(cpu_config, tiny_model):
    llm = LLM(cpu_config(tiny_model("llama"), quant={"name": "w8a8"}))
    assert isinstance(llm.pipeline.model.model.layers[0].self_attn.o_proj, W8A8Linear)
    assert len(llm.generate([[5, 6, 7, 8]], {"max_tokens": 4, "ignore_eos": True})[0].token_ids) == 4


# ----------------------------------------------------------------------------- SmoothQuant


@given(rows=st.integers(2, 24), n=st.integers(1, 32), k=st.integers(8, 96), seed=st.integers(0, 2**16),
       outlier=st.floats(20.0, 200.0), alpha=st.sampled_from([0.5, 0.7, 0.9]))
def test_smoothing_keeps_the_product_and_shrinks_the_outlier_error(rows, n, k, seed, outlier, alpha):
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(rows, k, generator=g)
    x[:, : max(k // 16, 1)] *= outlier  # a few outlier channels, as in real activations
    s = smoothing_scales(x.abs().amax(0), linear.weight, alpha)
    exact = x.double() @ linear.weight.double().T
    # in exact arithmetic the smoothing changes nothing
    assert torch.allclose((x.double() / s.double()) @ (linear.weight.double() * s.double()).T, exact, rtol=1e-9,
                          atol=1e-9)
    with torch.no_grad():
        plain = (W8A8Linear(linear)(x).double() - exact).norm()
        smoothed = (W8A8Linear(linear, s)(x).double() - exact).norm()
    assert smoothed <= plain * 1.05 + 1e-9


def test_smoothing_scales_follow_the_formula():
    weight = torch.tensor([[0.5, -2.0, 0.0], [-1.0, 1.0, 0.0]])
    ranges = torch.tensor([4.0, 9.0, 0.0])
    s = smoothing_scales(ranges, weight, 0.5)
    expected = torch.tensor([4.0 ** 0.5 / 1.0 ** 0.5, 9.0 ** 0.5 / 2.0 ** 0.5, (1e-5) ** 0.5 / (1e-5) ** 0.5])
    assert torch.allclose(s, expected)
    assert torch.allclose(smoothing_scales(ranges, weight, 1.0)[:2], ranges[:2])


def test_observed_ranges_are_the_largest_inputs_and_hooks_go_away():
    a, b = nn.Linear(4, 3), nn.Linear(3, 2)
    inputs = [torch.tensor([[1.0, -5.0, 2.0, 0.0]]), torch.tensor([[-3.0, 1.0, 0.5, 0.25], [0.0, 0.0, -7.0, 0.0]])]

    def run(i):
        b(a(inputs[i[0]]))

    ranges = observe_input_ranges({"a": a, "b": b}, run, [[0], [1]])
    assert torch.equal(ranges["a"], torch.tensor([3.0, 5.0, 7.0, 0.25]))
    assert ranges["b"].shape == (3,)
    assert not a._forward_pre_hooks and not b._forward_pre_hooks

    def boom(_):
        raise RuntimeError("forward failed")

    with pytest.raises(RuntimeError):
        observe_input_ranges({"a": a}, boom, [[0]])
    assert not a._forward_pre_hooks


def test_calibration_chunks_cut_at_the_budget():
    assert calibration_chunks(list(range(10)), 7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert calibration_chunks(list(range(4)), 100, 3) == [[0, 1, 2], [3]]


def test_a_pipeline_calibrates_before_quantizing(cpu_config, tiny_model, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("The river runs past the old mill, and the baker opens her shop at dawn. " * 8)
    llm = LLM(cpu_config(tiny_model("llama"), quant={"name": "w8a8", "options": {
        "smoothquant_alpha": 0.5, "calibration_text": str(text), "calibration_tokens": 64}}))
    layer = llm.pipeline.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, W8A8Linear) and layer.mlp.down_proj.inv_smooth is not None
    assert llm.pipeline.runner.model is llm.pipeline.model
    assert not any(m._forward_pre_hooks for m in llm.pipeline.model.modules())
    plain = LLM(cpu_config(tiny_model("llama"), quant={"name": "w8a8"}))
    assert plain.pipeline.model.model.layers[0].mlp.down_proj.inv_smooth is None
    assert len(llm.generate([[5, 6, 7, 8]], {"max_tokens": 4, "ignore_eos": True})[0].token_ids) == 4


def test_smoothing_without_calibration_or_text_is_a_clear_error(tmp_path):
    quantizer = W8A8Quantizer(W8A8Options(smoothquant_alpha=0.5), torch.device("cpu"), torch.float32)
    with pytest.raises(ConfigError, match="needs calibrate"):
        quantizer.apply(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="is not a file; give a UTF-8 text file or null"):
        W8A8Options(smoothquant_alpha=0.5, calibration_text=str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError):
        W8A8Options(smoothquant_alpha=1.5)


def test_an_unreadable_calibration_text_is_one_line(cpu_config, tiny_model, tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 ".encode("latin-1") * 40)
    with pytest.raises(ConfigError, match="cannot be read as UTF-8 text"):
        LLM(cpu_config(tiny_model("llama"), quant={"name": "w8a8", "options": {
            "smoothquant_alpha": 0.5, "calibration_text": str(bad)}}))


# ---------------------------------------------------------------------- the CPU's few-rows path


def _quantized(monkeypatch, vnni: bool, **options) -> nn.Module:
    import tessellm.plugins.quant.int8.w8a8 as w8a8

    monkeypatch.setattr(w8a8, "int8_dot_products", lambda: vnni)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32))
    quantizer = W8A8Quantizer(W8A8Options(**options), torch.device("cpu"), torch.float32)
    return quantizer.apply(nn.ModuleDict({"layers": model}))


@pytest.mark.parametrize("vnni", [True, False], ids=["avx512-vnni", "avx2-only"])
def test_the_few_rows_path_follows_the_cpus_int8_products(monkeypatch, vnni):
    """With AVX-512 VNNI the int8 product serves every size; without it (an AVX2-only CPU,
    or ATEN_CPU_CAPABILITY=avx2) a few rows take the fastest weight-only path, whose result is
    the float product with the int8 weights, and more rows still the int8 product."""
    layers = [m for m in _quantized(monkeypatch, vnni).modules() if isinstance(m, W8A8Linear)]
    kinds = {m.small_kernel for m in layers}
    assert len(kinds) == 1 and (kinds == {"int_mm"}) == vnni
    layer = layers[0]
    for rows, few in ((3, True), (9, False)):
        x = torch.randn(rows, layer.in_features)
        weight_only = x @ (layer.weight_int8.float() * layer.scale[:, None]).T
        exact = reference_w8a8(x, layer.weight_int8, layer.scale).float()
        want = weight_only if (few and not vnni) else exact
        torch.testing.assert_close(layer.matmul(x), want, rtol=1e-4, atol=1e-4)


def test_the_few_rows_path_can_be_named(monkeypatch):
    layers = [m for m in _quantized(monkeypatch, True, cpu_kernel="tiled", small_batch_rows=2).modules()
              if isinstance(m, W8A8Linear)]
    assert {(m.small_kernel, m.small_batch_rows) for m in layers} == {("tiled", 2)}
