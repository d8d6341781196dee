"""What a `quest` step costs besides its arithmetic, checked without a GPU (the causes of its
H200 slowness, issue 58; docs/benchmarks.md, "QUEST on the GPU: causes and guards"):

- a decode step reads nothing back from the device (so it never waits for the GPU, and can
  be captured in a CUDA graph): it runs whole on the meta device, where a value that must
  reach the host (``.item()``, ``.tolist()``, a boolean mask, a blocking copy) raises, its
  kernels' launches recorded, not run;
- a sparse layer launches a few kernels beyond `flash`'s dense decode (the bounds upkeep,
  the page scores, top-K, the page tables), whatever the context;
- a prompt runs the dense path: the dense backend's output bit for bit, plus the bounds
  upkeep's one launch;
- the warm-up builds every kernel variant a run of growing contexts launches (the old
  select kernel compiled a new variant each time a context's page count crossed a power of
  two, for up to minutes, inside a request's step);
- decode steps from the CUDA-graph path (static buffers, ``graph_plan``; not captured on a
  CPU) give the eager path's tokens.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from unittest import mock

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels run interpreted on a CPU

import pytest  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

pytest.importorskip("triton")

from tessellm.core.interfaces.batch import BatchMetadata  # noqa: E402
from tessellm.core.interfaces.kv import DenseKVStorage, KVLayout  # noqa: E402
from tessellm.plugins.attention.flash import FlashAttention, FlashOptions  # noqa: E402
from tessellm.plugins.attention.quest import QuestAttention, QuestOptions  # noqa: E402
from tessellm.plugins.cache.paged import key_bounds  # noqa: E402
from tessellm.plugins.cache.paged.key_bounds import BoundedDenseKVStorage  # noqa: E402
from tessellm.testing import attention as ref  # noqa: E402
from tessellm.testing.triton_variants import VariantRecorder, launch_hooks_only, triton_kernels  # noqa: E402

META = torch.device("meta")
HEADS, KV_HEADS, HEAD_DIM, BLOCK, PAGE = 8, 2, 16, 16, 4
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh"}


class LaunchCounter(TorchDispatchMode):
    """Counts the torch ops that launch work on a GPU: not views, not allocations."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in ALLOCATIONS and not name.startswith("_has"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _kernels():
    from tessellm.plugins.attention.flash import decode, prefill
    from tessellm.plugins.attention.quest import kernels
    from tessellm.plugins.cache.paged import bounds_kernel

    return triton_kernels(kernels, bounds_kernel, decode, prefill)


@pytest.fixture
def recorded(monkeypatch):
    """Every Triton kernel launches its hooks only; the bounds upkeep takes the CUDA path (its
    kernel); yields a recorder of the launches."""
    kernels = _kernels()
    for kernel in kernels:
        monkeypatch.setattr(kernel, "run", launch_hooks_only(kernel))
    monkeypatch.setattr(key_bounds, "bounds_by_kernel", lambda slots: True)
    with VariantRecorder(kernels) as rec:
        yield rec


def _meta_batch(context: int, batch: int, query: int = 1) -> BatchMetadata:
    """A step of ``batch`` sequences with ``context`` tokens each, the last ``query`` of them
    new, its tensors on the meta device (no values), its host lists real."""
    width = -(-context // BLOCK)
    tables = [list(range(i * width, (i + 1) * width)) for i in range(batch)]
    t = batch * query
    meta = dict(device=META)
    return BatchMetadata(
        input_ids=torch.empty(t, dtype=torch.long, **meta), positions=torch.empty(t, dtype=torch.long, **meta),
        query_start_loc=torch.empty(batch + 1, dtype=torch.int32, **meta),
        seq_lens=torch.empty(batch, dtype=torch.int32, **meta), slot_mapping=torch.empty(t, dtype=torch.long, **meta),
        block_tables=torch.empty(batch, width, dtype=torch.int32, **meta),
        logits_indices=torch.empty(batch, dtype=torch.long, **meta), query_lens_cpu=[query] * batch,
        seq_lens_cpu=[context] * batch, block_tables_cpu=tables, block_size=BLOCK,
        seqs=[SimpleNamespace(num_prompt_tokens=context - query - 1)] * batch, samples=[])


def _meta_storage(context: int, batch: int, bounds: bool):
    slots = (-(-context // BLOCK) * batch + 1) * BLOCK
    if not bounds:
        return DenseKVStorage(KVLayout("kv", BLOCK, torch.float16), slots, KV_HEADS, HEAD_DIM, META)
    layout = KVLayout("kv", BLOCK, torch.float16, frozenset({"key_bounds"}), PAGE)
    return BoundedDenseKVStorage(layout, slots, KV_HEADS, HEAD_DIM, META)


def _quest(budget: int = 64, device: torch.device = META, **options) -> QuestAttention:
    options = {"dense_backend": "flash", "kernel": "triton", "dense_layers": 1, **options}
    return QuestAttention(QuestOptions(token_budget=budget, **options), _model(), device, torch.float16)


def _model():
    return SimpleNamespace(**vars(ref.model_stub(HEAD_DIM)), num_kv_heads=KV_HEADS)


def _layer_step(backend, batch: BatchMetadata, storage, recorded, layer: int, graph: bool = False,
                max_seq_len: int = 0) -> tuple[list[str], list[str]]:
    """One layer's forward on the meta device: (torch ops that launch, Triton kernels launched)."""
    cache = SimpleNamespace(layout=storage.layout, scratch_block=0)
    plan = backend.graph_plan(batch, cache, max_seq_len) if graph else backend.plan(batch, cache)
    t = batch.num_tokens
    q = torch.empty(t, HEADS, HEAD_DIM, dtype=torch.float16, device=META)
    k, v = (torch.empty(t, KV_HEADS, HEAD_DIM, dtype=torch.float16, device=META) for _ in range(2))
    before = len(recorded.launches)
    with LaunchCounter() as counter:
        backend.forward(layer, q, k, v, storage, plan)
    return counter.ops, [key[0] for key in recorded.launches[before:]]


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("context", [1_000, 131_072])
def test_a_decode_step_reads_nothing_back_and_launches_a_few_kernels_beyond_flash(recorded, graph, context):
    """On the meta device (where anything read back on the host raises), the plan (eager, or
    for a CUDA graph) and a sparse layer's forward of 4 decodes run through; the layer
    launches what `flash`'s dense decode does (the store, the split-K decode, merged where
    the chosen tokens are split) plus the bounds upkeep, the page scores, torch's top-K and
    the page tables, the same at 1k and 128k tokens."""
    flash = FlashAttention(FlashOptions(), _model(), META, torch.float16)
    batch = _meta_batch(context, 4)
    storage = _meta_storage(context, 4, bounds=False)
    cache = SimpleNamespace(layout=storage.layout)
    dense_plan = flash.graph_plan(batch, cache, context) if graph else flash.plan(batch, cache)
    q = torch.empty(4, HEADS, HEAD_DIM, dtype=torch.float16, device=META)
    k, v = (torch.empty(4, KV_HEADS, HEAD_DIM, dtype=torch.float16, device=META) for _ in range(2))
    before = len(recorded.launches)
    with LaunchCounter() as counter:
        flash.forward(1, q, k, v, storage, dense_plan)
    dense_ops, dense_kernels = counter.ops, [key[0] for key in recorded.launches[before:]]

    quest = _quest()
    ops, kernels = _layer_step(quest, batch, _meta_storage(context, 4, bounds=True), recorded, 1, graph, context)
    extra = ["_page_bounds_kernel", "_score_kernel", "_table_kernel"]
    # the split-K decode, merged where the chosen pages' tokens are split (as dense's context is)
    assert sorted(k for k in kernels if k not in extra) in (["_paged_decode_split"], sorted(dense_kernels))
    assert all(kernels.count(k) == 1 for k in extra)
    assert dense_ops == ["index_copy_", "index_copy_"] and ops == dense_ops + ["topk"]


def test_a_dense_layer_of_a_decode_step_is_flash_plus_the_bounds_upkeep(recorded):
    quest = _quest()
    batch = _meta_batch(4096, 3)
    ops, kernels = _layer_step(quest, batch, _meta_storage(4096, 3, bounds=True), recorded, 0)
    assert sorted(kernels) == ["_page_bounds_kernel", "_paged_decode_merge", "_paged_decode_split"]
    assert ops == ["index_copy_", "index_copy_"]


@pytest.mark.parametrize("context", [4096, 131_072])
def test_a_prompt_runs_the_dense_path_and_its_bounds_upkeep_only(recorded, context):
    """A prompt chunk of 1,024 tokens at the end of a long prompt: no sparse group; every
    layer launches `flash`'s prefill and the bounds upkeep (one kernel, no read-back), so its
    time is dense attention's plus one pass over the chunk's pages."""
    quest = _quest()
    batch = _meta_batch(context, 1, query=1024)
    batch.seqs[0].num_prompt_tokens = context
    assert not quest.plan(batch, SimpleNamespace(layout=_meta_storage(context, 1, True).layout)).groups
    for layer in (0, 1):
        ops, kernels = _layer_step(quest, batch, _meta_storage(context, 1, bounds=True), recorded, layer)
        assert sorted(kernels) == ["_page_bounds_kernel", "_paged_flash_fwd"]
        assert ops == ["index_copy_", "index_copy_"]


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_a_prompt_gives_the_dense_backends_output_bit_for_bit(kernel):
    """Prompts and chunks after cached context, beyond the budget: `quest`'s output is its
    dense backend's (`sdpa`, or `flash` interpreted), with the same kernels on the same
    inputs, so bit for bit."""
    from tessellm.plugins.attention.sdpa import SdpaAttention, SdpaOptions

    kv_lens, q_lens = [40, 29, 50], [40, 12, 17]
    outs = []
    for name in ("dense", "quest"):
        case = ref.make_case(kv_lens, q_lens, HEADS, KV_HEADS, HEAD_DIM, 8, torch.float32, 0,
                             extras=frozenset({"key_bounds"}), page_size=4)
        case.batch.seqs = [SimpleNamespace(num_prompt_tokens=n) for n in kv_lens]
        if name == "quest":
            backend = QuestAttention(QuestOptions(token_budget=8, dense_layers=0, kernel=kernel,
                                                  dense_backend="flash" if kernel == "triton" else "sdpa"),
                                     _model(), torch.device("cpu"), torch.float32)
            plan = backend.plan(case.batch, SimpleNamespace(layout=case.storage.layout))
            assert not plan.groups
        elif kernel == "triton":
            backend = FlashAttention(FlashOptions(), _model(), torch.device("cpu"), torch.float32)
            plan = backend.plan(case.batch, None)
        else:
            backend = SdpaAttention(SdpaOptions(), _model(), torch.device("cpu"), torch.float32)
            plan = backend.plan(case.batch, None)
        outs.append(backend.forward(3, case.q, case.k_new, case.v_new, case.storage, plan))
    assert torch.equal(outs[0], outs[1])


def _llm(cpu_config, model, dtype: str = "float32", budget: int = 8, **overrides):
    from tessellm import LLM

    return LLM(cpu_config(model, device="cuda" if CUDA else "cpu", dtype=dtype,
                          attention={"name": "quest", "options": {
                              "token_budget": budget, "dense_layers": 1, "kernel": "triton", "dense_backend": "flash"}},
                          cache={"name": "paged", "options": {"block_size": 8, "bounds_page_size": 2,
                                                              "num_blocks": 96}},
                          scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 48,
                                                                       "max_num_seqs": 6}},
                          decoding={"name": "greedy"}, cuda_graphs=False, **overrides))


def test_warm_up_launches_every_kernel_variant_a_quest_run_launches(tiny_model, cpu_config, monkeypatch):
    """After the warm-up (and the graph path's capture), a run whose contexts grow past
    several powers of two in pages, in mixed and pure decode steps, eager and replayed,
    launches no kernel variant the warm-up did not: no compile inside a request's step.
    Kernels record their variant keys without running (bfloat16, as on a GPU)."""
    from tessellm.core.engine.warm_up import warm_up
    from tessellm.core.model import fused_ops

    kernels = _kernels() + triton_kernels(fused_ops)
    if not CUDA:
        for kernel in kernels:
            monkeypatch.setattr(kernel, "run", launch_hooks_only(kernel))
    monkeypatch.setattr(key_bounds, "bounds_by_kernel", lambda slots: True)
    max_len = 200
    llm = _llm(cpu_config, tiny_model("llama"), "bfloat16", max_model_len=max_len)
    llm.engine._kv_check.armed = False  # nothing is stored by the kernels
    pipeline = llm.pipeline
    with VariantRecorder(kernels) as rec:
        assert warm_up(pipeline.runner, pipeline.scheduler.max_step_tokens, max_len) == 5
        assert {"_score_kernel", "_table_kernel", "_page_bounds_kernel"} <= rec.names()  # eager decodes too
        pipeline.runner.capture_graphs(max_batch=4, max_model_len=max_len, capture=CUDA)
        warm = set(rec.seen)
        g = torch.Generator().manual_seed(0)
        lens = (150, 3, 20, 70, 9, 33)  # pages: 75 down to 2; decodes cross 16, 32, 64 and 128 pages
        prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lens]
        params = [{"max_tokens": m, "ignore_eos": True} for m in (40, 6, 50, 30, 20, 40)]
        llm.generate(prompts, params)
        assert pipeline.runner.graphs.replays > 0
    assert not rec.seen - warm, f"variants first launched after warm-up: {sorted(rec.seen - warm)}"
    assert {"_score_kernel", "_table_kernel", "_page_bounds_kernel", "_paged_decode_split"} <= rec.names()


def test_graph_decode_steps_give_the_eager_tokens(tiny_model, cpu_config):
    """The CUDA-graph path (static padded buffers refilled each step, ``graph_plan``: every row
    through the sparse kernels, short contexts attending all their pages) gives the eager
    path's greedy tokens, kernels interpreted (not captured) on a CPU; no block leaks."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (22, 5, 14)]
    params = [{"max_tokens": m, "ignore_eos": True} for m in (4, 6, 3)]
    eager = _llm(cpu_config, model)
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    graphed = _llm(cpu_config, model)
    graphed.pipeline.runner.capture_graphs(max_batch=4, max_model_len=64, capture=CUDA)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == expected
    assert graphed.pipeline.runner.graphs.replays >= 3
    cache = graphed.pipeline.cache
    assert cache.num_free_blocks == cache.num_blocks
