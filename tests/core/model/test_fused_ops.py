"""The fused decoder kernels (core/model/fused_ops.py) against their torch references, and the
whole model with them against the eager path. Without a GPU they run under Triton's
interpreter on CPU tensors."""

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

DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16]


def close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: rounding only; bf16: within two bf16 ulps of the reference's value (four
    under the interpreter, which truncates float32 -> bfloat16 instead of rounding it)."""
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7 if CUDA else 2 ** -6
    err = (ours.float() - ref.float()).abs()
    assert (err <= tol * (1 + ref.float().abs())).all(), f"max error {err.max().item():.3g}"


@settings(max_examples=12)
@given(st.integers(1, 9), st.sampled_from([8, 64, 576, 1000]), st.booleans(), st.sampled_from(DTYPES),
       st.integers(0, 2**16))
def test_add_rmsnorm(rows, hidden, with_residual, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(rows, hidden, generator=g).to(DEVICE, dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)
    residual = r.clone() if with_residual else None
    ref_out, ref_sum = fused_ops.add_rmsnorm_reference(x, r if with_residual else None, w, 1e-5)
    out, new_residual = fused_ops.add_rmsnorm(x, residual, w, 1e-5)
    close(out, ref_out, dtype)
    close(new_residual, ref_sum, dtype)
    if with_residual:
        assert new_residual is residual  # updated in place


@settings(max_examples=12)
@given(st.integers(1, 7), st.sampled_from([1, 3, 8]), st.sampled_from([16, 64, 48]), st.sampled_from(DTYPES),
       st.integers(0, 2**16))
def test_rotary(tokens, heads, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, head_dim, generator=g).to(DEVICE, dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=g) * 6.28
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    ref = fused_ops.rotary_reference(x.double(), cos.double(), sin.double())
    out = fused_ops.rotary_(x.clone(), cos, sin)
    close(out, ref, dtype)


@settings(max_examples=8)
@given(st.integers(1, 5), st.integers(1, 1500), st.sampled_from(DTYPES), st.integers(0, 2**16))
def test_silu_mul_packed(rows, inter, dtype, seed):
    """Gate and up side by side in one row (a stacked GEMM's output), read through a strided view."""
    g = torch.Generator().manual_seed(seed)
    wide = (4 * torch.randn(rows, 2 * inter + 3, generator=g)).to(DEVICE, dtype)
    gate_up = wide[:, : 2 * inter]  # row stride 2 * inter + 3
    close(fused_ops.silu_mul_packed(gate_up), fused_ops.silu_mul_packed_reference(gate_up), dtype)


@settings(max_examples=8)
@given(st.integers(1, 3000), st.sampled_from(DTYPES), st.integers(0, 2**16))
def test_silu_mul(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gate, up = (4 * torch.randn(n, generator=g).to(DEVICE, dtype) for _ in range(2))
    close(fused_ops.silu_mul(gate, up), fused_ops.silu_mul_reference(gate, up), dtype)


@pytest.mark.parametrize("arch,stack", [("llama3", False), ("llama3", True), ("qwen2", False), ("qwen2", True)])
def test_model_with_fused_kernels_matches_eager(tiny_model, cpu_config, arch, stack, attention="sdpa"):
    """The same tiny model and prompts, fused (kernels, and with ``stack`` the q/k/v and
    gate/up projections stacked into one GEMM each; qwen2 has q/k/v biases) and eager on the
    CPU: equal greedy tokens, logits within float32 rounding (reductions sum in another order).
    The fused side takes the attention backend's default ``forward_rotary`` (the RoPE kernel,
    then ``forward``; tests/plugins/attention/flash/test_rope_store.py runs flash's own). On
    CUDA the fused side runs there, as ``build_model`` sets it up (always stacked)."""
    from tessellm import LLM

    def llm(fused):
        engine = LLM(cpu_config(tiny_model(arch), device=DEVICE.type if fused else "cpu", decoding={"name": "greedy"},
                                attention={"name": attention if fused else "sdpa"},
                                cache={"name": "paged", "options": {"block_size": 4, "num_blocks": 64}},
                                scheduler={"name": "continuous"}, cuda_graphs=False))
        model = engine.pipeline.model
        if fused:
            model.fused = True
            if stack and model.model.layers[0].self_attn.qkv_proj is None:
                model.fuse_projections()
        return engine

    fused, eager = llm(True), llm(False)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 9)]
    params = {"max_tokens": 5, "ignore_eos": True}
    assert [o.token_ids for o in fused.generate(prompts, params)] == [o.token_ids for o in eager.generate(prompts, params)]
    ids = list(range(7, 40))
    assert (fused.engine.score(ids).cpu() - eager.engine.score(ids)).abs().max().item() < 1e-4


def test_stacked_projections_alone_match_in_float64(tiny_model, cpu_config):
    """Stacking the projections without the fused kernels (the plain torch path) changes
    nothing but the GEMM count: float64 logits agree to rounding."""
    from tessellm import LLM

    def score(stack):
        llm = LLM(cpu_config(tiny_model("qwen2"), dtype="float64"))
        if stack:
            llm.pipeline.model.fuse_projections()
            assert not hasattr(llm.pipeline.model.model.layers[0].mlp, "up_proj")
        return llm.engine.score(list(range(3, 30)))

    assert (score(True) - score(False)).abs().max().item() < 1e-10


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_fused_kernels_with_qk_norms_and_experts_match_eager(tmp_path, model_type):
    """The fused path of a model plugin other than Llama's: Qwen3's per-head q/k norms run
    before the fused RoPE, and an MoE block takes the fused layer's normalised input (on CUDA
    stacked for the grouped path, as build_model sets it up)."""
    from tessellm import LLM
    from tessellm.testing.models import build_tiny

    folder = build_tiny(model_type, tmp_path / model_type)

    def llm(fused: bool) -> LLM:
        return LLM({"model": str(folder), "device": DEVICE.type if fused else "cpu", "dtype": "float32",
                    "decoding": {"name": "greedy"}, "attention": {"name": "sdpa"}, "cuda_graphs": False,
                    "cache": {"name": "paged", "options": {"block_size": 4, "num_blocks": 64}}})

    fused, eager = llm(True), llm(False)
    if not fused.pipeline.model.fused:
        fused.pipeline.model.fused = True
        fused.pipeline.model.fuse_projections()
    prompts = [[5 + i for i in range(n)] for n in (3, 17, 9)]
    params = {"max_tokens": 5, "ignore_eos": True}
    assert [o.token_ids for o in fused.generate(prompts, params)] == [o.token_ids for o in eager.generate(prompts, params)]
    ids = list(range(7, 40))
    assert (fused.engine.score(ids).cpu() - eager.engine.score(ids)).abs().max().item() < 1e-4


def _model_types() -> list[str]:
    """Every text family a model plugin declares (a vision family's language model is one of
    them: the multimodal gemma3's is gemma3_text, qwen2_vl's qwen2, idefics3's llama)."""
    from transformers import AutoConfig

    from tessellm.core.registry import get_registry

    declared = {t for entry in get_registry().entries("model") for t in entry.cls.model_types}
    return sorted(t for t in declared if not hasattr(AutoConfig.for_model(t), "vision_config"))


COVERED = {"llama", "qwen2", "qwen3", "qwen3_moe"}
"""Families whose fused path the tests above already run."""


@pytest.mark.parametrize("model_type", [pytest.param(t, marks=pytest.mark.extended) if t in COVERED else t
                                        for t in _model_types()])
def test_every_family_runs_on_cuda_what_it_runs_on_the_cpu(tmp_path, model_type):
    """On CUDA a decoder runs its layers' fused forward (``forward_fused``, core's kernels)
    wherever its module says ``supports_fused``; the CPU runs each layer's ``forward``. For
    every built-in family that takes the fused path, both give the same logits (a family
    whose layer computes something core's fused layer does not would differ here, not only
    on a GPU); the others keep their own layers on CUDA too, so there is nothing to compare."""
    from transformers import AutoConfig

    from tessellm import LLM
    from tessellm.core.registry import get_registry
    from tessellm.testing.models import TINY_SHAPES, build_tiny

    entry = next(e for e in get_registry().entries("model") if model_type in e.cls.model_types)
    architecture = entry.cls(entry.cls.Options())
    config = AutoConfig.for_model(model_type, vocab_size=512, **TINY_SHAPES.get(model_type, {}))
    with torch.device("meta"):
        if not getattr(architecture.build(architecture.load_spec(config)), "supports_fused", False):
            pytest.skip(f"{model_type} runs its own layers on CUDA too (supports_fused is off, or an encoder)")
    folder = build_tiny(model_type, tmp_path / model_type)
    llm = LLM({"model": str(folder), "device": DEVICE.type, "dtype": "float32", "attention": {"name": "sdpa"},
               "cache": {"name": "paged", "options": {"block_size": 4, "num_blocks": 64}}, "cuda_graphs": False})
    ids = [(7 * i) % 500 + 3 for i in range(29)]
    model = llm.pipeline.model
    model.fused = False  # each layer's own forward, as on a CPU
    eager = llm.engine.score(ids)
    model.fused = True  # as build_model sets a CUDA model up: fused layers, stacked experts
    model.stack_experts()
    fused = llm.engine.score(ids)
    assert (fused - eager).abs().max().item() < 1e-4 * max(1.0, eager.abs().max().item())
