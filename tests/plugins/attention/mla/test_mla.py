"""Attention `mla` against the float64 first-principles reference: the naive, absorbed and
automatic forms (and the Triton decode kernel through the backend, interpreted on a CPU) on
random packed batches that mix decodes, prefill chunks over a cached context and whole
prompts, over scattered latent caches with shared prefix blocks and NaN in every unwritten
slot."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tessellm.core.interfaces.kv import KVLayout, LatentKVStorage, dense_storage
from tessellm.plugins.attention.mla.backend import MlaAttention, MlaOptions
from tessellm.testing import attention as ref

TOLERANCE = {torch.float64: 1e-10, torch.float32: 5e-5}


@st.composite
def latent_batches(draw):
    num_seqs = draw(st.integers(1, 4))
    kv_lens = draw(st.lists(st.integers(1, 60), min_size=num_seqs, max_size=num_seqs))
    # decodes (1), chunks of a prompt after a cached context, and whole prompts
    q_lens = [draw(st.sampled_from([1, n, draw(st.integers(1, n))])) for n in kv_lens]
    return dict(kv_lens=kv_lens, q_lens=q_lens, num_heads=draw(st.integers(1, 5)),
                kv_lora_rank=draw(st.sampled_from([16, 24, 32])), rope_dim=draw(st.sampled_from([8, 16])),
                nope_dim=draw(st.sampled_from([8, 16])), v_dim=draw(st.sampled_from([8, 24])),
                block_size=draw(st.sampled_from([1, 4, 16])), shared_blocks=draw(st.sampled_from([0, 0, 1, 2])),
                dtype=draw(st.sampled_from([torch.float64, torch.float32])), seed=draw(st.integers(0, 2**16)))


def make(p) -> ref.LatentCase:
    return ref.make_latent_case(p["kv_lens"], p["q_lens"], p["num_heads"], p["kv_lora_rank"], p["rope_dim"],
                                p["nope_dim"], p["v_dim"], p["block_size"], p["dtype"], p["seed"],
                                shared_blocks=p["shared_blocks"])


def run(case: ref.LatentCase, p, form: str, kernel: str = "torch") -> torch.Tensor:
    backend = MlaAttention(MlaOptions(form=form, decode_kernel=kernel),
                           ref.model_stub(p["nope_dim"] + p["rope_dim"]), torch.device("cpu"), p["dtype"])
    plan = backend.plan(case.batch, cache=None)
    return backend.forward_latent(0, case.q_nope, case.q_pe, case.latent_new, case.up, case.storage, plan)


@given(latent_batches(), st.sampled_from(["naive", "absorbed", "auto"]))
def test_every_form_matches_float64_reference(p, form):
    case = make(p)
    out = run(case, p, form)
    assert out.shape == (*case.q_nope.shape[:2], p["v_dim"]) and out.dtype == p["dtype"]
    err = (out.double() - ref.reference_latent_attention(case)).abs().max().item()
    assert err <= TOLERANCE[p["dtype"]], f"{form}: max abs error {err:.3g}"
    # the step's latents were stored at the slot mapping, nothing for values
    c, none = case.storage.gather(case.batch.slot_mapping)
    assert none is None and torch.equal(c[:, 0], case.latent_new)


@given(latent_batches())
def test_absorbed_equals_naive(p):
    """The two forms are the same attention: on one case they agree to rounding."""
    p = {**p, "dtype": torch.float64}
    naive = run(make(p), p, "naive")
    absorbed = run(make(p), p, "absorbed")
    assert (naive - absorbed).abs().max().item() <= 1e-10


@given(latent_batches().filter(lambda p: p["dtype"] == torch.float32))
def test_triton_decode_through_the_backend(p):
    """decode_kernel 'triton' (interpreted here): decodes go to the kernel over the paged cache
    in place, the other rows to torch; together they match the reference."""
    case = make(p)
    out = run(case, p, "auto", kernel="triton")
    err = (out.double() - ref.reference_latent_attention(case)).abs().max().item()
    assert err <= TOLERANCE[torch.float32], f"max abs error {err:.3g}"


def test_plain_forward_is_refused_with_the_way_out():
    backend = MlaAttention(MlaOptions(), ref.model_stub(24), torch.device("cpu"), torch.float32)
    with pytest.raises(TypeError, match="forward_latent.*sdpa, flash or cascade"):
        backend.forward(0, *(torch.zeros(1, 1, 24),) * 3, None, None)


def test_latent_storage_stores_gathers_and_copies():
    layout = KVLayout("latent", 4, torch.float32)
    storage = LatentKVStorage(layout, 16, 10, torch.device("cpu"))
    assert storage.latent_tensor().shape == (16, 10)
    assert storage.latent_tensor().data_ptr() == storage.c.data_ptr()  # a view: kernels write in place
    assert storage.bytes_per_slot == 10 * 4
    latents = torch.randn(3, 1, 10)
    storage.store(latents, None, torch.tensor([5, 0, 9]))
    c, v = storage.gather(torch.tensor([0, 5, 9]))
    assert v is None and torch.equal(c, latents[[1, 0, 2]])
    storage.copy_slots(torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7]))  # copy-on-write of block 0
    assert torch.equal(storage.gather(torch.tensor([4]))[0], latents[[1]])
    assert isinstance(dense_storage(layout, 16, 1, 10, torch.device("cpu")), LatentKVStorage)
    assert storage.blocks().shape[:2] == (4, 4)
