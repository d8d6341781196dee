"""The LoRA conformance suite on the built-in kernels: torch (in float32 and bfloat16, and in
float64 and float16; its grouped form too), and triton interpreted on a CPU (fewer, smaller cases); then on
deliberately broken kernels, each a bug a real kernel could have, to show the property meant
to catch it fails with a message naming the plugin, the case and what differed."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest
import torch

from tessellm.core.interfaces.lora import LoraMapping, LoraWeights
from tessellm.plugins.lora.torch_ref import SlotRows, TorchLora, TorchPlan
from tessellm.testing.conformance import LoraConformance


class TestTorch(LoraConformance):
    plugin = "torch"


class TestTorchFloat64AndFloat16(LoraConformance):
    plugin = "torch"
    dtypes = (torch.float64, torch.float16)
    max_examples = 5


class TestTriton(LoraConformance):
    """Compiled on a GPU, interpreted on a CPU (TRITON_INTERPRET=1, tests/conftest.py): widths
    below and above one tile of 32, sequences longer than one row tile, a few cases a property."""

    plugin = "triton"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    features = (8, 40, 72)
    slot_ranks = (16, 32)
    max_examples = 4


class TestTritonSplitK(LoraConformance):
    """The shrink split three ways over tiles of 16 (partials the expand sums)."""

    plugin = "triton"
    options = {"split": 3, "block_k": 16, "block_n": 16}
    dtypes = (torch.float32,)
    features = (8, 40, 72)
    max_examples = 3


# ---------------------------------------------------------------------- broken kernels


class GroupedTorch(TorchLora):
    """The torch kernel held to its grouped form (rows by slot, planned on the host), which the
    broken kernels below break one way each."""

    name = "torch-grouped"
    api_version = "1.10"
    stacked_row_slots = 0


class TestTorchGrouped(LoraConformance):
    """The torch kernel's grouped form (rows by slot), which larger batches take."""

    plugin_class = GroupedTorch
    max_examples = 10


class WrongSlot(GroupedTorch):
    """Every adapter row under the slot of the first sequence that has one."""

    name = "broken-wrong-slot"
    api_version = "1.10"

    def plan(self, mapping: LoraMapping) -> TorchPlan:
        first = next((s for s in mapping.seq_slots_cpu if s >= 0), -1)
        slots = [first if s >= 0 else -1 for s in mapping.seq_slots_cpu]
        return super().plan(LoraMapping(mapping.seq_slots, mapping.token_slots, mapping.query_start_loc, slots,
                                        mapping.query_starts_cpu, mapping.num_slots, mapping.max_query_len))


class ClampsRowsWithoutAdapter(GroupedTorch):
    """Rows at slot -1 take slot 0 (a clamp where a mask was meant)."""

    name = "broken-clamp"
    api_version = "1.10"

    def plan(self, mapping: LoraMapping) -> TorchPlan:
        slots = [max(s, 0) for s in mapping.seq_slots_cpu]
        return super().plan(LoraMapping(mapping.seq_slots, mapping.token_slots, mapping.query_start_loc, slots,
                                        mapping.query_starts_cpu, mapping.num_slots, mapping.max_query_len))


class AddsIntoACopy(GroupedTorch):
    """``out = out + ...``: the sum lands in a new tensor the caller never sees."""

    name = "broken-copy"
    api_version = "1.10"

    def apply(self, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, plan: Any) -> None:
        super().apply(out.clone(), x, weights, plan)


class ReturnsTheSum(GroupedTorch):
    """Returns ``out`` plus the products instead of adding into ``out``."""

    name = "broken-returns"
    api_version = "1.10"

    def apply(self, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, plan: Any) -> Any:
        result = out.clone()
        super().apply(result, x, weights, plan)
        return result


class ScratchInX(GroupedTorch):
    """Uses its input as scratch: the next layer reading ``x`` gets garbage."""

    name = "broken-scratch"
    api_version = "1.10"

    def apply(self, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, plan: Any) -> None:
        super().apply(out, x, weights, plan)
        x.mul_(0.5)


class HalfPrecisionShrink(GroupedTorch):
    """Rounds the shrunk rows to float16 whatever the model's dtype."""

    name = "broken-half-shrink"
    api_version = "1.10"

    def apply(self, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, plan: Any) -> None:
        for group in plan.groups:
            rows = group.rows if group.rows is not None else torch.arange(len(x), device=x.device)
            shrunk = (x.index_select(0, rows) @ weights.a[group.slot].t()).half().to(x.dtype)
            out.index_add_(0, rows, shrunk @ weights.b[group.slot].t())


class FirstRanks(GroupedTorch):
    """Reads only the first 8 ranks of a slot."""

    name = "broken-first-ranks"
    api_version = "1.10"

    def apply(self, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, plan: Any) -> None:
        super().apply(out, x, LoraWeights(weights.a[:, :8], weights.b[:, :, :8]), plan)


class FirstBand(GroupedTorch):
    """Reads at most 16 ranks (the default ``max_rank``): a stacked projection's other bands
    are lost."""

    name = "broken-first-band"
    api_version = "1.10"

    def apply(self, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, plan: Any) -> None:
        super().apply(out, x, LoraWeights(weights.a[:, :16], weights.b[:, :, :16]), plan)


class OneSlotFastPath(GroupedTorch):
    """Takes the one-adapter fast path whenever every sequence has the same slot, -1 included:
    a batch without adapters gets the last slot's."""

    name = "broken-fast-path"
    api_version = "1.10"

    def plan(self, mapping: LoraMapping) -> TorchPlan:
        if not mapping.static and len(set(mapping.seq_slots_cpu)) == 1:
            return TorchPlan([SlotRows(mapping.seq_slots_cpu[0], None)])
        return super().plan(mapping)


class SnapshotsStaticSlots(GroupedTorch):
    """A static plan copies the slot buffer when made: every replay applies the capture's."""

    name = "broken-static"
    api_version = "1.10"

    def plan(self, mapping: LoraMapping) -> TorchPlan:
        plan = super().plan(mapping)
        if plan.token_slots is not None:
            plan.token_slots = plan.token_slots.clone()
        return plan


@dataclass
class CachingPlan(TorchPlan):
    cached: dict[Any, LoraWeights] = field(default_factory=dict)


class CachesWeightsByShape(GroupedTorch):
    """Keeps the first weights of each shape in the plan: the second model layer applies the
    first one's adapters."""

    name = "broken-plan-cache"
    api_version = "1.10"

    def plan(self, mapping: LoraMapping) -> CachingPlan:
        plan = super().plan(mapping)
        return CachingPlan(plan.groups, plan.token_slots)

    def apply(self, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, plan: Any) -> None:
        weights = plan.cached.setdefault((tuple(weights.a.shape), tuple(weights.b.shape)), weights)
        super().apply(out, x, weights, plan)


@contextlib.contextmanager
def without_shrinking() -> Iterator[None]:
    """The loaded hypothesis profile without its shrink and explain phases: these tests read
    the failure's message, not its smallest case, and shrinking a broken kernel's failure
    takes seconds."""
    from hypothesis import Phase, settings

    name = settings.get_current_profile_name()
    settings.register_profile("lora-broken-kernels", parent=settings.get_profile(name),
                              phases=[p for p in settings.get_profile(name).phases
                                      if p not in (Phase.shrink, Phase.explain)])
    settings.load_profile("lora-broken-kernels")
    try:
        yield
    finally:
        settings.load_profile(name)


def failure(kernel: type[TorchLora], prop: Callable[[LoraConformance], None], **settings: Any) -> str:
    """The message of the assertion ``prop`` fails with on a suite holding ``kernel`` (all of
    them, where hypothesis reports several distinct failures); '' when it passes."""
    suite = type(f"Suite{kernel.__name__}", (LoraConformance,), {"plugin_class": kernel, **settings})()
    try:
        with without_shrinking():
            prop(suite)
    except AssertionError as exc:
        return str(exc)
    except BaseExceptionGroup as group:
        return "\n".join(str(exc) for exc in group.exceptions)
    return ""


SUITE = LoraConformance


@pytest.mark.parametrize("kernel, prop, expected", [
    pytest.param(WrongSlot, lambda s: SUITE.test_batches_match_the_reference_and_each_sequence_alone(s, "mixed"),
                 r"lora plugin 'broken-wrong-slot': max abs error .* against the float64 reference at row \d+ "
                 r"\(sequence \d+, slot \d+\), allowed .*\(sequences of \[.*\] rows with slots \[", id="wrong-slot"),
    pytest.param(ClampsRowsWithoutAdapter,
                 lambda s: SUITE.test_batches_match_the_reference_and_each_sequence_alone(s, "decode"),
                 r"row \d+ \(sequence \d+, slot -1: no adapter\) changed", id="clamp"),
    pytest.param(AddsIntoACopy, lambda s: SUITE.test_batches_match_the_reference_and_each_sequence_alone(s, "prefill"),
                 r"out came back unchanged", id="copy"),
    pytest.param(ReturnsTheSum, lambda s: SUITE.test_batches_match_the_reference_and_each_sequence_alone(s, "mixed"),
                 r"apply returned Tensor, not None", id="returns"),
    pytest.param(ScratchInX, lambda s: SUITE.test_batches_match_the_reference_and_each_sequence_alone(s, "mixed"),
                 r"apply wrote its input x", id="scratch"),
    pytest.param(FirstRanks, SUITE.test_slots_hold_adapters_of_every_rank,
                 r"against the float64 reference .*slot rank (16|32), adapter ranks", id="first-ranks"),
    pytest.param(FirstBand, SUITE.test_stacked_projections_with_some_parts_adapted,
                 r"against the float64 reference .*slot rank 16 x [23] parts", id="first-band"),
    pytest.param(OneSlotFastPath, SUITE.test_a_batch_without_adapter_rows_is_untouched,
                 r"slot -1: no adapter\) changed", id="fast-path"),
    pytest.param(SnapshotsStaticSlots, SUITE.test_a_static_plan_reads_the_slots_at_apply,
                 r"a static plan captured for \d+ decode rows .*, replay \d+ with slots \[", id="static"),
    pytest.param(CachesWeightsByShape, SUITE.test_one_plan_serves_every_layer_of_a_step,
                 r"apply [2-8] of 8 on one plan", id="plan-cache"),
])
def test_each_property_catches_its_broken_kernel(kernel, prop, expected):
    message = failure(kernel, prop, dtypes=(torch.float32,), slot_ranks=(16,), max_examples=10)
    assert message, f"{kernel.__name__} passed; the property meant to catch it did not"
    assert re.search(expected, message), message


def test_a_float16_rounding_in_a_float32_kernel_is_caught():
    """The tolerance is rounding-sized: a shrink rounded to float16 misses by far less than a
    wrong product, and still by more than ten times what a float32 run is allowed."""
    message = failure(HalfPrecisionShrink,
                      lambda s: SUITE.test_batches_match_the_reference_and_each_sequence_alone(s, "prefill"),
                      dtypes=(torch.float32,), max_examples=10)
    found = re.search(r"max abs error (\S+) against the float64 reference .*, allowed ([^;( ]+)", message)
    assert found, message
    error, allowed = map(float, found.groups())
    assert error < 1e-2 and allowed < error / 10, message


def test_the_first_band_passes_where_slots_fit_one_band_and_fails_where_parts_stack():
    """The rank property alone does not see a kernel capped at 16 ranks; the stacked one does."""
    settings = dict(dtypes=(torch.float32,), slot_ranks=(16,), max_examples=10)
    assert failure(FirstBand, SUITE.test_slots_hold_adapters_of_every_rank, **settings) == ""
    assert failure(FirstBand, SUITE.test_stacked_projections_with_some_parts_adapted, **settings)


def test_a_kernel_without_cuda_graphs_skips_the_static_property():
    class Eager(TorchLora):
        name = "eager-only"
        api_version = "1.10"
        supports_cuda_graphs = False

    suite = type("SuiteEager", (LoraConformance,), {"plugin_class": Eager})()
    with pytest.raises(pytest.skip.Exception, match="does not declare supports_cuda_graphs"):
        suite.test_a_static_plan_reads_the_slots_at_apply()
