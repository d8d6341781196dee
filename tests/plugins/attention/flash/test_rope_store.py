"""`flash`'s fused RoPE + KV store (plugins/attention/flash/rope_store.py) against its float64
reference and the two-step path it replaces, and a whole model through it against the eager
path. Without a GPU it runs under Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

from tessellm.core.model import fused_ops  # noqa: E402
from tessellm.plugins.attention.flash import rope_store as flash_rope  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16]


def close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: rounding only; bf16: within two bf16 ulps of the reference's value (four
    under the interpreter, which truncates float32 -> bfloat16 instead of rounding it)."""
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7 if CUDA else 2 ** -6
    err = (ours.float() - ref.float()).abs()
    assert (err <= tol * (1 + ref.float().abs())).all(), f"max error {err.max().item():.3g}"


def same_as_two_step(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Bit-equal under the interpreter; compiled, within a rounding of the dtype (float32:
    two ulps; bfloat16: one) at the scale of each row (a head's vector): the compiler may
    contract the rotation's products into FMAs differently in two kernels, and where
    ``x1 cos - x2 sin`` cancels, the two differ by a rounding of the products, not of the
    small result."""
    if not CUDA:
        return torch.equal(ours, theirs)
    tol = 2 ** -22 if ours.dtype == torch.float32 else 2 ** -7
    a, b = ours.float(), theirs.float()
    scale = b.abs().amax(dim=-1, keepdim=True)
    return bool(((a - b).abs() <= tol * (b.abs() + scale)).all())


@settings(max_examples=12)
@given(st.integers(1, 7), st.sampled_from([(1, 1), (4, 2), (6, 1), (8, 8)]), st.sampled_from([16, 48, 64]),
       st.sampled_from(DTYPES), st.booleans(), st.integers(0, 2**16))
def test_rope_store(tokens, heads, head_dim, dtype, float32_cache, seed):
    """RoPE on q and k and the cache write in one kernel, reading q, k, v as strided views of
    one packed QKV output and writing scattered cache rows (a cache dtype of its own too):
    close to the float64 reference, and to the two-step path it replaces (``rotary_`` on q and
    k, then the storage's index copies): bit-equal under the interpreter, within a rounding
    compiled (the compiler may fuse the same formula into FMAs differently in two kernels)."""
    hq, hkv = heads
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim + 5, generator=g).to(DEVICE, dtype)  # padded rows: strided
    q, k, v = (part.view(tokens, -1, head_dim) for part in
               qkv[:, : (hq + 2 * hkv) * head_dim].split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1))
    angles = torch.rand(tokens, head_dim // 2, generator=g) * 6.28
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    num_slots = 3 * tokens + 4
    slots = torch.randperm(num_slots, generator=g)[:tokens].to(DEVICE)
    cache_dtype = torch.float32 if float32_cache else dtype
    caches = [torch.zeros(num_slots, hkv, head_dim, dtype=cache_dtype, device=DEVICE) for _ in range(2)]

    ref_k, ref_caches = k.double().clone(), [c.double() for c in caches]
    ref_q = flash_rope.rope_store_reference(q.double(), ref_k, v.double(), cos.double(), sin.double(), *ref_caches,
                                           slots)
    two_step_caches = [c.clone() for c in caches]
    two_step_q, two_step_k = fused_ops.rotary_(q.clone(), cos, sin), fused_ops.rotary_(k.clone(), cos, sin)
    two_step_caches[0].index_copy_(0, slots, two_step_k.to(cache_dtype))
    two_step_caches[1].index_copy_(0, slots, v.to(cache_dtype))

    out = flash_rope.rope_store(q, k, v, cos, sin, *caches, slots)
    assert out.is_contiguous() and out.shape == q.shape
    close(out, ref_q, dtype)
    close(k, ref_k, dtype)  # rotated in place
    for ours, ref in zip(caches, ref_caches):
        close(ours, ref, dtype)
    assert same_as_two_step(out, two_step_q) and same_as_two_step(k, two_step_k)
    assert all(same_as_two_step(a, b) for a, b in zip(caches, two_step_caches))
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not caches[0][untouched].any() and not caches[1][untouched].any()  # no other row written


@settings(max_examples=10)
@given(st.integers(1, 7), st.sampled_from([(1, 1), (4, 2), (6, 1), (8, 8)]), st.sampled_from([16, 48, 64]),
       st.sampled_from(DTYPES), st.integers(0, 2**16))
def test_rope_store_into_an_int8_cache(tokens, heads, head_dim, dtype, seed):
    """Into an int8 cache, the kernel writes what the two-step path (``rotary_`` on k, then
    ``Int8KVStorage.store``) writes: the same int8 values and float16 scales under the
    interpreter (compiled: values within one step of rounding, scales equal), rows of zeros
    and outliers included; no other slot is touched."""
    from tessellm.core.interfaces.kv import KVLayout
    from tessellm.plugins.cache.paged.int8_kv import Int8KVStorage

    hq, hkv = heads
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, generator=g)
    qkv[0, -head_dim:] = 0.0  # the last V head of the first token: all zeros (scale 0)
    qkv[-1, hq * head_dim] = 40.0  # an outlier channel in a key
    qkv = qkv.to(DEVICE, dtype)
    q, k, v = (part.view(tokens, -1, head_dim) for part in qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], -1))
    angles = torch.rand(tokens, head_dim // 2, generator=g) * 6.28
    cos, sin = (f(torch.cat((angles, angles), dim=-1)).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    num_slots = 3 * tokens + 4
    slots = torch.randperm(num_slots, generator=g)[:tokens].to(DEVICE)

    def storage():
        made = Int8KVStorage(KVLayout("kv", 4, torch.int8), num_slots, hkv, head_dim, DEVICE, dtype)
        for t in (made.k, made.v, made.k_scale, made.v_scale):
            t.zero_()
        return made

    two_step = storage()
    two_step_k = fused_ops.rotary_(k.clone(), cos, sin)
    two_step.store(two_step_k, v, slots)
    ours = storage()
    out = flash_rope.rope_store(q, k, v, cos, sin, *ours.kv_tensors(), slots, *ours.kv_scales())
    assert same_as_two_step(out, fused_ops.rotary_(q.clone(), cos, sin)) and same_as_two_step(k, two_step_k)
    for a, b in zip(ours.kv_scales(), two_step.kv_scales()):
        assert torch.equal(a, b) if not CUDA else torch.allclose(a.float(), b.float(), rtol=2 ** -10)
    for a, b in zip(ours.kv_tensors(), two_step.kv_tensors()):
        assert (a.int() - b.int()).abs().max().item() <= (0 if not CUDA else 1)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not ours.k[untouched].any() and not ours.v_scale[untouched].any()


def test_rope_store_needs_scales_exactly_for_an_int8_cache():
    q = torch.zeros(1, 1, 16, device=DEVICE)
    int8 = torch.zeros(4, 1, 16, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="int8 cache needs its k and v scales"):
        flash_rope.rope_store(q, q, q, q[0], q[0], int8, int8, torch.zeros(1, dtype=torch.long, device=DEVICE))


def test_rope_store_rejects_mismatched_caches():
    q = torch.zeros(1, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="one contiguous layout"):
        flash_rope.rope_store(q, q, q, q[0], q[0], torch.zeros(4, 1, 16, device=DEVICE), torch.zeros(4, 2, 8, device=DEVICE),
                             torch.zeros(1, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_model_with_rope_store_matches_eager(tiny_model, cpu_config, kv_dtype):
    """A tiny model fused (kernels, stacked projections) through `flash`, which folds RoPE
    into its KV store (``forward_rotary``), against the eager model through `sdpa` on the CPU:
    equal greedy tokens, logits within float32 rounding; also over an int8 cache, which the
    kernel quantizes as the storage's own ``store`` does."""
    from tessellm import LLM

    def llm(fused):
        engine = LLM(cpu_config(tiny_model("llama3"), device=DEVICE.type if fused else "cpu",
                                decoding={"name": "greedy"}, attention={"name": "flash" if fused else "sdpa"},
                                cache={"name": "paged", "options": {"block_size": 4, "num_blocks": 64,
                                                                    "kv_dtype": kv_dtype}},
                                scheduler={"name": "continuous"}, cuda_graphs=False))
        model = engine.pipeline.model
        if fused:
            model.fused = True
            if model.model.layers[0].self_attn.qkv_proj is None:
                model.fuse_projections()
        return engine

    fused, eager = llm(True), llm(False)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 9)]
    params = {"max_tokens": 5, "ignore_eos": True}
    assert [o.token_ids for o in fused.generate(prompts, params)] == [o.token_ids for o in eager.generate(prompts, params)]
    ids = list(range(7, 40))
    assert (fused.engine.score(ids).cpu() - eager.engine.score(ids)).abs().max().item() < 1e-4
