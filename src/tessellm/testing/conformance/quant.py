"""The quant plugin contract as properties: the quantized model's logits stay within the
relative error the plugin declares for its options (``Quantizer.error_bound(options)``,
by default ``max_relative_error``) of the float model's,
and every linear layer keeps its name, input and output shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

from tessellm.testing.conformance.base import ConformanceSuite, example_budget, property_settings, spread
from tessellm.testing.conformance.pipeline import build_llm, selection_context, sequence_capacity


def relative_error(quantized: torch.Tensor, reference: torch.Tensor) -> float:
    """||quantized - reference|| / ||reference|| (Frobenius norms, in float64)."""
    reference = reference.double()
    return float((quantized.double() - reference).norm() / reference.norm())


class QuantConformance(ConformanceSuite):
    """The contract every quant plugin honours, checked on the plugin named by ``plugin`` (or
    ``plugin_class``) with ``options``, applied to ``tessellm_tiny_model``:

    - forward error: for batches of random prompts, the quantized pipeline's logits are
      within the bound the plugin declares for ``options`` (``error_bound(options)``, by
      default its ``max_relative_error``) of the float pipeline's (the same
      config with quant ``none``), relative Frobenius norm over every position;
    - every ``nn.Linear`` of the float model is still at its name after ``apply``, and maps
      random inputs of shape [..., in_features] to finite outputs [..., out_features];
    - a quantized linear that states the arithmetic of its kernel for an input
      (``reference_forward(x)``: the float64 result of the same operations, e.g. int8
      activations times int4 weights summed exactly; None where it states none) equals it
      within float32 rounding: ``REFERENCE_ULPS`` of each row's largest |output|.

    ``engine`` holds the config pieces of both pipelines besides the model and the quantizer
    (device, dtype, ...). A pipeline the plugin declares unsupported skips with its
    ``unsupported_reasons``.
    """

    kind = "quant"
    engine: ClassVar[dict[str, Any]] = {"device": "cpu", "dtype": "float32"}
    REFERENCE_ULPS: ClassVar[float] = 1e-5

    @pytest.fixture(scope="class")
    @classmethod
    def quantized_llm(cls, tessellm_tiny_model: Path) -> Any:
        """The tiny model with the quantizer under test applied (built once)."""
        cls.require(selection_context(cls, tessellm_tiny_model, cls.engine), "this pipeline")
        return build_llm(cls, tessellm_tiny_model, cls.engine,
                         {"name": cls.under_test().name, "options": dict(cls.options)})

    @pytest.fixture(scope="class")
    @classmethod
    def float_llm(cls, tessellm_tiny_model: Path) -> Any:
        """The same pipeline without quantization: the reference."""
        from tessellm import LLM

        return LLM({"model": str(tessellm_tiny_model), **cls.engine, "quant": {"name": "none"}})

    @given(seed=st.integers(0, 2**31 - 1), lengths=st.lists(st.integers(1, 48), min_size=1, max_size=4))
    @property_settings(max_examples=10)
    def test_forward_error_within_the_declared_bound(self, quantized_llm: Any, float_llm: Any, seed: int,
                                                     lengths: list[int]) -> None:
        """Random prompts scored by both pipelines (teacher forcing): relative logits error
        at most the declared ``error_bound(options)``, and every logit finite."""
        self.case()
        bound = self.error_bound()
        vocab = float_llm.pipeline.spec.vocab_size
        capacity = min(sequence_capacity(quantized_llm), sequence_capacity(float_llm))
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(3, vocab, (min(n, capacity),), generator=g).tolist() for n in lengths]
        quantized = torch.cat([quantized_llm.engine.score(p) for p in prompts])
        reference = torch.cat([float_llm.engine.score(p) for p in prompts])
        assert torch.isfinite(quantized).all(), "the quantized model gave non-finite logits"
        error = relative_error(quantized, reference)
        assert error <= bound, (f"relative logits error {error:.4g} exceeds the bound {bound:.4g} declared for "
                                f"options {self.options} (error_bound) (prompt lengths {lengths})")

    @classmethod
    def error_bound(cls) -> float:
        """The bound the plugin declares for the suite's ``options``; a declared bound that is
        not a positive number fails here."""
        plugin, options = cls.under_test(), cls.plugin_options()
        declare = getattr(plugin, "error_bound", None)
        bound = declare(options) if declare is not None else plugin.max_relative_error
        if not isinstance(bound, (int, float)) or not bound > 0:
            pytest.fail(f"{cls.label()}: error_bound({options!r}) returned {bound!r}, not a positive number")
        return float(bound)

    def test_linears_keep_their_names_and_shapes(self, quantized_llm: Any, float_llm: Any) -> None:
        """Each linear of the float model, at the same name in the quantized model (replaced
        or not), maps [3, in] and [2, 5, in] random inputs to [3, out] and [2, 5, out]. One
        case a linear; under a profile of fewer examples, that many linears spread over the
        model."""
        quantized = quantized_llm.pipeline.model
        g = torch.Generator().manual_seed(0)
        linears = [(name, m) for name, m in float_llm.pipeline.model.named_modules() if isinstance(m, nn.Linear)]
        assert linears, "the float model has no linear layer to check"
        linears = [linears[i] for i in spread(len(linears), example_budget())]  # --examples bounds this too
        for name, linear in linears:
            self.case()
            try:
                module = quantized.get_submodule(name)
            except AttributeError:
                pytest.fail(f"apply() dropped or renamed linear {name!r}: a quantizer must keep module names")
            _check_shapes(name, module, linear, g)


    @given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 9))
    @property_settings(max_examples=10)
    def test_linears_equal_the_reference_of_their_own_arithmetic(self, quantized_llm: Any, seed: int,
                                                                 rows: int) -> None:
        """Random rows through each linear that has ``reference_forward``: the kernel's
        output within float32 rounding of the float64 result of the arithmetic it states."""
        self.case()
        g = torch.Generator().manual_seed(seed)
        stated = [(name, m) for name, m in quantized_llm.pipeline.model.named_modules()
                  if callable(getattr(m, "reference_forward", None))]
        for name, module in stated:
            weight_device = next(iter(module.buffers())).device
            x = (torch.randn(rows, module.in_features, generator=g) * 3).to(weight_device)
            with torch.no_grad():
                reference = module.reference_forward(x)
                if reference is None:
                    continue
                y = module(x)
            tolerance = self.REFERENCE_ULPS * reference.abs().amax(dim=-1, keepdim=True) + 1e-30
            excess = float(((y.double() - reference).abs() - tolerance).max())
            assert excess <= 0, (f"linear {name!r} ({type(module).__name__}) is off the float64 reference of its own "
                                 f"arithmetic by {excess:.3g} beyond float32 rounding ({rows} rows, seed {seed})")


def _check_shapes(name: str, module: nn.Module, linear: nn.Linear, g: torch.Generator) -> None:
    """``module`` maps random inputs shaped for ``linear`` to finite outputs of its shape."""
    weight = linear.weight
    for lead in ((3,), (2, 5)):
        x = torch.randn(*lead, linear.in_features, generator=g, dtype=torch.float64).to(weight.dtype).to(weight.device)
        with torch.no_grad():
            y = module(x)
        expected = (*lead, linear.out_features)
        assert tuple(y.shape) == expected, (f"linear {name!r} ({type(module).__name__}) maps input "
                                            f"{tuple(x.shape)} to {tuple(y.shape)}, not {expected}")
        assert torch.isfinite(y).all(), f"linear {name!r} ({type(module).__name__}) gave non-finite outputs"
