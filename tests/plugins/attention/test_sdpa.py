"""`sdpa` against the float64 softmax(QK^T)V reference over random packed batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tessellm.plugins.attention.sdpa import SdpaAttention, SdpaOptions
from tessellm.testing import attention as ref

TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}


@st.composite
def packed_batches(draw):
    num_seqs = draw(st.integers(1, 5))
    kv_lens = draw(st.lists(st.integers(1, 70), min_size=num_seqs, max_size=num_seqs))
    # mix decodes (1), chunks of a prompt with earlier context, and whole prompts
    q_lens = [draw(st.sampled_from([1, n, draw(st.integers(1, n))])) for n in kv_lens]
    num_kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    return dict(kv_lens=kv_lens, q_lens=q_lens, num_kv_heads=num_kv_heads, num_heads=num_kv_heads * group,
                head_dim=draw(st.sampled_from([32, 48, 64, 80, 96, 128])),
                block_size=draw(st.sampled_from([1, 4, 16, 32])),
                window=draw(st.one_of(st.none(), st.integers(1, 24))),
                batch_decode=draw(st.booleans()), dtype=draw(st.sampled_from([torch.float64, torch.float32])),
                seed=draw(st.integers(0, 2**16)))


@given(packed_batches())
def test_sdpa_matches_float64_reference(p):
    case = ref.make_case(p["kv_lens"], p["q_lens"], p["num_heads"], p["num_kv_heads"], p["head_dim"],
                         p["block_size"], p["dtype"], p["seed"])
    backend = SdpaAttention(SdpaOptions(batch_decode=p["batch_decode"]), ref.model_stub(p["head_dim"], p["window"]),
                            torch.device("cpu"), p["dtype"])
    plan = backend.plan(case.batch, cache=None)
    out = backend.forward(0, case.q, case.k_new, case.v_new, case.storage, plan)
    expected = ref.reference_packed(case, p["head_dim"] ** -0.5, p["window"])
    assert out.shape == case.q.shape and out.dtype == p["dtype"]
    err = (out.double() - expected).abs().max().item()
    assert err <= TOLERANCE[p["dtype"]], f"max abs error {err:.3g}"
    # the new tokens were stored where the slot mapping says
    k_back, v_back = case.storage.gather(case.batch.slot_mapping)
    assert torch.equal(k_back, case.k_new) and torch.equal(v_back, case.v_new)


def test_plan_is_shared_by_layers():
    """One plan serves every layer: running two layers against it gives each its own result."""
    case = ref.make_case([9, 5], [1, 5], 4, 2, 32, 4, torch.float64, seed=1)
    backend = SdpaAttention(SdpaOptions(), ref.model_stub(32), torch.device("cpu"), torch.float64)
    plan = backend.plan(case.batch, cache=None)
    first = backend.forward(0, case.q, case.k_new, case.v_new, case.storage, plan)
    second = backend.forward(1, case.q, case.k_new, case.v_new, case.storage, plan)
    assert torch.equal(first, second)


@pytest.mark.parametrize("kv_lens,window,all_rows,masked", [
    ([37], None, [True], [False]),
    ([20, 20, 20], None, [True], [False]),
    ([20, 20, 20], 6, [True], [True]),  # the window needs the mask
    ([20, 17], None, [True], [True]),  # one bucket, two lengths: padding masked
    ([20, 9], None, [False, False], [False, False]),  # two buckets, a sequence each
])
def test_decodes_of_one_length_skip_the_mask_and_the_row_scatter(kv_lens, window, all_rows, masked):
    """Decodes whose contexts are equally long see every key: their group has no mask (unless
    a window needs one); a group holding every row of the step in order is returned as SDPA
    wrote it, without a gather or a scatter of rows. The reference's result either way."""
    case = ref.make_case(kv_lens, [1] * len(kv_lens), 4, 2, 32, 4, torch.float64, seed=3)
    backend = SdpaAttention(SdpaOptions(), ref.model_stub(32, window), torch.device("cpu"), torch.float64)
    plan = backend.plan(case.batch, cache=None)
    assert [g.all_rows for g in plan.groups] == all_rows
    assert [g.mask is not None for g in plan.groups] == masked
    out = backend.forward(0, case.q, case.k_new, case.v_new, case.storage, plan)
    expected = ref.reference_packed(case, 32 ** -0.5, window)
    assert (out - expected).abs().max().item() <= 1e-10
