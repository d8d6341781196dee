"""`w8a8`: per-token activation quantization bounds, the int32 product against the float64
product of the dequantized operands, the layer's shapes and paths, and a pipeline."""

from __future__ import annotations

import torch
from hypothesis import given, strategies as st
from torch import nn

from tessellm import LLM
from tessellm.plugins.quant.int8.quantize import quantize_per_channel
from tessellm.plugins.quant.int8.w8a8 import (W8A8Linear, W8A8Options, W8A8Quantizer, quantize_per_token,
                                              reference_w8a8, w8a8_matmul)


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
