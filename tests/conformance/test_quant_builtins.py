"""The quant conformance suite on every built-in quantizer: none; int8-weight per channel (its
compiled decode kernel) and in groups with lm_head (its tiled path); w8a8 with lm_head, and
with SmoothQuant calibrated on text like the suite's prompts; int4-weight at groups 64 (torch's
int4 kernel), 32 with lm_head (the tiled path) and 128 (a group wider than the tiny model's
layers); int4-weight and int8-weight on the int8 dot-product kernel (int8 activations, held to
the float64 reference of that arithmetic); fp8 per channel, in blocks with lm_head, and with
e4m3 activations (scaled_mm); then each quantizer's CUDA kernels named (Triton interpreted; the
torch.compile'd ones extended)."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest

from tessellm.testing.conformance import QuantConformance

# The suite's tiny model reads words t0..t511 and its prompts are random ids from 3 up, so the
# calibration text is random words of the same kind: SmoothQuant's scales only hold for
# activations like the ones they were calibrated on.
_rng = random.Random(0)
CALIBRATION_TEXT = Path(tempfile.mkdtemp(prefix="tessellm-calibration-")) / "random-words.txt"
CALIBRATION_TEXT.write_text(" ".join(f"t{_rng.randrange(3, 512)}" for _ in range(512)))


class TestNone(QuantConformance):
    plugin = "none"


class TestInt8Weight(QuantConformance):
    plugin = "int8-weight"


class TestInt8WeightGrouped(QuantConformance):
    plugin = "int8-weight"
    options = {"group_size": 32, "quantize_lm_head": True, "compile": False}


class TestW8A8(QuantConformance):
    plugin = "w8a8"
    options = {"quantize_lm_head": True}


class TestW8A8SmoothQuant(QuantConformance):
    plugin = "w8a8"
    options = {"smoothquant_alpha": 0.5, "calibration_text": str(CALIBRATION_TEXT), "calibration_tokens": 512}


class TestInt4Weight(QuantConformance):
    plugin = "int4-weight"


class TestInt4WeightGroup32Tiled(QuantConformance):
    plugin = "int4-weight"
    options = {"group_size": 32, "cpu_kernel": "tiled", "quantize_lm_head": True}


class TestInt4WeightGroup128(QuantConformance):
    plugin = "int4-weight"
    options = {"group_size": 128}


class TestFp8Channel(QuantConformance):
    plugin = "fp8"


class TestFp8Block(QuantConformance):
    plugin = "fp8"
    options = {"granularity": "block", "block_size": 32, "quantize_lm_head": True}


class TestFp8ScaledMm(QuantConformance):
    plugin = "fp8"
    options = {"matmul": "scaled_mm"}  # FP8 tensor cores' arithmetic, through torch's CPU kernel here


needs_int8_dot = pytest.mark.usefixtures("int8_dot_kernels")


@needs_int8_dot
class TestInt4WeightInt8Dot(QuantConformance):
    plugin = "int4-weight"
    options = {"group_size": 32, "cpu_kernel": "int8-dot", "quantize_lm_head": True, "int8_dot_digits": 1}


@needs_int8_dot
class TestInt8WeightInt8Dot(QuantConformance):
    plugin = "int8-weight"
    options = {"cpu_kernel": "int8-dot", "group_size": 32}


# Each quantizer's kernels named through the whole model (the CUDA ones run here as they can:
# the Triton kernels interpreted, the compiled ones through Inductor's CPU code). Interpreted
# or compiled on a CPU each class takes one to several minutes: extended (`make test-all`;
# the GPU's quant stage runs them compiled). tests/plugins/quant/test_kernel_variants.py holds
# every kernel to the float64 product by default.

@pytest.mark.extended
class TestInt8WeightTriton(QuantConformance):
    plugin = "int8-weight"
    options = {"kernel": "triton"}


@pytest.mark.extended
class TestInt4WeightTriton(QuantConformance):
    plugin = "int4-weight"
    options = {"kernel": "triton", "group_size": 32}


@pytest.mark.extended
class TestW8A8Triton(QuantConformance):
    plugin = "w8a8"
    options = {"kernel": "triton"}


@pytest.mark.extended
class TestFp8Triton(QuantConformance):
    plugin = "fp8"
    options = {"matmul": "triton"}


@pytest.mark.extended
class TestInt4WeightCompiled(QuantConformance):
    plugin = "int4-weight"
    options = {"kernel": "compiled", "group_size": 32}


@pytest.mark.extended
class TestW8A8IntMmCompiled(QuantConformance):
    plugin = "w8a8"
    options = {"kernel": "int_mm_compiled"}


@pytest.mark.extended
class TestFp8Compiled(QuantConformance):
    plugin = "fp8"
    options = {"matmul": "compiled"}
