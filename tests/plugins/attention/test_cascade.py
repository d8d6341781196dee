"""`cascade` against the float64 softmax(QK^T)V reference, on packed batches whose decodes
share leading blocks (as prefix caching and parallel sampling leave them) and on ones that
share nothing."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from tessellm.plugins.attention.cascade import CascadeAttention, CascadeOptions, _Cascade
from tessellm.testing import attention as ref

TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}


@st.composite
def shared_prefix_batches(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    shared_blocks = draw(st.integers(0, 6))
    num_seqs = draw(st.integers(1, 6))
    base = shared_blocks * block_size
    # most sequences extend past the shared prefix; some are shorter and share nothing
    kv_lens = [draw(st.one_of(st.integers(base + 1, base + 40), st.integers(1, 40))) for _ in range(num_seqs)]
    q_lens = [draw(st.sampled_from([1, 1, 1, draw(st.integers(1, n))])) for n in kv_lens]
    num_kv_heads = draw(st.integers(1, 3))
    return dict(kv_lens=kv_lens, q_lens=q_lens, num_kv_heads=num_kv_heads,
                num_heads=num_kv_heads * draw(st.sampled_from([1, 2, 3])),
                head_dim=draw(st.sampled_from([16, 64])), block_size=block_size, shared_blocks=shared_blocks,
                min_shared=draw(st.sampled_from([1, 8, 64])), window=draw(st.one_of(st.none(), st.integers(1, 16))),
                dtype=draw(st.sampled_from([torch.float64, torch.float32])), seed=draw(st.integers(0, 2**16)))


@given(shared_prefix_batches())
def test_cascade_matches_float64_reference(p):
    case = ref.make_case(p["kv_lens"], p["q_lens"], p["num_heads"], p["num_kv_heads"], p["head_dim"],
                         p["block_size"], p["dtype"], p["seed"], shared_blocks=p["shared_blocks"])
    backend = CascadeAttention(CascadeOptions(min_shared_tokens=p["min_shared"]),
                               ref.model_stub(p["head_dim"], p["window"]), torch.device("cpu"), p["dtype"])
    plan = backend.plan(case.batch, cache=None)
    out = backend.forward(0, case.q, case.k_new, case.v_new, case.storage, plan)
    expected = ref.reference_packed(case, p["head_dim"] ** -0.5, p["window"])
    assert out.shape == case.q.shape and out.dtype == p["dtype"]
    assert not out.isnan().any()
    assert (out.double() - expected).abs().max().item() <= TOLERANCE[p["dtype"]]


def test_decodes_sharing_a_prefix_attend_it_once():
    # four decodes share 3 blocks of 4 tokens; a fifth shares nothing
    case = ref.make_case([20, 17, 13, 30, 9], [1, 1, 1, 1, 1], 4, 2, 16, 4, torch.float64, 0, shared_blocks=3)
    backend = CascadeAttention(CascadeOptions(min_shared_tokens=4), ref.model_stub(16), torch.device("cpu"),
                               torch.float64)
    plan = backend.plan(case.batch, cache=None)
    cascades = [g for g in plan.groups if isinstance(g, _Cascade)]
    assert len(cascades) == 1 and cascades[0].rows.tolist() == [0, 1, 2, 3]
    assert cascades[0].prefix_slots.numel() == 12
    out = backend.forward(0, case.q, case.k_new, case.v_new, case.storage, plan)
    assert (out - ref.reference_packed(case, 16 ** -0.5)).abs().max().item() <= 1e-12
