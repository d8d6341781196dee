"""The LoRA kernel contract as properties, written against the interface alone
(``LoraKernel``, ``LoraMapping``, ``LoraWeights``): ``apply`` adds each row's adapter product
``B[s] @ (A[s] @ x[t])`` in place and leaves rows without an adapter exactly as they were;
a batch equals each sequence alone; slots hold adapters of every rank up to the slot rank
and stacked projections hold theirs on rank bands; a captured (static) plan reads the slots
at ``apply``, not at ``plan``; one plan serves every layer of a step.

The tolerance rule (the attention suite's, with a floor of rounding): the kernel's largest
absolute error against the float64 reference may be at most twice that of plain torch
computing the same products in the same dtype, plus one rounding of the result to the dtype
and a reordering of the sums (``allowed_error``). Two runs of the kernel (a batch and a
sequence alone, a captured plan and an eager one) may differ by twice that. Adapters are
drawn so that a row's product is about as large as the base output: a row given the wrong
slot, a rank or a band left out, misses by far more than the tolerance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, strategies as st

from tessellm.core.interfaces.lora import LoraKernel, LoraMapping, LoraWeights
from tessellm.core.plugin import SelectionContext
from tessellm.testing.conformance.base import ConformanceSuite, property_settings

UNIT = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
"""Each dtype's unit roundoff: one rounding of a result to the dtype errs by at most this
times its magnitude."""

ACCUMULATE = {torch.float64: 2.0 ** -53}
"""The unit roundoff of the sums inside the products: float64 in a float64 pipeline, float32
(2 ** -24) for every other dtype."""


MAX_SEQS = 6
"""The most sequences a batch of the suite holds."""


@dataclass
class Batch:
    """A packed batch as the kernel sees it: each sequence's row count and slot (-1: none)."""

    lengths: list[int]
    slots: list[int]

    @property
    def starts(self) -> list[int]:
        """Where each sequence's rows begin, then the row count."""
        starts = [0]
        for n in self.lengths:
            starts.append(starts[-1] + n)
        return starts

    @property
    def row_slots(self) -> list[int]:
        return [s for s, n in zip(self.slots, self.lengths) for _ in range(n)]

    def sequence_of(self, row: int) -> int:
        return next(i for i, end in enumerate(self.starts[1:]) if row < end)

    def __str__(self) -> str:
        return f"sequences of {self.lengths} rows with slots {self.slots}"


def lora_mapping(batch: Batch, num_slots: int, device: torch.device) -> LoraMapping:
    """The eager ``LoraMapping`` of ``batch``: device tensors and the host lists that agree."""
    return LoraMapping(seq_slots=torch.tensor(batch.slots, dtype=torch.int32, device=device),
                       token_slots=torch.tensor(batch.row_slots, dtype=torch.int64, device=device),
                       query_start_loc=torch.tensor(batch.starts, dtype=torch.int32, device=device),
                       seq_slots_cpu=list(batch.slots), query_starts_cpu=batch.starts, num_slots=num_slots,
                       max_query_len=max(batch.lengths))


def lora_weights(g: torch.Generator, in_features: int, parts: tuple[int, ...], rank: int,
                 adapter_ranks: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> LoraWeights:
    """Slot buffers as a pipeline fills them: ``parts`` are the output widths of the stacked
    projections (one for a plain one); slot ``s`` holds, for part ``j``, an adapter of rank
    ``adapter_ranks[s][j]`` (0: none) on ranks ``j * rank ..`` of ``a`` and that part's rows
    of ``b``, zero elsewhere. Entries are scaled so that each product is about unit size."""
    width = len(parts) * rank
    a = torch.zeros(len(adapter_ranks), width, in_features, dtype=torch.float64)
    b = torch.zeros(len(adapter_ranks), sum(parts), width, dtype=torch.float64)
    for s, ranks in enumerate(adapter_ranks):
        offset = 0
        for j, (part, r) in enumerate(zip(parts, ranks)):
            band = slice(j * rank, j * rank + r)
            a[s, band] = torch.randn(r, in_features, generator=g, dtype=torch.float64) / in_features ** 0.5
            b[s, offset:offset + part, band] = torch.randn(part, r, generator=g, dtype=torch.float64) / r ** 0.5
            offset += part
    return LoraWeights(a.to(dtype).to(device), b.to(dtype).to(device))


def products(out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, row_slots: list[int],
             dtype: torch.dtype) -> torch.Tensor:
    """``out`` plus each row's adapter product, computed by plain torch in ``dtype`` (the
    rows of one slot together): float64 is the reference."""
    result = out.to(dtype).clone()
    slots = torch.tensor(row_slots, dtype=torch.long)
    for s in sorted({s for s in row_slots if s >= 0}):
        rows = torch.nonzero(slots == s).flatten().to(out.device)
        a, b = weights.a[s].to(dtype), weights.b[s].to(dtype)
        result[rows] += (x.to(dtype)[rows] @ a.t()) @ b.t()
    return result


def allowed_error(before: torch.Tensor, x: torch.Tensor, weights: LoraWeights, row_slots: list[int]) -> tuple[
        torch.Tensor, float]:
    """The float64 reference and the error the tolerance rule allows against it: twice plain
    torch's error in the dtype, plus one rounding of the result and sums of ``in + rank``
    terms reordered (a ``2 * sqrt(n)`` multiple of the accumulator's roundoff on the sum of the
    terms' magnitudes)."""
    dtype = before.dtype
    expected = products(before, x, weights, row_slots, torch.float64)
    plain = products(before, x, weights, row_slots, dtype).double()
    magnitude = products(before.abs(), x.abs(), LoraWeights(weights.a.abs(), weights.b.abs()), row_slots,
                         torch.float64)
    terms = x.shape[1] + weights.rank
    rounding = UNIT[dtype] * expected.abs() + 2 * terms ** 0.5 * ACCUMULATE.get(dtype, 2.0 ** -24) * magnitude
    return expected, 2 * float((plain - expected).abs().max()) + float(rounding.max())


def describe(in_features: int, parts: tuple[int, ...], rank: int, adapter_ranks: list[tuple[int, ...]],
             dtype: torch.dtype) -> str:
    """A projection's shapes in words, for failure messages."""
    return (f"in {in_features}, out {'+'.join(map(str, parts))}, slot rank {rank}"
            + (f" x {len(parts)} parts" if len(parts) > 1 else "") + f", adapter ranks {adapter_ranks}, {dtype}")


@dataclass
class Layer:
    """One wrapped projection of a case: its input and base output, its slot buffers."""

    x: torch.Tensor
    out: torch.Tensor
    weights: LoraWeights
    what: str

    @classmethod
    def random(cls, g: torch.Generator, rows: int, weights: LoraWeights, what: str) -> Layer:
        """Random inputs and base outputs of ``rows`` rows for ``weights``' widths."""
        dtype, device = weights.a.dtype, weights.a.device
        x = torch.randn(rows, weights.a.shape[2], generator=g, dtype=torch.float64).to(dtype).to(device)
        out = torch.randn(rows, weights.b.shape[1], generator=g, dtype=torch.float64).to(dtype).to(device)
        return cls(x, out, weights, what)


@dataclass
class Case:
    """A batch and one projection's shapes: ``parts`` its stacked output widths, ``rank`` the
    slot rank of each part's band, ``adapter_ranks[s][j]`` slot ``s``'s adapter rank on part
    ``j`` (0: none)."""

    batch: Batch
    in_features: int
    parts: tuple[int, ...]
    rank: int
    adapter_ranks: list[tuple[int, ...]]
    seed: int

    def layer(self, g: torch.Generator, rows: int, dtype: torch.dtype, device: torch.device) -> Layer:
        weights = lora_weights(g, self.in_features, self.parts, self.rank, self.adapter_ranks, dtype, device)
        return Layer.random(g, rows, weights, self.describe(dtype))

    def describe(self, dtype: torch.dtype) -> str:
        return describe(self.in_features, self.parts, self.rank, self.adapter_ranks, dtype)


@dataclass
class StaticCase:
    """A captured decode plan of ``size`` rows replayed over decode batches of ``replays``
    slots (each at most ``size``, the rest padding at -1)."""

    size: int
    replays: list[list[int]]
    in_features: int
    out_features: int
    rank: int
    adapter_ranks: list[int]
    seed: int


@st.composite
def batches(draw: Any, kind: str, num_slots: int, max_rows: int) -> Batch:
    """1 to ``MAX_SEQS`` sequences: ``decode`` (one row each), ``prefill`` (2 to ``max_rows``
    rows), ``mixed`` (either); each with a slot of ``-1 .. num_slots - 1``."""
    count = draw(st.integers(1, MAX_SEQS))
    prefill = st.integers(2, max(max_rows, 2))
    lengths = [1 if (kind == "decode" or (kind == "mixed" and draw(st.booleans()))) else draw(prefill)
               for _ in range(count)]
    slots = draw(st.lists(st.integers(-1, num_slots - 1), min_size=count, max_size=count))
    return Batch(lengths, slots)


@st.composite
def plain_cases(draw: Any, kind: str, features: tuple[int, ...], ranks: tuple[int, ...], max_rows: int) -> Case:
    """A plain projection: 1 to 5 slots, each holding an adapter of a rank up to the slot's."""
    num_slots, rank = draw(st.integers(1, 5)), draw(st.sampled_from(ranks))
    adapter_ranks = [(r,) for r in draw(st.lists(st.integers(1, rank), min_size=num_slots, max_size=num_slots))]
    return Case(draw(batches(kind, num_slots, max_rows)), draw(st.sampled_from(features)),
                (draw(st.sampled_from(features)),), rank, adapter_ranks, draw(st.integers(0, 2**16)))


@st.composite
def every_rank_cases(draw: Any, features: tuple[int, ...], ranks: tuple[int, ...], max_rows: int) -> Case:
    """Slots of a rank from ``ranks`` holding adapters of ranks 1, 7 (at most the slot rank)
    and the slot rank, and up to two more, in some order; a mixed batch over them."""
    rank = draw(st.sampled_from(ranks))
    adapter_ranks = [(r,) for r in draw(st.permutations([1, min(7, rank), rank]
                                                        + draw(st.lists(st.integers(1, rank), max_size=2))))]
    return Case(draw(batches("mixed", len(adapter_ranks), max_rows)), draw(st.sampled_from(features)),
                (draw(st.sampled_from(features)),), rank, adapter_ranks, draw(st.integers(0, 2**16)))


@st.composite
def stacked_cases(draw: Any, features: tuple[int, ...], ranks: tuple[int, ...], max_rows: int) -> Case:
    """A stacked projection, q/k/v-like (a wide part, two narrow ones) or gate/up-like (two
    equal parts); each slot adapts some of its parts (rank 0: not that one), and at least one
    slot leaves a part out."""
    wide, narrow = draw(st.sampled_from(features)), draw(st.sampled_from(features))
    parts = draw(st.sampled_from(((wide, narrow, narrow), (wide, wide))))
    num_slots, rank = draw(st.integers(1, 4)), draw(st.sampled_from(ranks))
    part_rank = st.one_of(st.just(0), st.integers(1, rank))
    adapter_ranks = [tuple(draw(st.lists(part_rank, min_size=len(parts), max_size=len(parts))))
                     for _ in range(num_slots)]
    adapter_ranks[0] = (max(adapter_ranks[0][0], 1), *adapter_ranks[0][1:-1], 0)  # part 0 adapted, the last not
    return Case(draw(batches("mixed", num_slots, max_rows)), draw(st.sampled_from(features)), parts, rank,
                adapter_ranks, draw(st.integers(0, 2**16)))


@st.composite
def static_cases(draw: Any, features: tuple[int, ...], ranks: tuple[int, ...]) -> StaticCase:
    """A capture of 1 to 8 rows and 1 to 3 decode batches replayed on it."""
    size, num_slots, rank = draw(st.integers(1, 8)), draw(st.integers(1, 4)), draw(st.sampled_from(ranks))
    replay = st.lists(st.integers(-1, num_slots - 1), min_size=1, max_size=size)
    return StaticCase(size, draw(st.lists(replay, min_size=1, max_size=3)), draw(st.sampled_from(features)),
                      draw(st.sampled_from(features)), rank,
                      draw(st.lists(st.integers(1, rank), min_size=num_slots, max_size=num_slots)),
                      draw(st.integers(0, 2**16)))


class LoraConformance(ConformanceSuite):
    """The contract every LoRA kernel honours (core/interfaces/lora.py), checked on the
    plugin named by ``plugin`` (or ``plugin_class``) with ``options``:

    - decode, prefill and mixed batches (sequences of one row and of many, slots mixed, some
      rows without an adapter) equal the float64 reference ``out + B[s] @ (A[s] @ x)`` within
      the tolerance rule (module docstring), and each sequence run alone through the kernel;
    - slots of each slot rank in ``slot_ranks`` holding adapters of ranks 1, 7 and the slot
      rank itself (zero-padded), and stacked projections (q/k/v-like and gate/up-like: rank
      bands, block-diagonal ``b``) where each slot adapts only some of the parts;
    - rows whose slot is -1 are bit-identical after ``apply``, as is a batch without any
      adapter row; ``apply`` writes ``out`` in place, returns None, and leaves ``x`` and the
      slot buffers as they were;
    - a kernel that declares ``supports_cuda_graphs``: a plan made from a static mapping (the
      device slot buffers a captured graph reads, host lists describing a dummy capture batch)
      applied after the buffers are rewritten for each of several decode batches, padded rows
      at -1, equals the eager plan of that batch;
    - one plan serves every ``apply`` of a step: layers of different widths and ranks, plain
      and stacked, in two model layers, each equal to its reference.

    Each case runs in each of ``dtypes`` on ``device``; ``features`` are the in and out widths
    drawn, ``max_rows`` the longest sequence, ``max_examples`` caps hypothesis' cases per
    property (None: the loaded profile's). A device or dtype the plugin declares unsupported
    (``unsupported_reasons``) is skipped with its reasons.
    """

    kind = "lora"
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16)
    device: ClassVar[str] = "cpu"
    features: ClassVar[tuple[int, ...]] = (8, 24, 40, 64, 96)
    slot_ranks: ClassVar[tuple[int, ...]] = (16, 8, 32)
    max_rows: ClassVar[int] = 33
    max_examples: ClassVar[int | None] = None

    # ------------------------------------------------------------------ helpers

    def _settings(self, cap: int) -> Any:
        return property_settings(max_examples=cap if self.max_examples is None else min(cap, self.max_examples))

    def kernel(self, dtype: torch.dtype) -> LoraKernel:
        """The kernel under test for ``dtype`` on the suite's device; skips what it declines."""
        from tessellm.testing.conformance.attention import model_spec

        plugin, device = self.under_test(), torch.device(self.device)
        spec = model_spec(4, 2, 16)
        ctx = SelectionContext(device=device, dtype=dtype, model=spec, options=self.plugin_options(),
                               max_model_len=spec.max_position_embeddings)
        self.require(ctx, f"device {device.type}, {dtype}")
        return plugin(self.plugin_options(), device, dtype)

    def apply(self, kernel: LoraKernel, layer: Layer, plan: Any, what: str) -> torch.Tensor:
        """``layer.out`` after one ``apply`` on a copy; asserts it returned None and wrote
        neither ``x`` nor the slot buffers."""
        out = layer.out.clone()
        inputs = {"x": layer.x, "weights.a": layer.weights.a, "weights.b": layer.weights.b}
        kept = {name: tensor.clone() for name, tensor in inputs.items()}
        returned = kernel.apply(out, layer.x, layer.weights, plan)
        assert returned is None, (f"{self.label()}: apply returned {type(returned).__name__}, not None: it must add "
                                  f"into out in place and return nothing ({what})")
        for name, tensor in inputs.items():
            assert torch.equal(kept[name], tensor), f"{self.label()}: apply wrote its input {name} ({what})"
        return out

    def assert_result(self, got: torch.Tensor, layer: Layer, batch: Batch, what: str) -> None:
        """Rows with slot -1 bit-identical to ``layer.out``; every row within the tolerance
        rule of the float64 reference."""
        row_slots = batch.row_slots
        without = torch.tensor([s < 0 for s in row_slots], device=got.device)
        changed = torch.nonzero(without & (got != layer.out).any(dim=1)).flatten().tolist()
        assert not changed, (f"{self.label()}: row {changed[0]} (sequence {batch.sequence_of(changed[0])}, slot -1: "
                             f"no adapter) changed; apply must leave such rows as they were ({what})")
        expected, allowed = allowed_error(layer.out, layer.x, layer.weights, row_slots)
        errors = (got.double() - expected).abs().amax(dim=1)
        row = int(errors.argmax())
        unchanged = "; out came back unchanged (apply added nothing into the out it was handed)" \
            if torch.equal(got, layer.out) else ""
        assert float(errors[row]) <= allowed, \
            (f"{self.label()}: max abs error {float(errors[row]):.3g} against the float64 reference at row {row} "
             f"(sequence {batch.sequence_of(row)}, slot {row_slots[row]}), allowed {allowed:.3g}{unchanged} ({what})")

    def check_batch(self, batch: Batch, layer: Layer, kernel: LoraKernel, num_slots: int,
                    alone: bool = True) -> None:
        """``batch`` through ``kernel`` against the reference; with ``alone``, each sequence
        alone through it gives its rows of the batch (within the tolerance)."""
        device = torch.device(self.device)
        what = f"{batch}, {layer.what}"
        got = self.apply(kernel, layer, kernel.plan(lora_mapping(batch, num_slots, device)), what)
        self.assert_result(got, layer, batch, what)
        if not alone:
            return
        starts = batch.starts
        for i, (n, slot) in enumerate(zip(batch.lengths, batch.slots)):
            rows = slice(starts[i], starts[i + 1])
            single = Layer(layer.x[rows].clone(), layer.out[rows].clone(), layer.weights, layer.what)
            own = self.apply(kernel, single, kernel.plan(lora_mapping(Batch([n], [slot]), num_slots, device)), what)
            allowed = 2 * allowed_error(single.out, single.x, layer.weights, [slot] * n)[1]
            error = float((own.double() - got[rows].double()).abs().max())
            assert error <= allowed, (f"{self.label()}: sequence {i} ({n} rows, slot {slot}) alone differs from its "
                                      f"rows in the batch by {error:.3g}, allowed {allowed:.3g} ({what})")

    def run_case(self, case: Case, alone: bool = True) -> None:
        """One case in each of ``dtypes`` (counted once)."""
        self.case()
        for dtype in self.dtypes:
            g = torch.Generator().manual_seed(case.seed)
            layer = case.layer(g, sum(case.batch.lengths), dtype, torch.device(self.device))
            self.check_batch(case.batch, layer, self.kernel(dtype), len(case.adapter_ranks), alone)

    # ------------------------------------------------------------------ properties

    @pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
    def test_batches_match_the_reference_and_each_sequence_alone(self, kind: str) -> None:
        """Decode (one row a sequence), prefill and mixed batches of 1 to ``MAX_SEQS``
        sequences over 1 to 5 slots, some rows without an adapter."""

        @given(plain_cases(kind, self.features, self.slot_ranks, self.max_rows))
        @self._settings(20)
        def run(case: Case) -> None:
            self.run_case(case)

        run()

    def test_slots_hold_adapters_of_every_rank(self) -> None:
        """Slots of each rank in ``slot_ranks`` holding adapters of rank 1, 7 and the slot
        rank, zero-padded."""

        @given(every_rank_cases(self.features, self.slot_ranks, self.max_rows))
        @self._settings(20)
        def run(case: Case) -> None:
            self.run_case(case, alone=False)

        run()

    def test_stacked_projections_with_some_parts_adapted(self) -> None:
        """q/k/v-like and gate/up-like stacked projections: one rank band a part, ``b``
        block-diagonal, slots adapting only some parts."""

        @given(stacked_cases(self.features, self.slot_ranks, self.max_rows))
        @self._settings(20)
        def run(case: Case) -> None:
            self.run_case(case, alone=False)

        run()

    def test_a_batch_without_adapter_rows_is_untouched(self) -> None:
        """Every sequence at slot -1 (prefill and decode rows): ``out`` bit-identical."""

        @given(batches("mixed", 1, self.max_rows), st.integers(1, 4), st.sampled_from(self.features),
               st.sampled_from(self.features), st.integers(0, 2**16))
        @self._settings(10)
        def run(batch: Batch, num_slots: int, in_features: int, out_features: int, seed: int) -> None:
            batch = Batch(batch.lengths, [-1] * len(batch.lengths))
            self.run_case(Case(batch, in_features, (out_features,), self.slot_ranks[0],
                               [(self.slot_ranks[0],)] * num_slots, seed), alone=False)

        run()

    def test_a_static_plan_reads_the_slots_at_apply(self) -> None:
        """A plan made once from static buffers (as a captured decode graph's), applied after
        the buffers are rewritten for each decode batch, equals that batch's eager plan."""
        if not self.under_test().supports_cuda_graphs:
            pytest.skip(f"{self.label()} does not declare supports_cuda_graphs: decode steps with adapters run eagerly")

        @given(static_cases(self.features, self.slot_ranks))
        @self._settings(15)
        def run(case: StaticCase) -> None:
            self.case()
            for dtype in self.dtypes:
                self.check_static(case, dtype)

        run()

    def test_one_plan_serves_every_layer_of_a_step(self) -> None:
        """One plan, then plain and stacked layers of different widths, in two model layers
        (the order a forward applies them), each against its own reference."""

        @given(batches("mixed", 3, self.max_rows), st.sampled_from(self.features), st.sampled_from(self.features),
               st.sampled_from(self.features), st.sampled_from(self.slot_ranks), st.integers(0, 2**16))
        @self._settings(10)
        def run(batch: Batch, hidden: int, kv: int, intermediate: int, rank: int, seed: int) -> None:
            self.case()
            for dtype in self.dtypes:
                self.check_layers(batch, (hidden, kv, intermediate), rank, seed, dtype)

        run()

    # ------------------------------------------------------------------ static plans and layers

    def check_static(self, case: StaticCase, dtype: torch.dtype) -> None:
        """``case``'s capture, its warm-up with every slot -1, then each replay."""
        kernel, device, size = self.kernel(dtype), torch.device(self.device), case.size
        seq_slots = torch.full((size,), -1, dtype=torch.int32, device=device)
        token_slots = torch.full((size,), -1, dtype=torch.int64, device=device)
        starts = torch.arange(size + 1, dtype=torch.int32, device=device)
        plan = kernel.plan(LoraMapping(seq_slots, token_slots, starts, [0] * size, list(range(size + 1)),
                                       len(case.adapter_ranks), 1, static=True))
        g = torch.Generator().manual_seed(case.seed)
        adapter_ranks = [(r,) for r in case.adapter_ranks]
        weights = lora_weights(g, case.in_features, (case.out_features,), case.rank, adapter_ranks, dtype, device)
        shapes = describe(case.in_features, (case.out_features,), case.rank, adapter_ranks, dtype)
        what = f"a static plan captured for {size} decode rows (host lists: every row at slot 0), {shapes}"
        warm_up = Layer.random(g, size, weights, shapes)
        self.assert_result(self.apply(kernel, warm_up, plan, what), warm_up, Batch([1] * size, [-1] * size),
                           f"{what}, applied with every slot buffer at -1")
        for step, slots in enumerate(case.replays):
            padded = slots + [-1] * (size - len(slots))
            seq_slots.copy_(torch.tensor(padded, dtype=torch.int32))
            token_slots.copy_(torch.tensor(padded, dtype=torch.int64))
            layer = Layer.random(g, size, weights, shapes)
            replay = f"{what}, replay {step} with slots {padded}"
            got = self.apply(kernel, layer, plan, replay)
            self.assert_result(got, layer, Batch([1] * size, padded), replay)
            n = len(slots)
            real = Layer(layer.x[:n].clone(), layer.out[:n].clone(), weights, shapes)
            eager = self.apply(kernel, real, kernel.plan(lora_mapping(Batch([1] * n, slots), len(case.adapter_ranks),
                                                                      device)), replay)
            allowed = 2 * allowed_error(real.out, real.x, weights, slots)[1]
            error = float((eager.double() - got[:n].double()).abs().max())
            assert error <= allowed, (f"{self.label()}: the static plan's rows differ from the eager plan's by "
                                      f"{error:.3g}, allowed {allowed:.3g} ({replay})")

    def check_layers(self, batch: Batch, widths: tuple[int, int, int], rank: int, seed: int,
                     dtype: torch.dtype) -> None:
        """Plain q (hidden -> hidden), stacked qkv, stacked gate/up and plain down (intermediate
        -> hidden) projections of two model layers, each slot adapting random parts, on the
        plan of one mapping."""
        hidden, kv, intermediate = widths
        kernel, device = self.kernel(dtype), torch.device(self.device)
        g = torch.Generator().manual_seed(seed)
        shapes = [(hidden, (hidden,)), (hidden, (hidden, kv, kv)), (hidden, (intermediate, intermediate)),
                  (intermediate, (hidden,))]
        layers = []
        for _ in range(2):  # two model layers
            for in_features, parts in shapes:
                ranks = torch.randint(0, rank + 1, (3, len(parts)), generator=g).tolist()  # 3 slots, 0: no adapter
                case = Case(batch, in_features, parts, rank, [tuple(r) for r in ranks], seed)
                layers.append(case.layer(g, sum(batch.lengths), dtype, device))
        plan = kernel.plan(lora_mapping(batch, 3, device))
        results = [self.apply(kernel, layer, plan, f"{batch}, {layer.what}") for layer in layers]
        for i, (layer, got) in enumerate(zip(layers, results)):
            self.assert_result(got, layer, batch, f"apply {i + 1} of {len(layers)} on one plan, {batch}, {layer.what}")
