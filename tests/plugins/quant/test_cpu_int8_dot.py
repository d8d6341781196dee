"""The CPU int8 dot-product kernels (plugins/quant/cpu): the activations' int8 blocks equal
the torch reference's bit for bit, each product equals its float64 reference of the same
int8 x int4 / int8 x int8 arithmetic within float32 rounding, bad shapes are refused by name,
the layers and quantizers run them where named or measured fastest, and without a compiler
everything falls back to torch's kernels with one log line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, strategies as st

from tessellm.core.errors import ConfigError
from tessellm.plugins.quant.cpu import int8_dot
from tessellm.plugins.quant.cpu.build import kernels
from tessellm.plugins.quant.int4.quantize import quantize_int4, reference_matmul, unpack_nibbles
from tessellm.plugins.quant.int8.quantize import quantize_per_channel

needs_kernels = pytest.mark.usefixtures("int8_dot_kernels")
"""Tests of the compiled kernel itself; the fallback tests below run everywhere."""

EPS = 2.0 ** -23
"""float32's relative spacing. The integer sums are exact; what rounds is a few float32
operations a block (int32 to float above 2^24 with two digits, a scale product, the
multiply-add into the row's accumulator) and the offsets' sums, each at most a few EPS of the
sum of the terms' magnitudes."""


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows with outlier channels, an all-zero block and exact ties (x * 127 / max on .5)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, torch.randint(0, k, (max(1, k // 32),), generator=g)] *= 25.0
    if k >= 64:
        x[0, 32:64] = 0.0
        x[-1, :4] = torch.tensor([127.0, 0.5, -1.5, 2.5])  # block max 127: 0.5 and 2.5 are ties
    return x


def assert_matches(y: torch.Tensor, reference: torch.Tensor, x: torch.Tensor, weight_magnitude: torch.Tensor
                   ) -> None:
    """y within float32 rounding of its float64 reference: (blocks + 8) EPS of the sum of the
    terms' magnitudes |x| @ weight_magnitude.T (an output that cancels to near zero rounds
    as its terms did, not as its own size)."""
    assert y.dtype == torch.float32 and y.shape == reference.shape
    magnitude = x.double().abs() @ weight_magnitude.double().T
    tolerance = (x.shape[1] // 32 + 8) * EPS * magnitude + 1e-30
    excess = ((y.double() - reference).abs() - tolerance).max()
    assert excess <= 0, f"off its float64 reference by {excess:.3g} beyond float32 rounding"


def int4_magnitude(qw: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int) -> torch.Tensor:
    """|(qw - 8) scale| + |offset + 8 scale| channel by channel: the size of each weight's terms."""
    per_channel = torch.arange(qw.shape[1]) // group
    s, o = scale.double()[:, per_channel], offset.double()[:, per_channel]
    return (qw.double() - 8).abs() * s + (o + 8 * s).abs()


@needs_kernels
@given(m=st.integers(1, 6), blocks=st.integers(1, 20), digits=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_activation_digits_equal_the_torch_reference_bit_for_bit(int8_dot_kernels, m, blocks, digits, seed):
    x = activations(m, 32 * blocks, seed)
    q1, q2, d, sums = int8_dot_kernels.ops.quantize_rows(x, False, digits)
    q1_ref, q2_ref, d_ref = int8_dot.quantize_blocks(x, digits)
    assert torch.equal(q1, q1_ref) and torch.equal(d, d_ref)
    assert (q2_ref is None and torch.equal(q2, q1)) or (torch.equal(q2, q2_ref) and int(q2.abs().max()) <= 64)
    torch.testing.assert_close(sums.double(), x.double().view(m, blocks, 32).sum(-1), rtol=1e-6, atol=1e-5)
    order = int4_order(blocks)
    interleaved1, interleaved2, _, _ = int8_dot_kernels.ops.quantize_rows(x, True, digits)
    assert torch.equal(interleaved1, q1_ref[:, order])
    assert q2_ref is None or torch.equal(interleaved2, q2_ref[:, order])


def int4_order(blocks: int) -> torch.Tensor:
    """The channel order the int4 kernel reads activations in: blocks in pairs, [evens of b,
    evens of b + 1, odds of b, odds of b + 1], an unpaired last block [evens, odds]."""
    parts = []
    for b in range(0, blocks - 1, 2):
        parts += [torch.arange(32 * b, 32 * b + 32, 2), torch.arange(32 * b + 32, 32 * b + 64, 2),
                  torch.arange(32 * b + 1, 32 * b + 32, 2), torch.arange(32 * b + 33, 32 * b + 64, 2)]
    if blocks % 2:
        b = blocks - 1
        parts += [torch.arange(32 * b, 32 * b + 32, 2), torch.arange(32 * b + 1, 32 * b + 32, 2)]
    return torch.cat(parts)


@needs_kernels
@given(m=st.integers(1, 9), n=st.integers(1, 70), blocks=st.integers(1, 24), group=st.sampled_from([32, 64, 128, 256]),
       digits=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_int4_product_equals_its_float64_reference(m, n, blocks, group, digits, seed):
    k = 32 * blocks  # a group that does not divide K leaves a shorter last group
    x = activations(m, k, seed)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed + 1))
    weight = quantize_int4(w, group)
    y = int8_dot.int4_matmul(x, weight.packed, weight.scale, weight.offset, group, digits)
    qw = unpack_nibbles(weight.packed)
    assert_matches(y, int8_dot.reference_int4(x, qw, weight.scale, weight.offset, group, digits), x,
                   int4_magnitude(qw, weight.scale, weight.offset, group))


@needs_kernels
@given(m=st.integers(1, 9), n=st.integers(1, 70), blocks=st.integers(1, 24), grouped=st.booleans(),
       digits=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_int8_product_equals_its_float64_reference(m, n, blocks, grouped, digits, seed):
    k = 32 * blocks
    x = activations(m, k, seed)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed + 1))
    q, scale = quantize_per_channel(w, 32 if grouped else None)
    per_channel = scale.double()[:, torch.arange(k) // 32] if grouped else scale.double()[:, None]
    assert_matches(int8_dot.int8_matmul(x, q, scale, digits), int8_dot.reference_int8(x, q, scale, digits), x,
                   q.double().abs() * per_channel)


@needs_kernels
@pytest.mark.parametrize("digits, bound", [(1, 0.01), (2, 1e-4)])
def test_the_activations_digits_stay_near_the_float_product(digits, bound):
    """What int8 activations cost against float activations on the same int4 weight: under a
    percent with one digit (blocks of 32 keep an outlier channel's range to its own block),
    about 1e-5 with two."""
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(0))
    weight = quantize_int4(torch.randn(960, 576, generator=torch.Generator().manual_seed(1)), 32)
    exact = reference_matmul(x, weight)
    y = int8_dot.int4_matmul(x, weight.packed, weight.scale, weight.offset, 32, digits)
    assert float((y.double() - exact).norm() / exact.norm()) < bound


@needs_kernels
def test_bad_shapes_and_dtypes_are_refused_by_name():
    weight = quantize_int4(torch.randn(16, 64), 32)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        int8_dot.int4_matmul(torch.randn(2, 48), weight.packed[:, :24].contiguous(), weight.scale[:, :2].contiguous(),
                             weight.offset[:, :2].contiguous(), 32)
    with pytest.raises(RuntimeError, match="float32"):
        int8_dot.int4_matmul(torch.randn(2, 64, dtype=torch.float64), weight.packed, weight.scale, weight.offset, 32)
    with pytest.raises(RuntimeError, match="group a multiple of 32"):
        int8_dot.int4_matmul(torch.randn(2, 64), weight.packed, weight.scale, weight.offset, 16)
    with pytest.raises(RuntimeError, match="digits must be 1 or 2"):
        int8_dot.int4_matmul(torch.randn(2, 64), weight.packed, weight.scale, weight.offset, 32, 3)
    assert int8_dot.int4_unfit(16, 48, 32) and int8_dot.int4_unfit(16, 64, 32) is None


@needs_kernels
def test_the_kernels_run_inside_a_compiled_graph():
    weight = quantize_int4(torch.randn(48, 64), 32)

    def f(x):
        return int8_dot.int4_matmul(torch.nn.functional.silu(x), weight.packed, weight.scale, weight.offset, 32) * 2

    x = torch.randn(3, 64)
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(x), f(x))


def test_the_build_goes_to_the_cache_folder(tmp_path, monkeypatch):
    from tessellm.plugins.quant.cpu.build import build_dir

    monkeypatch.setenv("TESSELLM_CACHE_DIR", str(tmp_path))
    assert build_dir("k").parent == tmp_path / "cpu-kernels"


def test_turned_off_by_the_environment_the_quantizer_keeps_torchs_kernels(monkeypatch, caplog):
    from tessellm.plugins.quant.int4.weight_only import Int4WeightOptions, Int4WeightQuantizer

    monkeypatch.setenv("TESSELLM_CPU_KERNELS", "0")
    kernels.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert kernels() is None and kernels() is None
        assert [r.getMessage() for r in caplog.records if "int8 dot-product" in r.getMessage()] == [
            "tessellm CPU int8 dot-product kernels unavailable (TESSELLM_CPU_KERNELS=0); using torch's kernels"]
        model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
        options = {"group_size": 32}
        Int4WeightQuantizer(Int4WeightOptions(**options), torch.device("cpu"), torch.float32).apply(model)
        assert all(kernel != "int8-dot" for _, kernel in model[0].few_rows)
        with pytest.raises(ConfigError, match="cpu_kernel 'int8-dot' cannot run 0 .*not available here"):
            Int4WeightQuantizer(Int4WeightOptions(cpu_kernel="int8-dot", **options), torch.device("cpu"),
                                torch.float32).apply(torch.nn.Sequential(torch.nn.Linear(64, 32)))
    finally:
        monkeypatch.delenv("TESSELLM_CPU_KERNELS")
        kernels.cache_clear()


FALLBACK = textwrap.dedent("""
    import json, logging, torch
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from tessellm.plugins.quant.int4.weight_only import Int4WeightOptions, Int4WeightQuantizer
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(32, 64, bias=False))
    Int4WeightQuantizer(Int4WeightOptions(group_size=32), torch.device("cpu"), torch.float32).apply(model)
    y = model(torch.randn(2, 64))
    print(json.dumps({"finite": bool(torch.isfinite(y).all()), "kernels": [list(m.few_rows) for m in model]}))
""")


def test_a_failed_build_falls_back_with_one_log_line(monkeypatch, caplog):
    """What any failure to build or load does (no compiler, no ninja, a compile error): one
    warning naming it, kernels() None (the quantizers keep torch's kernels), the reason kept
    for the tests that skip."""
    from tessellm.plugins.quant.cpu import build

    def no_compiler():
        raise RuntimeError("Error building extension 'tessellm_int8_dot'\nc++: command not found")

    monkeypatch.setattr(build, "_load", no_compiler)
    kernels.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert kernels() is None and kernels() is None
        assert [r.getMessage() for r in caplog.records if "int8 dot-product" in r.getMessage()] == [
            "tessellm CPU int8 dot-product kernels unavailable (RuntimeError: c++: command not found); "
            "using torch's kernels"]
        assert build.why_unavailable == "RuntimeError: c++: command not found"
    finally:
        monkeypatch.undo()
        kernels.cache_clear()


@pytest.mark.extended
def test_without_a_compiler_the_quantizer_falls_back_with_one_log_line(tmp_path):
    """A machine without a C++ compiler (CXX names none) in a fresh cache folder: one warning
    line, the model quantizes and runs on torch's kernels."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TESSELLM_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    warnings = [line for line in run.stderr.splitlines() if "int8 dot-product kernels unavailable" in line]
    assert len(warnings) == 1, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["finite"] and all(kernel != "int8-dot" for table in result["kernels"] for _, kernel in table)


CAPPED = textwrap.dedent("""
    import sys, torch
    from tessellm.plugins.quant.cpu import int8_dot
    from tessellm.plugins.quant.cpu.build import kernels
    from tessellm.plugins.quant.int4.quantize import quantize_int4
    from tessellm.plugins.quant.int8.quantize import quantize_per_channel
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 160, generator=g) * torch.rand(160, generator=g) * 20
    w4 = quantize_int4(torch.randn(37, 160, generator=g), 32)
    q8, s8 = quantize_per_channel(torch.randn(37, 160, generator=g), 32)
    out = {"isa": kernels().isa}
    for digits in (1, 2):
        out[f"int4-{digits}"] = int8_dot.int4_matmul(x, w4.packed, w4.scale, w4.offset, 32, digits)
        out[f"int8-{digits}"] = int8_dot.int8_matmul(x, q8, s8, digits)
    torch.save(out, sys.argv[1])
""")


@needs_kernels
def test_each_instruction_set_variant_gives_the_same_products_bit_for_bit(tmp_path):
    """The CPUID dispatch with the better variants forced off (TESSELLM_CPU_ISA caps it): a
    process held to AVX2 gives the same products, bit for bit, as this process's variant
    (VNNI where the CPU has it): the integer sums are exact in each, the float part is the
    same code. On an AVX2-only CPU both sides run AVX2 and only the cap itself is checked."""
    path = tmp_path / "avx2.pt"
    run = subprocess.run([sys.executable, "-c", CAPPED, str(path)], env={**os.environ, "TESSELLM_CPU_ISA": "avx2"},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    capped = torch.load(path)
    assert capped.pop("isa") == "avx2"
    here = {}
    exec(compile(CAPPED.replace("torch.save(out, sys.argv[1])", ""), "capped", "exec"), here)
    assert here["out"].pop("isa") == kernels().isa
    for key, value in here["out"].items():
        assert torch.equal(value, capped[key]), f"{key}: {kernels().isa} differs from avx2"


def test_an_unknown_instruction_set_cap_is_named_with_the_allowed_ones(monkeypatch):
    from tessellm.plugins.quant.cpu.build import unavailable_reason

    monkeypatch.setenv("TESSELLM_CPU_ISA", "sse4")
    assert unavailable_reason() == "TESSELLM_CPU_ISA='sse4' is not one of avx2, avx-vnni, avx512-vnni"
