"""`int4-weight`: packing, the quantization error bound (short last groups included), each
matmul path (tiled, torch's CPU int4 kernel, Triton: compiled on a GPU, interpreted on a CPU)
against the float64 matmul of the dequantized weight, the quantizer's choices and refusals,
and a pipeline that runs it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tessellm import LLM
from tessellm.core.errors import ConfigError
from tessellm.plugins.quant.int4 import cpu
from tessellm.plugins.quant.int4.linear import Int4WeightLinear
from tessellm.plugins.quant.int4.quantize import (dequantize_int4, group_columns, pack_nibbles, quantize_int4,
                                                  reference_matmul, unpack_nibbles)
from tessellm.plugins.quant.int4.weight_only import Int4WeightOptions, Int4WeightQuantizer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@st.composite
def weights(draw, groups=(32, 64, 128), ragged=True, n_multiple=1):
    """A random weight [N, K] (K even) with outlier channels, and a group size that divides K
    or (``ragged``) leaves a shorter last group."""
    group = draw(st.sampled_from(groups))
    n = n_multiple * draw(st.integers(1, 40 // n_multiple or 1))
    k = group * draw(st.integers(1, 3)) + (2 * draw(st.integers(0, group // 2 - 1)) if ragged else 0)
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[torch.randint(0, n, (max(1, n // 8),), generator=g)] *= 30.0
    w[:, torch.randint(0, k, (max(1, k // 16),), generator=g)] *= 10.0
    return w, group, seed


@given(st.integers(1, 9), st.integers(1, 40), st.integers(0, 2**16))
def test_packing_round_trips(n, half_k, seed):
    q = torch.randint(0, 16, (n, 2 * half_k), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert packed.shape == (n, half_k) and packed.dtype == torch.uint8
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)  # even index in the low nibble
    assert torch.equal(unpack_nibbles(packed), q)


@given(weights())
def test_quantize_dequantize_error_is_at_most_half_a_step(case):
    w, group, _ = case
    int4 = quantize_int4(w, group)
    groups = -(-w.shape[1] // group)
    assert int4.scale.shape == int4.offset.shape == (w.shape[0], groups)
    steps = group_columns(int4.scale, group, w.shape[1])
    error = (dequantize_int4(int4) - w).abs()
    assert bool((error <= steps / 2 * (1 + 1e-4) + 1e-7).all())


def matmul_bound(x: torch.Tensor, int4, rel: float, offsets: bool = False) -> torch.Tensor:
    """Rounding room for x @ W.T: ``rel`` of the sum of absolute products; with ``offsets``,
    of products with |W| + 16 scales + |offset| too (a kernel that rounds (q - 8) * s and
    its offset + 8 s apart errs in proportion to those, not to W)."""
    w = dequantize_int4(int4, torch.float64).abs()
    if offsets:
        k = int4.in_features
        w = w + group_columns(16 * int4.scale.double() + int4.offset.double().abs(), int4.group_size, k)
    return (x.double().abs() @ w.T) * rel + 1e-6


@given(case=weights(), rows=st.integers(1, 9))
def test_the_tiled_path_matches_the_float64_reference(case, rows):
    w, group, seed = case
    int4 = quantize_int4(w, group)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(seed + 1))
    out = cpu.tiled_matmul(x, int4)
    assert out.shape == (rows, w.shape[0]) and out.dtype == x.dtype
    assert bool(((out.double() - reference_matmul(x, int4)).abs() <= matmul_bound(x, int4, 2e-6)).all())


@settings(max_examples=15)
@given(case=weights(n_multiple=16), rows=st.integers(1, 9))
def test_torch_int4pack_matches_the_reference_in_bfloat16(case, rows):
    """torch's CPU int4 kernel rounds activations and scales to bfloat16: within a few of its
    roundings of the sum of absolute products; a short last group padded to a whole one."""
    w, group, seed = case
    int4 = quantize_int4(w, group)
    assert cpu.int4pack_unfit(w.shape[0], w.shape[1], group) is None
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(seed + 1))
    out = cpu.int4pack_matmul(x, cpu.to_int4pack(int4))
    assert out.dtype == x.dtype
    bound = matmul_bound(x, int4, 2 ** -7, offsets=True)
    assert bool(((out.double() - reference_matmul(x, int4)).abs() <= bound).all())


def test_int4pack_says_which_layers_it_cannot_take():
    assert cpu.int4pack_unfit(24, 64, 32) == "out_features 24 is not a multiple of 16"
    assert cpu.int4pack_unfit(32, 96, 16) is not None and cpu.int4pack_unfit(32, 128, 64) is None


@settings(max_examples=5)
@given(case=weights(groups=(32, 64)), rows=st.sampled_from([1, 3, 17]), splits=st.sampled_from([None, 1, 3]))
def test_the_triton_kernel_matches_the_reference(case, rows, splits):
    """Compiled on a GPU, under the interpreter on a CPU (conftest sets TRITON_INTERPRET=1
    without a GPU); K split as the device would, or one or three ways. The kernel factors each
    group's scale and offset out of its tile (scale * x.q + offset * sum x), so its rounding
    scales with |q| scale + |offset|, not with |w|. Tensors of a few kilobytes and a kernel
    that spills nothing: no launch needs memory beyond its arguments (the H200's run beside
    ten workers and a model server ran out at launch)."""
    from tessellm.plugins.quant.int4.triton_matmul import triton_int4_weight_matmul

    w, group, seed = case
    int4 = quantize_int4(w, group)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(seed + 1))
    out = triton_int4_weight_matmul(x.to(DEVICE), int4.packed.to(DEVICE), int4.scale.to(DEVICE),
                                    int4.offset.to(DEVICE), group, splits=splits).cpu()
    assert out.shape == (rows, w.shape[0])
    assert bool(((out.double() - reference_matmul(x, int4)).abs() <= matmul_bound(x, int4, 2e-5, offsets=True)).all())


def _model(out_features=(32, 32), in_features=64) -> torch.nn.Module:
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(in_features, out_features[0], bias=True)
            self.down = torch.nn.Linear(out_features[0], out_features[1], bias=False)
            self.lm_head = torch.nn.Linear(out_features[1], 8, bias=False)
    return Tiny()


def _quantizer(**options) -> Int4WeightQuantizer:
    return Int4WeightQuantizer(Int4WeightOptions(**options), torch.device("cpu"), torch.float32)


def test_the_quantizer_replaces_linears_and_keeps_lm_head_and_bias():
    model = _model()
    x = torch.randn(5, 64)
    float_up = model.up(x)
    _quantizer(group_size=32).apply(model)
    assert isinstance(model.up, Int4WeightLinear) and isinstance(model.down, Int4WeightLinear)
    assert type(model.lm_head) is torch.nn.Linear
    assert (model.up(x) - float_up).abs().max() < 0.1 * float_up.abs().max()
    packed = _quantizer(group_size=32, cpu_kernel="int4pack").apply(_model())
    assert packed.up.int4pack_weight is not None  # 32 x 64 in groups of 32 fits torch's kernel
    assert packed.up.few_rows == ((128, "int4pack"),)


def test_auto_keeps_a_measured_kernel_per_range_of_rows_where_each_layer_fits_it():
    """auto times the kernels a layer fits at 1, 4, 16, 64 and small_batch_rows rows: each
    range of rows gets one kernel, and torch's packed copy stays only where a range runs it."""
    model = _quantizer(group_size=32).apply(_model(out_features=(32, 32)))
    table = model.up.few_rows
    assert table and table[-1][0] == 128 and [rows for rows, _ in table] == sorted({rows for rows, _ in table})
    assert all(kernel in Int4WeightLinear.SMALL_KERNELS for _, kernel in table) and model.down.few_rows == table
    assert (model.up.int4pack_weight is not None) == any(kernel == "int4pack" for _, kernel in table)
    x = torch.randn(70, 64)
    for rows in (1, 3, 9, 70):  # every range's kernel computes the product, up to its arithmetic
        torch.testing.assert_close(model.up(x[:rows]).double(), reference_matmul(x[:rows], model.up.int4, model.up.bias),
                                   rtol=0.02, atol=0.02)


def test_auto_runs_each_layer_on_kernels_it_fits_and_int4pack_named_refuses():
    model = _quantizer(group_size=32).apply(_model(out_features=(24, 32)))
    assert model.up.int4pack_weight is None and all(k != "int4pack" for _, k in model.up.few_rows)  # 24 out
    assert all(k != "int8-dot" for _, k in model.down.few_rows)  # 24 in: not whole blocks of 32
    with pytest.raises(ConfigError, match=r"cannot run up \(out_features 24 is not a multiple of 16\)"):
        _quantizer(group_size=32, cpu_kernel="int4pack").apply(_model(out_features=(24, 32)))
    with pytest.raises(ConfigError, match=r"'int8-dot' cannot run down \(in_features 24 .* multiples of 32\)"):
        _quantizer(group_size=32, cpu_kernel="int8-dot").apply(_model(out_features=(24, 32)))
    tiled = _quantizer(cpu_kernel="tiled").apply(_model())
    assert tiled.up.int4pack_weight is None and tiled.up.few_rows == ((128, "tiled"),)


def test_odd_in_features_and_bad_options_are_refused():
    with pytest.raises(ConfigError, match="odd in_features"):
        _quantizer().apply(_model(in_features=63))
    with pytest.raises(ValueError):
        Int4WeightOptions(group_size=48)


@pytest.mark.parametrize("cpu_kernel", ["auto", "tiled", "int8-dot"])
def test_a_pipeline_runs_it_by_config(cpu_config, tiny_model, cpu_kernel):
    llm = LLM(cpu_config(tiny_model("llama"), quant={"name": "int4-weight",
                                                     "options": {"group_size": 32, "cpu_kernel": cpu_kernel}}))
    assert llm.pipeline.resolved.choices["quant"].entry.name == "int4-weight"
    assert isinstance(llm.pipeline.model.model.layers[0].mlp.down_proj, Int4WeightLinear)
    out = llm.generate([[5, 6, 7, 8], [9, 10]], {"max_tokens": 4, "ignore_eos": True})
    assert [len(o.token_ids) for o in out] == [4, 4]


def test_bench_counts_the_packed_weight_bytes():
    """`tessellm bench`'s weight_bytes: an int4 linear holds half a byte a weight, plus its
    scales and offsets (and torch's CPU layout beside it where that kernel runs)."""
    from tessellm.bench.offline import weight_bytes

    model = _model(out_features=(256, 256), in_features=256)
    float_bytes = weight_bytes(model)
    tiled = weight_bytes(_quantizer(group_size=64, cpu_kernel="tiled").apply(_model((256, 256), 256)))
    linear_bytes = 4 * (256 * 256 * 2 + 256) + 8 * 256 * 4  # up (with bias), down in float32; lm_head
    assert float_bytes == linear_bytes
    # packed nibbles + scale and offset per group of 64 (float32) + the float bias and lm_head
    assert tiled == 2 * (256 * 128 + 2 * 256 * 4 * 4) + 256 * 4 + 8 * 256 * 4
