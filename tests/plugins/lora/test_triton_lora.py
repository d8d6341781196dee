"""LoRA `triton` (the SGMV shrink and expand kernels) against the float64 product and the
torch reference: random packed batches (1 to 5 sequences of 1 to 9 rows, decode-only ones
among them, some without an adapter), slot ranks 1 to 16, widths that are not multiples of
any tile, strided views of x and out, K split into float32 partials or not; rows without an
adapter bit-identical; a captured (static) plan that reads the slots at apply; segments
longer than a tile, shared by several programs or walked by one; selection (auto never picks
it on a CPU, and naming it there without the interpreter says why).

Without a GPU everything runs under Triton's interpreter on CPU tensors (small shapes; CI).
With one, the same tests run compiled on CUDA."""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first imported

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

from tessellm.core.interfaces.lora import LoraMapping, LoraWeights  # noqa: E402
from tessellm.core.plugin import PluginOptions, SelectionContext  # noqa: E402
from tessellm.plugins.lora.torch_ref import TorchLora  # noqa: E402
from tessellm.plugins.lora.triton import TritonLora, TritonLoraOptions  # noqa: E402
from tessellm.testing.attention import model_stub  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EPS = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
"""One unit of each dtype's rounding (relative)."""
DOT_EPS = {torch.float32: 2.0 ** -20, torch.float16: 2.0 ** -10 if CUDA else 2.0 ** -20,
           torch.bfloat16: 2.0 ** -10 if CUDA else 2.0 ** -20}
"""Relative error of the float32 accumulations (compiled 16-bit models expand through a
tf32 dot: h rounded to 10 bits)."""


def mapping_of(lengths: list[int], slots: list[int], num_slots: int, static: bool = False) -> LoraMapping:
    """The step's mapping of sequences of ``lengths`` rows under ``slots``; ``static``: as a
    captured decode graph's, its host lists describing another batch (every row at slot 0)
    and its longest sequence one row."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    rows = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64), torch.tensor(lengths))
    host_slots, host_starts = (([0] * len(slots), list(range(len(slots) + 1))) if static else (list(slots), starts))
    return LoraMapping(torch.tensor(slots, dtype=torch.int32, device=DEVICE), rows.to(DEVICE),
                       torch.tensor(starts, dtype=torch.int32, device=DEVICE), host_slots, host_starts, num_slots,
                       1 if static else max(lengths), static=static)


def kernel(dtype: torch.dtype, **options) -> TritonLora:
    return TritonLora(TritonLoraOptions(**options), DEVICE, dtype)


def exact(out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, row_slots: list[int]) -> tuple[torch.Tensor,
                                                                                                        torch.Tensor]:
    """float64 ``out + B[s] @ (A[s] @ x)`` per row, and the sum of the absolute values of
    every term (what bounds the accumulations' rounding)."""
    result, size = out.double().clone(), out.double().abs()
    for t, s in enumerate(row_slots):
        if s >= 0:
            a, b, xt = weights.a[s].double(), weights.b[s].double(), x[t].double()
            result[t] += b @ (a @ xt)
            size[t] += b.abs() @ (a.abs() @ xt.abs())
    return result, size


def random_layer(g: torch.Generator, rows: int, k: int, n: int, num_slots: int, rank: int, dtype: torch.dtype,
                 views: bool) -> tuple[torch.Tensor, torch.Tensor, LoraWeights, torch.Tensor]:
    """x [rows, k], out [rows, n] (``views``: column slices of wider tensors, so row strides
    exceed the widths) and slot buffers whose products are about unit size; also the tensor
    ``out`` is a view of."""
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(DEVICE)

    weights = LoraWeights(rand(num_slots, rank, k, scale=k ** -0.5), rand(num_slots, n, rank, scale=rank ** -0.5))
    if views:
        wide_x, wide_out = rand(rows, k + 5), rand(rows, n + 7)
        return wide_x[:, 3:3 + k], wide_out[:, 2:2 + n], weights, wide_out
    out = rand(rows, n)
    return rand(rows, k), out, weights, out


@st.composite
def cases(draw):
    count = draw(st.integers(1, 5))
    decode = draw(st.booleans())
    lengths = [1 if decode else draw(st.integers(1, 9)) for _ in range(count)]
    num_slots = draw(st.integers(1, 4))
    slots = draw(st.lists(st.integers(-1, num_slots - 1), min_size=count, max_size=count))
    return dict(lengths=lengths, slots=slots, num_slots=num_slots, rank=draw(st.sampled_from([1, 3, 8, 16])),
                k=draw(st.integers(8, 48)), n=draw(st.integers(8, 48)), dtype=draw(st.sampled_from(DTYPES)),
                views=draw(st.booleans()), split=draw(st.sampled_from([None, 1, 2, 3])),
                block_k=draw(st.sampled_from([None, 16])), seed=draw(st.integers(0, 2**16)))


@given(cases())
@settings(max_examples=20)
def test_matches_float64_and_the_torch_reference(case):
    """Every adapter row within one rounding of the float64 product (h stays float32), and
    within two roundings of the torch reference's result (which rounds h to the model dtype);
    rows without an adapter, and the columns of the tensor ``out`` is a view of, bit-identical."""
    lengths, slots, dtype = case["lengths"], case["slots"], case["dtype"]
    g = torch.Generator().manual_seed(case["seed"])
    x, out, weights, whole = random_layer(g, sum(lengths), case["k"], case["n"], case["num_slots"], case["rank"],
                                          dtype, case["views"])
    before, whole_before = out.clone(), whole.clone()
    mapping = mapping_of(lengths, slots, case["num_slots"])
    triton_lora = kernel(dtype, split=case["split"], block_k=case["block_k"])
    assert triton_lora.apply(out, x, weights, triton_lora.plan(mapping)) is None
    reference = TorchLora(PluginOptions(), DEVICE, dtype)
    torch_out = before.clone()
    reference.apply(torch_out, x, weights, reference.plan(mapping))

    row_slots = mapping.token_slots.tolist()
    expected, size = exact(before, x, weights, row_slots)
    got = out.double()
    allowed = EPS[dtype] * expected.abs() + DOT_EPS[dtype] * size + 1e-30
    worst = float(((got - expected).abs() / allowed).max())
    assert worst <= 1.0, f"{worst:.3g} x the allowed error against float64 ({case})"
    # torch rounds h to the model dtype too: within two roundings of every term's size
    near_torch = (got - torch_out.double()).abs() <= 2 * EPS[dtype] * (expected.abs() + size) + 1e-30
    assert near_torch.all(), f"differs from the torch reference beyond its roundings ({case})"
    for t, s in enumerate(row_slots):
        assert s >= 0 or torch.equal(out[t], before[t]), f"row {t} without an adapter changed ({case})"
    if case["views"]:
        whole_before[:, 2:2 + case["n"]] = out
        assert torch.equal(whole, whole_before), "apply wrote outside the view it was handed"


@given(st.lists(st.integers(-1, 2), min_size=1, max_size=6), st.sampled_from(DTYPES), st.integers(0, 2**16),
       st.sampled_from([None, 2]))
@settings(max_examples=10)
def test_static_plan_reads_the_slots_at_apply(replay, dtype, seed, split):
    """A plan made from static device buffers (host lists describing another batch), applied
    after the buffers are rewritten, equals the eager plan of the new batch: bit-identical
    with the split fixed, within the float32 partials' reordering otherwise."""
    size = len(replay)
    g = torch.Generator().manual_seed(seed)
    x, out, weights, _ = random_layer(g, size, 40, 24, 3, 8, dtype, views=False)
    triton_lora = kernel(dtype, split=split)
    captured = mapping_of([1] * size, [-1] * size, 3, static=True)
    plan = triton_lora.plan(captured)
    captured.seq_slots.copy_(torch.tensor(replay, dtype=torch.int32))
    replayed = out.clone()
    triton_lora.apply(replayed, x, weights, plan)
    eager = out.clone()
    triton_lora.apply(eager, x, weights, triton_lora.plan(mapping_of([1] * size, replay, 3)))
    if split is not None:
        assert torch.equal(replayed, eager)
    else:
        torch.testing.assert_close(replayed, eager, rtol=2 * EPS[dtype], atol=1e-6)
    assert all(torch.equal(replayed[t], out[t]) for t, s in enumerate(replay) if s < 0)


@pytest.mark.parametrize("static", [False, True])
def test_long_segments_span_several_row_tiles(static):
    """Segments of 150 and 33 rows beside decodes: the eager plan shares each segment's tiles
    among programs, a static plan (one program per segment) walks them all; both equal the
    float64 product."""
    lengths, slots = [150, 1, 33, 2], [1, 0, -1, 2]
    g = torch.Generator().manual_seed(1)
    x, out, weights, _ = random_layer(g, sum(lengths), 24, 20, 3, 16, torch.float32, views=False)
    triton_lora = kernel(torch.float32)
    mapping = mapping_of(lengths, slots, 3, static=static)
    plan = triton_lora.plan(mapping)
    assert plan.row_programs == (1 if static else -(-150 // plan.block_m)) and 150 > 2 * plan.block_m
    before = out.clone()
    triton_lora.apply(out, x, weights, plan)
    expected, size = exact(before, x, weights, mapping.token_slots.tolist())
    allowed = EPS[torch.float32] * expected.abs() + DOT_EPS[torch.float32] * size
    assert ((out.double() - expected).abs() <= allowed).all()
    assert torch.equal(out[151:184], before[151:184])


def test_a_batch_without_adapters_launches_nothing():
    triton_lora = kernel(torch.float32)
    plan = triton_lora.plan(mapping_of([3, 1], [-1, -1], 2))
    assert plan.row_programs == 0
    g = torch.Generator().manual_seed(0)
    x, out, weights, _ = random_layer(g, 4, 16, 16, 2, 8, torch.float32, views=False)
    before = out.clone()
    triton_lora.apply(out, x, weights, plan)
    assert torch.equal(out, before)


def _ctx(device: str, auto: bool, dtype: torch.dtype = torch.bfloat16, **options) -> SelectionContext:
    return SelectionContext(device=torch.device(device), dtype=dtype, model=model_stub(64),
                            options=TritonLoraOptions(**options), max_model_len=4096, auto=auto)


def test_auto_picks_it_on_cuda_only(monkeypatch):
    """It outranks torch under ``auto`` on CUDA; on a CPU auto never picks it, even under the
    interpreter (named, it runs there)."""
    assert TritonLora.auto_priority > TorchLora.auto_priority
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonLora.unsupported_reasons(_ctx("cuda", True)) == []
    assert any("CUDA only" in r for r in TritonLora.unsupported_reasons(_ctx("cpu", True)))
    assert TritonLora.unsupported_reasons(_ctx("cpu", False)) == []


def test_refusals_say_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert any("TRITON_INTERPRET=1" in r for r in TritonLora.unsupported_reasons(_ctx("cpu", False)))
    assert any("float64" in r for r in TritonLora.unsupported_reasons(_ctx("cuda", False, torch.float64)))
    assert any("block_n must be a power of two" in r
               for r in TritonLora.unsupported_reasons(_ctx("cuda", False, block_n=48)))


@pytest.mark.parametrize("cuda_graphs", [True, False] if CUDA else [False])
def test_a_pipeline_on_cpu_takes_torch_under_auto_and_triton_when_named(tmp_path, cuda_graphs):
    """A tiny Llama with an adapter: ``lora.name: auto`` resolves to torch on the CPU;
    ``lora.name: triton`` (interpreted there) gives the eager torch kernel's greedy tokens,
    mixed with base rows. On a GPU, with decode steps replayed from CUDA graphs and without,
    for both kernels, against the eager torch reference (with graphs on, torch's captured
    expand once lost the adapters: the H200 of 2026-11-28 saw the two kernels differ). On a
    CPU, graph replay is tests/core/engine/test_lora.py's recorded-graph test."""
    pytest.importorskip("peft")
    from tessellm import LLM
    from tessellm.testing.lora import build_tiny_lora
    from tessellm.testing.models import build_tiny

    base = build_tiny("llama", tmp_path / "base")
    adapter = build_tiny_lora(base, tmp_path / "qv", rank=4, seed=1, target_modules=("q_proj", "v_proj"))

    def llm(name, graphs):
        return LLM({"model": str(base), "device": DEVICE.type, "dtype": "float32", "max_model_len": 64,
                    "cuda_graphs": graphs, "lora": {"name": name, "adapters": {"qv": str(adapter)}}})

    prompts, params = [[1, 5, 9, 33, 7], [1, 44, 12]], {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    reference = llm("torch" if CUDA else "auto", False)
    assert reference.pipeline.resolved.summary()["lora"]["name"] == "torch"
    want = [o.token_ids for o in reference.generate(prompts, params, lora=["qv", None])]
    for name in ("triton", "torch") if cuda_graphs else ("triton",):
        other = llm(name, cuda_graphs)
        assert other.pipeline.resolved.summary()["lora"]["name"] == name
        assert [o.token_ids for o in other.generate(prompts, params, lora=["qv", None])] == want, name
        if cuda_graphs:
            assert other.pipeline.runner.graphs is not None and other.pipeline.runner.graphs.lora_replays > 0
