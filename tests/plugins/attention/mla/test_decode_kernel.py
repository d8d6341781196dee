"""The absorbed-MLA split-K decode kernel against a float64 reference: random batches of
sequences over scattered (non-contiguous) cache blocks, latent widths that are not powers of
two, head counts below, at and above one head block, 1 to 3 splits (some past the end of a
short context) and the automatic choice. Every slot no sequence owns holds NaN, so a kernel
that reads past a sequence's length fails.

Without a GPU the kernel runs under Triton's interpreter on CPU tensors (small shapes; CI)."""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is first imported

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

from tessellm.plugins.attention.mla.decode_kernel import default_num_splits, mla_decode  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
FLOAT32_TOLERANCE = 1e-4


def make_case(seq_lens: list[int], num_heads: int, kv_lora_rank: int, rope_dim: int, block_size: int,
              dtype: torch.dtype, seed: int, spare_blocks: int = 2, extra_columns: int = 0):
    """Queries, a NaN-filled latent cache holding only the sequences' tokens, and block tables
    over a shuffled pool of blocks (``spare_blocks`` never used; ``extra_columns`` -1 entries
    past the widest table)."""
    g = torch.Generator().manual_seed(seed)
    dim = kv_lora_rank + rope_dim
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool = torch.randperm(num_blocks, generator=g)
    width = max(blocks_per_seq) + extra_columns
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    cache = torch.full((num_blocks * block_size, dim), float("nan"), dtype=dtype)
    used = 0
    for b, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        tables[b, :nb] = pool[used:used + nb].to(torch.int32)
        used += nb
        t = torch.arange(n)
        slots = tables[b, t // block_size].long() * block_size + t % block_size
        cache[slots] = torch.randn(n, dim, generator=g).to(dtype)
    q = torch.randn(len(seq_lens), num_heads, dim, generator=g).to(dtype)
    return q, cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


def sequence_kv(cache, tables, seq_lens, block_size, b):
    n = int(seq_lens[b])
    t = torch.arange(n)
    return cache[tables[b, t // block_size].long() * block_size + t % block_size]


def reference(q, cache, tables, seq_lens, block_size, kv_lora_rank, scale) -> torch.Tensor:
    """softmax(scale * q K^T) V per sequence in float64, V the first kv_lora_rank dims of K."""
    out = torch.empty(q.shape[0], q.shape[1], kv_lora_rank, dtype=torch.float64)
    for b in range(q.shape[0]):
        k = sequence_kv(cache, tables, seq_lens, block_size, b).double()
        p = torch.softmax(scale * q[b].double() @ k.T, dim=-1)
        out[b] = p @ k[:, :kv_lora_rank]
    return out


def torch_low_precision(q, cache, tables, seq_lens, block_size, kv_lora_rank, scale) -> torch.Tensor:
    """The same attention through torch's SDPA in q's (16-bit) dtype: the error torch itself
    makes in that dtype."""
    out = torch.empty(q.shape[0], q.shape[1], kv_lora_rank, dtype=q.dtype)
    for b in range(q.shape[0]):
        k = sequence_kv(cache, tables, seq_lens, block_size, b)
        heads = q.shape[1]
        out[b] = torch.nn.functional.scaled_dot_product_attention(
            q[b][None, :, None, :], k[None, None].expand(1, heads, -1, -1),
            k[None, None, :, :kv_lora_rank].expand(1, heads, -1, -1), scale=scale)[0, :, 0]
    return out


def run_kernel(q, cache, tables, seq_lens, block_size, kv_lora_rank, scale, num_splits):
    out = mla_decode(q.to(DEVICE), cache.to(DEVICE), tables.to(DEVICE), seq_lens.to(DEVICE), block_size,
                     kv_lora_rank, scale, num_splits)
    assert out.shape == (q.shape[0], q.shape[1], kv_lora_rank) and out.dtype == q.dtype
    return out.cpu()


@st.composite
def cases(draw):
    num_seqs = draw(st.integers(1, 4))
    return dict(seq_lens=draw(st.lists(st.integers(1, 70), min_size=num_seqs, max_size=num_seqs)),
                num_heads=draw(st.integers(1, 20)), kv_lora_rank=draw(st.sampled_from([16, 24, 32])),
                rope_dim=draw(st.sampled_from([8, 16])), block_size=draw(st.sampled_from([4, 8, 16])),
                num_splits=draw(st.sampled_from([None, 1, 2, 3])), extra_columns=draw(st.sampled_from([0, 0, 3])),
                seed=draw(st.integers(0, 2**16)))


def build(p, dtype):
    q, cache, tables, seq_lens = make_case(p["seq_lens"], p["num_heads"], p["kv_lora_rank"], p["rope_dim"],
                                           p["block_size"], dtype, p["seed"], extra_columns=p["extra_columns"])
    scale = (p["kv_lora_rank"] + p["rope_dim"]) ** -0.5
    return (q, cache, tables, seq_lens, p["block_size"], p["kv_lora_rank"], scale)


@settings(max_examples=20, deadline=None)
@given(cases())
def test_mla_decode_matches_float64_reference_float32(p):
    args = build(p, torch.float32)
    out = run_kernel(*args, p["num_splits"])
    err = (out.double() - reference(*args)).abs().max().item()
    assert err <= FLOAT32_TOLERANCE, f"max abs error {err:.3g}"


@settings(max_examples=10, deadline=None)
@given(cases(), st.sampled_from([torch.bfloat16, torch.float16]))
def test_mla_decode_16_bit_error_within_twice_torch(p, dtype):
    """flash-attention's rule: the kernel's error against float64 (on the same rounded inputs)
    is at most twice torch SDPA's in the same dtype, plus a small absolute floor. Under the
    interpreter bfloat16 tiles are multiplied in float32 (it cannot multiply bfloat16), so this
    checks bfloat16 loads, stores and the algorithm there; on a GPU, the bfloat16 dots too."""
    args = build(p, dtype)
    expected = reference(*args)
    ours = (run_kernel(*args, p["num_splits"]).double() - expected).abs().max().item()
    theirs = (torch_low_precision(*args).double() - expected).abs().max().item()
    assert ours <= 2 * theirs + 1e-3, f"kernel {ours:.3g} vs torch {theirs:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_mla_decode_at_deepseek_v2_shape(dtype, num_splits):
    """DeepSeek-V2's latent: 512 compressed dims + 64 rope dims, 16 heads (one head block),
    64-token blocks; contexts of one token, one past a block, and a few blocks."""
    torch.manual_seed(0)
    seq_lens = [1, 65, 200]
    q, cache, tables, lens = make_case(seq_lens, 16, 512, 64, 64, dtype, seed=1234, extra_columns=1)
    scale = (128 + 64) ** -0.5  # qk_nope_head_dim + qk_rope_head_dim, the model's own scale
    args = (q, cache, tables, lens, 64, 512, scale)
    expected = reference(*args)
    out = run_kernel(*args, num_splits)
    assert torch.isfinite(out).all()
    err = (out.double() - expected).abs().max().item()
    if dtype == torch.float32:
        assert err <= FLOAT32_TOLERANCE, f"max abs error {err:.3g}"
    else:
        theirs = (torch_low_precision(*args).double() - expected).abs().max().item()
        assert err <= 2 * theirs + 1e-3, f"kernel {err:.3g} vs torch {theirs:.3g}"


def test_split_count_does_not_change_the_result():
    """One split (written directly) and several (merged) agree to float32 rounding, also with
    more splits than a short sequence has tiles (its trailing splits are empty)."""
    torch.manual_seed(0)
    args = (*make_case([3, 70, 40], 5, 24, 8, 8, torch.float32, seed=7), 8, 24, 32 ** -0.5)
    one = run_kernel(*args, 1)
    for splits in (2, 5):
        assert (run_kernel(*args, splits) - one).abs().max().item() <= 1e-5


@given(st.integers(1, 256), st.integers(1, 128), st.integers(1, 1 << 17), st.sampled_from([16, 32]))
def test_default_num_splits_leaves_no_split_empty(num_seqs, num_heads, max_context, block_n):
    splits = default_num_splits(num_seqs, num_heads, max_context, block_n, torch.device("cpu"))
    assert splits >= 1
    per_split = -(-(-(-max_context // splits)) // block_n) * block_n
    assert (splits - 1) * per_split < max_context  # the last split starts inside the context
    assert splits <= 4  # on the CPU: a handful of programs at most


def test_mla_decode_rejects_mismatched_inputs():
    q, cache, tables, lens = make_case([5], 2, 16, 8, 4, torch.float32, seed=0)
    with pytest.raises(ValueError, match="dim"):
        mla_decode(q[..., :-1], cache, tables, lens, 4, 16, 0.1)
    with pytest.raises(ValueError, match="dtype|float32"):
        mla_decode(q, cache.double(), tables, lens, 4, 16, 0.1)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_decode(q, cache, tables, lens, 4, 25, 0.1)
