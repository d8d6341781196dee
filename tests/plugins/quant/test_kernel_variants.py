"""Every kernel a quantized layer can name (the ``kernel`` option, fp8's ``matmul``) against
the float64 product of the operands it reads, on random shapes with outlier channels and
row counts from decode to prefill: the Triton kernels (compiled on a GPU, interpreted on the
CPU), the ``torch.compile``d reductions (Inductor's CPU or GPU code), torch's own kernels
where this device's build has them (tinygemm: CUDA only). Then the table ``auto`` reads on
CUDA: its checks, the nearest shape, the fallback for a kernel a layer cannot run, and the
refusals of a named kernel a device or a layer cannot run."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st
from torch import nn

from tessellm.core.errors import ConfigError
from tessellm.plugins.quant.fp8.linear import Fp8Linear, dequantize_fp8, quantize_fp8, reference_rows_fp8
from tessellm.plugins.quant.int4.linear import Int4WeightLinear
from tessellm.plugins.quant.int4.quantize import dequantize_int4, group_columns, quantize_int4
from tessellm.plugins.quant.int8.linear import Int8WeightLinear
from tessellm.plugins.quant.int8.quantize import dequantize, reference_matmul
from tessellm.plugins.quant.int8.w8a8 import W8A8Linear, reference_w8a8
from tessellm.plugins.quant.kernel_table import (DEFAULT_TABLE, KernelChoice, RowDispatch, check_named, choose,
                                                 nearest_shape, read_table)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# torch.compile's kernels build for tens of seconds each on a CPU: their tests are extended
# (`make test-all`, and the GPU's quant stage, run them); int8's compiled reduction has its
# default test in test_int8_weight.py
COMPILED = pytest.param("compiled", marks=pytest.mark.extended)
ON_DEVICE = {  # the kernels each quantizer's layer runs here
    "int8-weight": ["triton", "int8pack", COMPILED, "tiled"],
    "int4-weight": ["triton", COMPILED, "tiled"] + (["tinygemm"] if CUDA else ["int4pack"]),
    "w8a8": ["int_mm", pytest.param("int_mm_compiled", marks=pytest.mark.extended), "triton", "triton_weight_only"],
    "fp8": ["scaled_mm", "dequantize", "triton", COMPILED],
}


@st.composite
def layers(draw, multiple: int = 16):
    """A random [N, K] weight with outlier channels (sizes multiples of ``multiple``, as
    torch's kernels need), a row count from decode to a small prefill, and a seed."""
    n = multiple * draw(st.integers(1, 6))
    k = 64 * draw(st.integers(1, 4))
    rows = draw(st.sampled_from([1, 3, 16, 17, 40]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[torch.randint(0, n, (max(1, n // 8),), generator=g)] *= 30.0
    w[:, torch.randint(0, k, (max(1, k // 16),), generator=g)] *= 10.0
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
    return w, x


def _named(quantizer: str, kernel: str) -> KernelChoice:
    return KernelChoice(quantizer, kernel)


def _run(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return layer.to(DEVICE)(x.to(DEVICE)).cpu()


def _within(out: torch.Tensor, expected: torch.Tensor, room: torch.Tensor) -> None:
    excess = ((out.double() - expected).abs() / room).max().item()
    assert excess <= 1, f"error {excess:.2f}x the rounding room"


@pytest.mark.parametrize("kernel", ON_DEVICE["int8-weight"])
@settings(max_examples=6, deadline=None)
@given(case=layers(), group=st.sampled_from([None, 32, 64]))
def test_int8_weight_kernels_match_the_float64_product(kernel, case, group):
    w, x = case
    if kernel == "int8pack" and group is not None:
        group = None  # per-channel scales only
    layer = Int8WeightLinear(nn.Linear(w.shape[1], w.shape[0], bias=False), group, 0, True, _named("int8-weight", kernel))
    layer.weight_int8.copy_(layer.weight_int8)  # the layer quantized its own random weight: use that
    q, scale = layer.weight_int8, layer.scale
    out = _run(layer, x)
    room = (x.double().abs() @ dequantize(q, scale).double().abs().T) * 2e-5 + 1e-6
    _within(out, reference_matmul(x, q, scale), room)


@pytest.mark.parametrize("kernel", ON_DEVICE["int4-weight"])
@settings(max_examples=6, deadline=None)
@given(case=layers(), group=st.sampled_from([32, 64, 128]))
def test_int4_weight_kernels_match_the_float64_product(kernel, case, group):
    """torch's int4 kernels compute in bfloat16 (activations, scales and zeros rounded to it):
    a few of its roundings of the products' magnitudes, offsets included; the rest, float32's."""
    w, x = case
    int4 = quantize_int4(w, group)
    layer = Int4WeightLinear(int4, w.shape[0], None, use_int4pack=kernel == "int4pack", small_batch_rows=0,
                             kernel_choice=_named("int4-weight", kernel))
    assume(layer.unfit(kernel) is None)  # e.g. compiled takes whole groups only
    out = _run(layer, x)
    magnitude = dequantize_int4(int4, torch.float64).abs() + \
        group_columns(16 * int4.scale.double() + int4.offset.double().abs(), group, w.shape[1])
    rel = 2 ** -7 if kernel in ("int4pack", "tinygemm") else 2e-5
    room = (x.double().abs() @ magnitude.T) * rel + 1e-6
    _within(out, x.double() @ dequantize_int4(int4, torch.float64).T, room)


@pytest.mark.parametrize("kernel", ON_DEVICE["w8a8"])
@settings(max_examples=6, deadline=None)
@given(case=layers(multiple=8))
def test_w8a8_kernels_match_the_float64_product(kernel, case):
    """The int8 x int8 kernels against the float64 product of the same per-token int8
    activations (exact int32 sums, then float32 scaling); the weight-only one against the
    float64 product with the activations as they are."""
    w, x = case
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    layer = W8A8Linear(linear, kernel_choice=_named("w8a8", kernel))
    q, scale = layer.weight_int8, layer.scale
    out = _run(layer, x)
    if kernel == "triton_weight_only":
        expected = reference_matmul(x, q, scale)
        room = (x.double().abs() @ dequantize(q, scale).double().abs().T) * 2e-5 + 1e-6
    else:
        expected = reference_w8a8(x, q, scale)
        room = expected.abs() * 2e-6 + 1e-6
    _within(out, expected, room)


@pytest.mark.parametrize("kernel", ON_DEVICE["fp8"])
@settings(max_examples=6, deadline=None)
@given(case=layers(), granularity=st.sampled_from(["tensor", "channel"]))
def test_fp8_kernels_match_the_float64_product(kernel, case, granularity):
    """Weight-only kernels against x @ the dequantized e4m3 weight; scaled_mm against the
    float64 product of the hand-rounded e4m3 activations too (bfloat16's rounding of the
    output on a GPU, whose accumulation test_fp8.py bounds)."""
    w, x = case
    q, scale = quantize_fp8(w, granularity)
    layer = Fp8Linear(q, scale, None, None, kernel_choice=_named("fp8", kernel))
    out = _run(layer, x)
    weight = dequantize_fp8(q, scale, None, torch.float64)
    if kernel == "scaled_mm":
        x_fp8, x_scale = reference_rows_fp8(x)
        a = x_fp8 * x_scale
        rel = 2 ** -7 if CUDA else 2e-6
    else:
        a, rel = x.double(), 2e-5
    _within(out, a @ weight.T, (a.abs() @ weight.abs().T) * rel + 1e-6)


@pytest.mark.extended
def test_the_compiled_reductions_match_on_one_shape():
    """Each ``torch.compile``d kernel once (3 rows, a 48 x 128 weight with outliers), against
    the float64 product of its operands."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g) * 0.05
    w[3] *= 30.0
    x = torch.randn(3, 128, generator=g)
    int4 = quantize_int4(w, 32)
    layer = Int4WeightLinear(int4, 48, None, use_int4pack=False, small_batch_rows=0,
                             kernel_choice=_named("int4-weight", "compiled"))
    expected = x.double() @ dequantize_int4(int4, torch.float64).T
    _within(_run(layer, x), expected, (x.double().abs() @ dequantize_int4(int4, torch.float64).abs().T) * 2e-5 + 1e-6)
    q, scale = quantize_fp8(w, "channel")
    weight = dequantize_fp8(q, scale, None, torch.float64)
    layer = Fp8Linear(q, scale, None, None, kernel_choice=_named("fp8", "compiled"))
    _within(_run(layer, x), x.double() @ weight.T, (x.double().abs() @ weight.abs().T) * 2e-5 + 1e-6)
    linear = nn.Linear(128, 48, bias=False)
    layer = W8A8Linear(linear, kernel_choice=_named("w8a8", "int_mm_compiled"))
    expected = reference_w8a8(x, layer.weight_int8, layer.scale)
    _within(_run(layer, x), expected, expected.abs() * 2e-6 + 1e-6)


# ------------------------------------------------------------------------- the table auto reads


def test_the_default_table_names_only_kernels_each_quantizer_has():
    table = read_table()
    assert table["measured"] in (True, False)
    kernels = {"int8-weight": Int8WeightLinear.KERNELS, "int4-weight": Int4WeightLinear.KERNELS,
               "w8a8": W8A8Linear.KERNELS, "fp8": Fp8Linear.KERNELS}
    for quantizer, shapes in table["kernels"].items():
        for steps in shapes.values():
            assert [rows for rows, _ in steps] == sorted(rows for rows, _ in steps)
            assert {kernel for _, kernel in steps} <= set(kernels[quantizer]), quantizer


def test_a_layer_takes_the_nearest_shape_and_each_row_count_its_step():
    table = {"kernels": {"int8-weight": {"2048x8192": [[1, "compiled"], [64, "triton"], [1024, "tiled"]],
                                         "16384x2048": [[16, "int8pack"], [4096, "tiled"]]}}}
    choice = KernelChoice("int8-weight", None, table)
    down = choice.cuda_dispatch(4096, 14336, lambda k: None, "triton")  # nearer 2048x8192 in log2
    assert [down.pick(r) for r in (1, 2, 64, 65, 1024, 5000)] == ["compiled", "triton", "triton", "tiled", "tiled",
                                                                 "tiled"]
    up = choice.cuda_dispatch(28672, 4096, lambda k: "no" if k == "int8pack" else None, "triton")
    assert up.steps == ((16, "triton"), (4096, "tiled"))  # int8pack unfit: the fallback
    assert nearest_shape(["2048x8192", "16384x2048"], 16384, 2048) == "16384x2048"
    assert KernelChoice("w8a8", None, table).cuda_dispatch(8, 8, lambda k: None, "triton") == \
        RowDispatch(((1 << 62, "triton"),))  # nothing measured for w8a8: the fallback
    assert KernelChoice("fp8", "compiled").cuda_dispatch(8, 8, lambda k: None, "x").pick(7) == "compiled"


def test_a_bad_table_is_refused_by_name(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match=r"t\.json' cannot be read as JSON"):
        read_table(bad)
    bad.write_text(json.dumps({"kernels": {"int8-weight": {"big": [[1, "triton"]]}}}))
    with pytest.raises(ConfigError, match=r"'int8-weight' entry 'big' must map 'NxK' shapes"):
        read_table(bad)
    bad.write_text(json.dumps({"kernels": {"fp8": {"16x16": []}}}))
    with pytest.raises(ConfigError, match="must map"):
        read_table(bad)
    assert read_table(DEFAULT_TABLE)["kernels"]


def test_named_kernels_a_device_or_layer_cannot_run_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="'triton' is a Triton kernel: it needs CUDA"):
        choose("int8-weight", "triton", None, torch.device("cpu"), triton_kernels=("triton",))
    with pytest.raises(ConfigError, match="quant.options.kernel 'tinygemm' runs on CUDA only"):
        choose("int4-weight", "tinygemm", None, torch.device("cpu"), cuda_kernels=("tinygemm",))
    assert choose("int8-weight", "tiled", None, torch.device("cpu")).named == "tiled"
    with pytest.raises(ConfigError, match=r"kernel 'int8pack' cannot run layer\.a: int8pack takes per-channel"):
        layer = Int8WeightLinear(nn.Linear(64, 16), 32, 0, True, _named("int8-weight", "int8pack"))
        check_named("int8pack", "layer.a", layer.unfit, Int8WeightLinear.KERNELS)


def test_a_quantizer_names_its_kernel_through_a_pipeline(cpu_config, tiny_model):
    """The ``kernel`` option reaches every layer; int4 ``compiled`` refuses a model whose
    layers do not divide into its groups; a kernel table path that is not a table fails the
    load by name."""
    from tessellm import LLM

    llm = LLM(cpu_config(tiny_model("llama"), quant={"name": "int8-weight", "options": {"kernel": "tiled"}}))
    assert llm.pipeline.model.model.layers[0].mlp.down_proj.kernel_choice.named == "tiled"
    out = llm.generate([[5, 6, 7]], {"max_tokens": 3, "ignore_eos": True})
    assert len(out[0].token_ids) == 3
    with pytest.raises(ConfigError, match="cannot be read as JSON"):
        LLM(cpu_config(tiny_model("llama"), quant={"name": "w8a8", "options": {"kernel_table": __file__}}))
