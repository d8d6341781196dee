"""`quest` (QUEST sparse decode attention): its block scores bound every q . k inside a
block; selection keeps the forced blocks and the best-scored others; within the budget it is
exactly `sdpa`; above it, each query equals the float64 reference restricted to the blocks
chosen for its KV head; the first ``dense_layers`` layers and long prefill chunks run dense;
and whole pipelines (chunked prefill, speculative decoding, int8 K/V) run through it."""

from __future__ import annotations

import os
from types import SimpleNamespace
from unittest import mock

CUDA_AVAILABLE = __import__("torch").cuda.is_available()
if not CUDA_AVAILABLE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton decode path, interpreted on a CPU

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tessellm.core.errors import ConfigError
from tessellm.plugins.attention.quest import QuestAttention, QuestOptions
from tessellm.plugins.attention.quest import backend as quest_backend
from tessellm.plugins.attention.quest.select import block_scores, select_blocks
from tessellm.plugins.attention.sdpa import SdpaAttention, SdpaOptions
from tessellm.testing import attention as ref

BOUNDS = frozenset({"key_bounds"})
# The Triton paths' tests run their kernels here: compiled on a GPU, interpreted on a CPU.
DEVICE = torch.device("cuda" if CUDA_AVAILABLE else "cpu")


@settings(max_examples=30)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 6), st.integers(1, 9), st.sampled_from([1, 4, 16]),
       st.integers(0, 2**16))
def test_a_block_score_bounds_every_key_in_it(batch, group, rows, num_blocks, bs, seed):
    g = torch.Generator().manual_seed(seed)
    hkv, d = 2, 8
    keys = torch.randn(batch, num_blocks, bs, hkv, d, generator=g, dtype=torch.float64) * 2
    q = torch.randn(batch, rows, hkv, group, d, generator=g, dtype=torch.float64)
    scores = block_scores(q, keys.amin(dim=2), keys.amax(dim=2))  # [B, R, Hkv, G, N]
    dots = torch.einsum("brhgd,bnkhd->brhgnk", q, keys).amax(dim=-1)  # the largest q.k per block
    assert scores.shape == dots.shape
    assert (scores >= dots - 1e-9).all()
    # the bound is tight for a block of one key
    single = block_scores(q, keys[:, :, 0], keys[:, :, 0])
    assert torch.allclose(single, torch.einsum("brhgd,bnhd->brhgn", q, keys[:, :, 0]))


@settings(max_examples=30)
@given(st.integers(2, 12), st.integers(1, 12), st.integers(0, 2**16), st.data())
def test_selection_keeps_forced_blocks_then_the_best(num_blocks, num_chosen, seed, data):
    g = torch.Generator().manual_seed(seed)
    valid = data.draw(st.integers(1, num_blocks))
    scores = torch.randn(1, 1, 2, 1, num_blocks, generator=g)
    block_ok = torch.arange(num_blocks)[None, :] < valid
    forced = block_ok & ((torch.arange(num_blocks) == 0) | (torch.arange(num_blocks) == valid - 1))[None, :]
    num_chosen = max(num_chosen, int(forced.sum()))
    index, ok = select_blocks(scores, block_ok, forced, torch.tensor([num_chosen]))
    assert index.shape[-1] == min(num_chosen, num_blocks)
    for head in range(2):
        chosen = set(index[0, head][ok[0, head]].tolist())
        assert {0, valid - 1} <= chosen and all(c < valid for c in chosen)
        assert len(chosen) == min(num_chosen, valid)
        rest = [c for c in range(1, valid - 1)]
        best = sorted(rest, key=lambda c: -scores[0, 0, head, 0, c].item())[:len(chosen) - len({0, valid - 1})]
        assert chosen == {0, valid - 1} | set(best)
        assert index[0, head].tolist() == sorted(index[0, head].tolist())


def quest(budget: int, head_dim: int = 16, dense_layers: int = 0, max_query_len: int = 16, kernel: str = "torch",
          dtype: torch.dtype = torch.float32, dense_backend: str = "sdpa",
          device: torch.device = torch.device("cpu")) -> QuestAttention:
    return QuestAttention(QuestOptions(token_budget=budget, dense_layers=dense_layers, max_query_len=max_query_len,
                                       kernel=kernel, dense_backend=dense_backend),
                          ref.model_stub(head_dim), device, dtype)


def bounded_case(kv_lens, q_lens, heads=(4, 2), head_dim=16, block_size=4, seed=0, dtype=torch.float32, page=None):
    return ref.make_case(kv_lens, q_lens, heads[0], heads[1], head_dim, block_size, dtype, seed, extras=BOUNDS,
                         page_size=page)


@settings(max_examples=20)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.integers(0, 2**16), st.data())
def test_within_the_budget_it_is_sdpa(kv_lens, seed, data):
    """Every context within the budget (prefills, chunks, decodes, verifications): the
    output is `sdpa`'s, bit for bit."""
    q_lens = [data.draw(st.integers(1, n)) for n in kv_lens]
    case = bounded_case(kv_lens, q_lens, seed=seed)
    backend = quest(data.draw(st.integers(max(kv_lens), 200)))
    ours = backend.forward(3, case.q, case.k_new, case.v_new, case.storage, backend.plan(case.batch, None))
    case = bounded_case(kv_lens, q_lens, seed=seed)
    sdpa = SdpaAttention(SdpaOptions(), ref.model_stub(16), torch.device("cpu"), torch.float32)
    theirs = sdpa.forward(3, case.q, case.k_new, case.v_new, case.storage, sdpa.plan(case.batch, None))
    assert torch.equal(ours, theirs)


def restricted_reference(case, seq: int, row0: int, chosen: torch.Tensor, chosen_ok: torch.Tensor,
                         block_size: int, scale: float) -> torch.Tensor:
    """float64 attention of sequence ``seq``'s query rows over, per KV head, only the blocks
    ``chosen`` [Hkv, K] (``chosen_ok`` marks real ones)."""
    k, v = case.k_full[seq].double(), case.v_full[seq].double()
    n_kv, n_q = case.kv_lens[seq], case.q_lens[seq]
    q = case.q[row0:row0 + n_q].double()
    hkv = k.shape[1]
    group = q.shape[1] // hkv
    out = torch.empty_like(q)
    for h in range(hkv):
        blocks = chosen[h][chosen_ok[h]]
        pos = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
        pos = pos[pos < n_kv]
        for r in range(n_q):
            q_pos = n_kv - n_q + r
            seen = pos[pos <= q_pos]
            for j in range(group):
                head = h * group + j
                w = torch.softmax(k[seen, h] @ q[r, head] * scale, dim=0)
                out[r, head] = w @ v[seen, h]
    return out


@settings(max_examples=25)
@given(st.lists(st.integers(9, 60), min_size=1, max_size=3), st.sampled_from([(4, 2), (4, 4), (8, 1)]),
       st.sampled_from([4, 8, 12]), st.sampled_from([(4, 4), (8, 4), (8, 2)]), st.integers(0, 2**16), st.data())
def test_above_the_budget_each_query_attends_its_chosen_blocks(kv_lens, heads, budget, pages, seed, data):
    """Decodes and speculative verifications (up to 4 rows) over contexts beyond the budget,
    pages of the cache's blocks or parts of them: the output equals the float64 reference
    over the pages chosen for each KV head, and those are the first page, the pages of the
    query positions and budget-many in all; a decode's others are the best scored."""
    from types import SimpleNamespace

    block, bs = pages  # cache block, key-bounds page: QUEST's unit
    q_lens = [data.draw(st.integers(1, min(4, n - 1))) for n in kv_lens]
    case = bounded_case(kv_lens, q_lens, heads=heads, seed=seed, block_size=block, page=bs)
    picked, selected = [], []
    real_pick, real_select = quest_backend.pick_pages, quest_backend.select_blocks

    def recording_pick(scores, num_picks):
        picks = real_pick(scores, num_picks)
        picked.append((scores, picks))
        return picks

    def recording_select(*args):
        index, ok = real_select(*args)
        selected.append((index, ok))
        return index, ok

    backend = quest(budget)
    cache = SimpleNamespace(layout=case.storage.layout)
    with mock.patch.object(quest_backend, "pick_pages", recording_pick), \
            mock.patch.object(quest_backend, "select_blocks", recording_select):
        out = backend.forward(5, case.q, case.k_new, case.v_new, case.storage, backend.plan(case.batch, cache))
    sparse = [i for i, n in enumerate(kv_lens) if n > budget and -(-n // bs) > max(budget // bs, 1)]
    decodes = [i for i in sparse if q_lens[i] == 1]
    verifies = [i for i in sparse if q_lens[i] > 1]
    row0 = [sum(q_lens[:i]) for i in range(len(kv_lens))]
    expected_all = ref.reference_packed(case, 16 ** -0.5)
    assert len(picked) == bool(decodes) and len(selected) == bool(verifies)
    table = max(budget // bs, 2)
    for j, i in enumerate(decodes):  # the picks (any order), then the newest page
        scores, picks = picked[0]
        num_pages = -(-kv_lens[i] // bs)
        chosen = torch.cat([picks[j].sort(-1).values, torch.full((heads[1], 1), num_pages - 1)], dim=-1)
        for h in range(heads[1]):
            cols = chosen[h].tolist()
            assert len(set(cols)) == table and 0 in cols and cols[-1] == num_pages - 1
            rest = sorted(range(1, num_pages - 1), key=lambda c: -scores[j, h, c].item())
            assert set(cols[1:-1]) == set(rest[:table - 2])
        expected = restricted_reference(case, i, row0[i], chosen, torch.ones_like(chosen, dtype=torch.bool), bs,
                                        16 ** -0.5)
        assert (out[row0[i]:row0[i] + 1].double() - expected).abs().max() < 2e-5, i
    for j, i in enumerate(verifies):
        index, ok = selected[0]
        first_query_block = (kv_lens[i] - q_lens[i]) // bs
        for h in range(heads[1]):
            chosen = set(index[j, h][ok[j, h]].tolist())
            assert 0 in chosen and set(range(first_query_block, -(-kv_lens[i] // bs))) <= chosen
            assert len(chosen) == min(max(budget // bs, 1 + len(range(first_query_block, -(-kv_lens[i] // bs)))),
                                      -(-kv_lens[i] // bs))
        expected = restricted_reference(case, i, row0[i], index[j], ok[j], bs, 16 ** -0.5)
        got = out[row0[i]:row0[i] + q_lens[i]].double()
        assert (got - expected).abs().max() < 2e-5, i
    for i in range(len(kv_lens)):
        if i not in sparse:
            got = out[row0[i]:row0[i] + q_lens[i]].double()
            assert (got - expected_all[row0[i]:row0[i] + q_lens[i]]).abs().max() < 2e-5


@settings(max_examples=12)
@given(st.lists(st.integers(9, 70), min_size=1, max_size=3), st.sampled_from([(4, 2), (8, 1), (2, 2)]),
       st.sampled_from([4, 8, 16]), st.sampled_from(["float32", "bfloat16", "int8"]), st.integers(0, 2**16))
def test_the_triton_decode_reads_the_chosen_blocks_as_the_torch_path_does(kv_lens, heads, budget, storage, seed):
    """Decodes beyond the budget through `flash`'s split-K kernel over per-head tables of the
    chosen blocks (interpreted on a CPU): the torch path's output (float32: to rounding;
    bfloat16: within its rounding; int8 K/V dequantized in the kernel). Unwritten slots hold
    NaN, so a read past a head's chosen tokens would show."""
    dtype = torch.bfloat16 if storage == "bfloat16" else torch.float32
    outs = []
    for kernel in ("torch", "triton"):
        case = bounded_case(kv_lens, [1] * len(kv_lens), heads=heads, seed=seed, dtype=dtype)
        if storage == "int8":
            case = ref.int8_case(case, key_bounds=True)
        device = DEVICE if kernel == "triton" else torch.device("cpu")
        case = ref.case_to(case, device)
        backend = quest(budget, kernel=kernel, dtype=dtype, device=device)
        outs.append(backend.forward(4, case.q, case.k_new, case.v_new, case.storage,
                                    backend.plan(case.batch, None)).cpu())
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert torch.isfinite(outs[1]).all()
    assert (outs[0].float() - outs[1].float()).abs().max() <= tol


@settings(max_examples=15)
@given(st.lists(st.integers(1, 90), min_size=1, max_size=3), st.sampled_from([(4, 2), (8, 1), (2, 2)]),
       st.sampled_from([(4, 4), (8, 2), (4, 1)]), st.integers(2, 9), st.sampled_from(["float32", "bfloat16"]),
       st.integers(0, 2**16))
def test_the_triton_scores_and_tables_are_the_torch_references(kv_lens, heads, pages, num_picks, dtype, seed):
    """The score kernel gives ``decode_page_scores`` (+inf first page, -inf newest and past
    the context, each page's bound over the query heads; a score column past every context
    too), and the table kernel turns the same picks into ``decode_page_tables``' pages and
    lengths exactly: the picks' page ids then the newest, or every page of a short context."""
    from tessellm.plugins.attention.quest.kernels import page_tables, score_pages
    from tessellm.plugins.attention.quest.select import DecodePages, decode_page_scores, decode_page_tables, pick_pages

    block, page = pages
    dt = getattr(torch, dtype)
    case = ref.case_to(bounded_case(kv_lens, [1] * len(kv_lens), heads=heads, seed=seed, block_size=block,
                                    page=page, dtype=dt), DEVICE)
    kmin, kmax = case.storage.key_bounds()
    batch = case.batch
    rows = batch.query_start_loc[:-1].contiguous()
    tables = batch.block_tables.to(torch.int32)
    num_cols = -(-max(kv_lens) // page) + 3
    pages = DecodePages.of(tables, batch.seq_lens, page, block // page, num_cols)
    got = score_pages(case.q, rows, tables, batch.seq_lens, kmin, kmax, page, block // page, num_cols)
    want = decode_page_scores(case.q, rows, pages, kmin, kmax)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got > 0, want > 0)
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite].cpu(), want[finite].float().cpu(), rtol=1e-5, atol=1e-4 if dtype == "float32" else 1e-2)
    picks = pick_pages(want, min(num_picks, num_cols - 1))
    got_pages, got_lens = page_tables(picks, tables, batch.seq_lens, page, block // page)
    want_pages, want_lens = decode_page_tables(picks, pages)
    assert torch.equal(got_lens.long(), want_lens)
    used = torch.arange(want_pages.shape[-1], device=DEVICE) < -(-want_lens[..., None] // page)
    assert torch.equal(got_pages.long()[used], want_pages[used])


@settings(max_examples=10)
@given(st.lists(st.integers(1, 70), min_size=1, max_size=4), st.sampled_from([4, 8, 24]), st.integers(0, 2**16),
       st.data())
def test_flash_as_the_dense_backend_gives_the_sdpa_backends_output(kv_lens, budget, seed, data):
    """``dense_backend: flash`` (interpreted here): mixed batches of prompts, chunks, decodes
    and verifications, within and beyond the budget, dense and sparse layers: the output of
    the `sdpa`-backed configuration, to float32 rounding."""
    q_lens = [data.draw(st.sampled_from([1, n, min(3, n)])) for n in kv_lens]
    layer = data.draw(st.sampled_from([0, 3]))
    outs = []
    for dense_backend, kernel in (("sdpa", "torch"), ("flash", "triton")):
        device = DEVICE if kernel == "triton" else torch.device("cpu")
        case = ref.case_to(bounded_case(kv_lens, q_lens, seed=seed), device)
        backend = quest(budget, dense_layers=2, kernel=kernel, dense_backend=dense_backend, device=device)
        outs.append(backend.forward(layer, case.q, case.k_new, case.v_new, case.storage,
                                    backend.plan(case.batch, None)).cpu())
        ref.assert_stored(ref.case_to(case, "cpu"))
    assert (outs[0] - outs[1]).abs().max() <= 2e-5


def test_dense_layers_and_long_chunks_run_dense():
    """Layers below ``dense_layers`` attend densely even beyond the budget; so does a query
    longer than ``max_query_len`` (a prefill chunk)."""
    case = bounded_case([40, 40], [1, 9])
    expected = ref.reference_packed(case, 16 ** -0.5)
    backend = quest(8, dense_layers=2, max_query_len=4)
    plan = backend.plan(case.batch, None)
    dense = backend.forward(1, case.q, case.k_new, case.v_new, case.storage, plan)
    assert (dense.double() - expected).abs().max() < 2e-5
    sparse = backend.forward(2, case.q, case.k_new, case.v_new, case.storage, plan)
    assert (sparse[1:].double() - expected[1:]).abs().max() < 2e-5  # the 9-row chunk: dense
    assert (sparse[0].double() - expected[0]).abs().max() > 1e-4  # the decode: 2 of its 10 blocks


def test_quest_needs_key_bounds_and_no_window(cpu_config, tiny_model):
    from tessellm import LLM

    with pytest.raises(ConfigError, match="key_bounds"):
        LLM(cpu_config(tiny_model("llama"), attention={"name": "quest"}, cache={"name": "contiguous"}))
    with pytest.raises(ConfigError, match="does not serve a sliding window \\(layer feature 'sliding_window'\\), "
                                          "which 'mistral' needs on layers 0, 1"):
        LLM(cpu_config(tiny_model("mistral"), attention={"name": "quest"}, cache={"name": "paged"}))


def test_a_decode_at_128k_tokens_in_pages_of_2_runs_and_no_kernel_depends_on_the_context():
    """No context is too long for the decode path: nothing about it is a compile-time
    constant (a longer context never builds another kernel variant; a 65,536-page sort took
    Triton minutes to compile before), and one decode over 131,072 tokens in pages of 2 runs
    in torch (tiny heads) and picks the budget's pages."""
    from types import SimpleNamespace

    from tessellm.plugins.attention.quest import kernels
    from tessellm.plugins.attention.quest.select import pick_pages
    from tessellm.testing.triton_variants import VariantRecorder

    seen = []
    for context in (40, 700, 3000):
        case = ref.case_to(bounded_case([context], [1], heads=(2, 1), head_dim=16, block_size=16, page=2), DEVICE)
        kmin, kmax = case.storage.key_bounds()
        batch, tables = case.batch, case.batch.block_tables.to(torch.int32)
        rows = batch.query_start_loc[:-1].contiguous()
        with VariantRecorder([kernels._score_kernel, kernels._table_kernel]) as rec:
            scores = kernels.score_pages(case.q, rows, tables, batch.seq_lens, kmin, kmax, 2, 8, -(-context // 2))
            kernels.page_tables(pick_pages(scores, 7), tables, batch.seq_lens, 2, 8)
        seen.append(rec.seen)
    assert seen[0] == seen[1] == seen[2] and len(seen[0]) == 2
    case = bounded_case([131072], [1], heads=(2, 1), head_dim=8, block_size=16, page=2)
    backend = quest(2048, head_dim=8)
    plan = backend.plan(case.batch, SimpleNamespace(layout=case.storage.layout))
    group, = plan.groups
    assert group.num_cols == 65536 and group.num_picks == 1023
    out = backend.forward(5, case.q, case.k_new, case.v_new, case.storage, plan)
    assert torch.isfinite(out).all()


def test_a_context_beyond_what_the_score_grid_holds_is_refused_at_selection():
    """The only context limit left: the score kernel's grid (65,535 tiles of 64 pages per
    sequence, CUDA's limit), refused at selection with the way out, never a failure mid-step."""
    from tessellm.core.interfaces.kv import KVLayout
    from tessellm.core.plugin import SelectionContext
    from tessellm.plugins.attention.quest.kernels import MAX_SCORE_PROGRAMS, SCORE_TILE

    most = MAX_SCORE_PROGRAMS * SCORE_TILE

    def reasons(max_len, page):
        ctx = SelectionContext(device=torch.device("cpu"), dtype=torch.float32, options=QuestOptions(kernel="triton"),
                               model=SimpleNamespace(head_dim=16, sliding_window=None), max_model_len=max_len,
                               kv_layout=KVLayout("kv", 16, torch.float32, BOUNDS, page))
        return [r for r in QuestAttention.unsupported_reasons(ctx) if "pages per sequence" in r]

    assert not reasons(2 * most, 2) and not reasons(1 << 20, 1)
    reason, = reasons(2 * most + 1, 2)
    assert f"max_model_len {2 * most + 1} at pages of 2 tokens" in reason and "set kernel: torch" in reason


def _llm(cpu_config, tiny_model, attention, budget=None, **overrides):
    from tessellm import LLM

    options = {"token_budget": budget, "dense_layers": 1} if attention == "quest" else {}
    cache = overrides.pop("cache_options", {})
    return LLM(cpu_config(tiny_model("llama"), attention={"name": attention, "options": options},
                          cache={"name": "paged", "options": {"block_size": 4, "num_blocks": 256, **cache}},
                          scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 32}}, **overrides))


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_whole_model_within_the_budget_equals_sdpa(cpu_config, tiny_model, kv_dtype):
    """Chunked prefill and decode through the paged cache (float or int8 K/V): with a budget
    above every context, the tokens and logits of `sdpa`."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (50, 7, 23)]
    params = {"max_tokens": 8, "ignore_eos": True}
    quest_llm = _llm(cpu_config, tiny_model, "quest", 4096, cache_options={"kv_dtype": kv_dtype})
    sdpa_llm = _llm(cpu_config, tiny_model, "sdpa", cache_options={"kv_dtype": kv_dtype})
    assert quest_llm.pipeline.cache.layout.extras == BOUNDS
    assert [o.token_ids for o in quest_llm.generate(prompts, params)] == \
        [o.token_ids for o in sdpa_llm.generate(prompts, params)]


@pytest.mark.parametrize("decoding", ["greedy", "speculative"])
def test_whole_model_beyond_the_budget_runs_and_frees_every_block(cpu_config, tiny_model, decoding):
    """A budget of two blocks over 60-token contexts, through chunked prefill, preemption-free
    decode and (speculative) verification of drafted tokens: every request finishes with its
    tokens, the cache gets every block back, and the first tokens (prefill, dense) equal
    `sdpa`'s."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (60, 45)]
    params = {"max_tokens": 6, "ignore_eos": True}
    dec = ({"name": "speculative", "options": {"proposer": "layer-skip", "k": 3, "adaptive_k": False}}
           if decoding == "speculative" else {"name": "greedy"})
    llm = _llm(cpu_config, tiny_model, "quest", 8, decoding=dec)
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [6, 6]
    dense = _llm(cpu_config, tiny_model, "sdpa").generate(prompts, {**params, "max_tokens": 1})
    assert [o.token_ids[0] for o in outs] == [o.token_ids[0] for o in dense]
    cache = llm.pipeline.cache
    assert cache.num_free_blocks == cache.num_blocks


def test_whole_model_triton_decode_gives_the_torch_paths_tokens(cpu_config, tiny_model):
    """Beyond the budget, the Triton path (scoring, selection, sparse decode over tables of
    pages, half blocks here, and `flash` attending densely; interpreted here) and the torch
    path (`sdpa` dense) give the same greedy tokens."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (60, 37)]
    params = {"max_tokens": 5, "ignore_eos": True}

    def tokens(kernel, dense_backend):
        from tessellm import LLM

        llm = LLM(cpu_config(tiny_model("llama"), attention={"name": "quest", "options": {
            "token_budget": 8, "dense_layers": 1, "kernel": kernel, "dense_backend": dense_backend}},
            cache={"name": "paged", "options": {"block_size": 8, "bounds_page_size": 4, "num_blocks": 256}}))
        return [o.token_ids for o in llm.generate(prompts, params)]

    assert tokens("triton", "flash") == tokens("torch", "sdpa")


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_an_observer_sees_each_sparse_layers_chosen_blocks(cpu_config, tiny_model, kernel, monkeypatch):
    """``observe_selection``: per sparse layer and sequence, each KV head's chosen blocks as
    logical block indices: the budget's count, the first and the newest among them; the
    Triton path (interpreted) reports what the torch path chooses."""
    from tessellm import LLM

    if kernel == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (60, 37)]
    seen: dict[str, list] = {}

    def observer(layer, seqs, blocks):
        for seq, heads in zip(seqs, blocks):
            seen.setdefault(kernel, []).append((layer, len(seq.token_ids), seq.num_prompt_tokens, heads))

    llm = LLM(cpu_config(tiny_model("llama"), attention={"name": "quest", "options": {
        "token_budget": 8, "dense_layers": 1, "kernel": kernel}},
        cache={"name": "paged", "options": {"block_size": 4, "num_blocks": 256}}))
    llm.pipeline.attention.observe_selection(observer)
    llm.generate(prompts, {"max_tokens": 4, "ignore_eos": True})
    records = seen[kernel]
    assert {layer for layer, *_ in records} == {1}  # the tiny model's layer 0 runs dense
    for _, length, prompt, heads in records:
        newest = (length - 1) // 4  # the query's block: the last token, not yet appended, is at length - 1
        assert len(heads) == 2 and all(len(h) == 2 and 0 in h and newest in h for h in heads), heads
    llm.pipeline.attention.observe_selection(None)
    llm.generate(prompts[:1], {"max_tokens": 2, "ignore_eos": True})
    assert len(seen[kernel]) == len(records)
