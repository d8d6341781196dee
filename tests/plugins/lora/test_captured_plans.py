"""Both LoRA kernels' captured plans under CUDA-graph semantics, on a CPU.

A decode graph is captured at start-up with every row at slot -1 and every slot empty; each
replay must apply the slots and weights as they are then. Here a kernel's ``apply`` over a
static plan is recorded (tessellm.testing.graph_replay: launches, grids and host-side values
fixed at record time, tensors read at replay) in exactly that state, then the slots are
loaded (``LoraLinear.load_slot``, adapters of ranks below the slot rank, zero-padded) and
the row slots rewritten in place, and the replay is held to the float64 product. Mixes differ
from the capture's and from each other: more segments, more adapters, rows without any, a
slot reloaded with another rank between two replays. The triton kernel runs under Triton's
interpreter (small shapes)."""

from __future__ import annotations

import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first imported

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tessellm.core.interfaces.lora import LoraMapping  # noqa: E402
from tessellm.core.model.lora import LoraLinear, LoraState  # noqa: E402
from tessellm.core.plugin import PluginOptions  # noqa: E402
from tessellm.testing.graph_replay import Recording  # noqa: E402

SLOTS, RANK, K, N = 3, 8, 24, 20


def make_kernel(name: str):
    if name == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the triton kernel runs on a CPU under TRITON_INTERPRET=1 only")
        from tessellm.plugins.lora.triton import TritonLora, TritonLoraOptions

        return TritonLora(TritonLoraOptions(), torch.device("cpu"), torch.float32)
    from tessellm.plugins.lora.torch_ref import TorchLora

    return TorchLora(PluginOptions(), torch.device("cpu"), torch.float32)


def static_mapping(rows: int) -> LoraMapping:
    """A captured decode graph's mapping: device buffers, every row at slot -1."""
    slots = torch.full((rows,), -1, dtype=torch.int32)
    return LoraMapping(slots, torch.full((rows,), -1, dtype=torch.long), torch.arange(rows + 1, dtype=torch.int32),
                       [0] * rows, list(range(rows + 1)), SLOTS, 1, static=True)


def random_adapter(g: torch.Generator, rank: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {0: (torch.randn(rank, K, generator=g) / K ** 0.5, torch.randn(N, rank, generator=g) / rank ** 0.5)}


def expected(base: torch.Tensor, x: torch.Tensor, layer: LoraLinear, row_slots: list[int]) -> torch.Tensor:
    out = base.double().clone()
    for t, s in enumerate(row_slots):
        if s >= 0:
            out[t] += layer.weights.b[s].double() @ (layer.weights.a[s].double() @ x[t].double())
    return out


@pytest.mark.parametrize("kernel_name", ["torch", "triton"])
@given(mixes=st.lists(st.lists(st.integers(-1, SLOTS - 1), min_size=5, max_size=5), min_size=2, max_size=3),
       ranks=st.lists(st.sampled_from([1, 4, 8]), min_size=SLOTS + 1, max_size=SLOTS + 1),
       seed=st.integers(0, 2 ** 16))
@settings(max_examples=6, deadline=None)
def test_a_captured_plan_applies_the_slots_and_weights_of_each_replay(kernel_name, mixes, ranks, seed):
    kernel = make_kernel(kernel_name)
    rows = 5
    g = torch.Generator().manual_seed(seed)
    mapping = static_mapping(rows)
    layer = LoraLinear(torch.nn.Linear(K, N), (("proj", N),), SLOTS, RANK, LoraState(kernel, SLOTS),
                       torch.device("cpu"), torch.float32)
    x, base = torch.randn(rows, K, generator=g), torch.randn(rows, N, generator=g)
    out = torch.empty(rows, N)
    plan = kernel.plan(mapping)
    with torch.inference_mode():
        for recording in (None, Recording()):  # a warm-up, then the capture, both in the captured state
            with recording.record() if recording else contextlib.nullcontext():
                out.copy_(base)
                kernel.apply(out, x, layer.weights, plan)
        assert torch.equal(out, base)  # captured with no adapter anywhere
        for slot in range(SLOTS):
            layer.load_slot(slot, random_adapter(g, ranks[slot]))
        for i, mix in enumerate(mixes):
            if i == 1:  # another adapter, of another rank, replaces slot 0 between replays
                layer.load_slot(0, random_adapter(g, ranks[SLOTS]))
            mapping.seq_slots.copy_(torch.tensor(mix, dtype=torch.int32))
            mapping.token_slots.copy_(torch.tensor(mix))
            x.copy_(torch.randn(rows, K, generator=g))
            recording.replay()
            want = expected(base, x, layer, mix)
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"replay {i} of {mix}: {m}")

