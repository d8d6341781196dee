"""Start-up warm-up (core/engine/warm_up.py) with `flash`: every kernel variant a run
launches, flash's own included (``FlashAttention.warm_up_shapes``), is launched at start-up.

A Triton kernel variant first launched mid-run stalls that step for its compile (hundreds of
milliseconds on a GPU: docs/benchmarks.md). The warm-up must
launch every variant a run launches. Without a GPU the kernels run interpreted, and
``VariantRecorder`` computes the key Triton would compile each launch under on a Hopper GPU,
so the check runs here: warm up (and capture the padded graph path), record, then serve
prompts of mixed lengths through prefill chunks, mixed steps, split and single-split
decodes and graph replays; no key may be new.

A key depends on the launch's arguments only (constexprs, options, integer values, pointer
alignment, dtypes), and with ``ignore_eos`` and fixed lengths the steps' shapes do not depend
on the tokens. So on a CPU one case (float32) runs the kernels interpreted, end to end, and
the others record each launch's key without running the kernel's body (the interpreter takes
about half a minute a case): the same launches, in the same order, with the same keys."""

from __future__ import annotations

import inspect
import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the flash kernels run interpreted on CPU

import pytest  # noqa: E402

pytest.importorskip("triton")

from tessellm import LLM  # noqa: E402
from tessellm.core.engine.warm_up import warm_up  # noqa: E402
from tessellm.testing.triton_variants import VariantRecorder, triton_kernels  # noqa: E402

MAX_LEN = 160  # 16-key tiles: decodes split 1 to 3 ways (4 tiles a split at least) as contexts grow


def _llm(cpu_config, model, dtype: str = "float32", **flash_options):
    return LLM(cpu_config(model, device="cuda" if CUDA else "cpu", dtype=dtype,
                          attention={"name": "flash", "options": {"block_n": 16, **flash_options}},
                          cache={"name": "paged", "options": {"block_size": 4, "num_blocks": 160}},
                          scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 48,
                                                                       "max_num_seqs": 6}},
                          decoding={"name": "greedy"}, cuda_graphs=False, max_model_len=MAX_LEN))


def _hooks_only(kernel):
    """``kernel``'s launch as the interpreter makes it, up to its pre-run hooks (where
    ``VariantRecorder`` computes the key, from the same arguments), without running the body."""
    names = set(inspect.signature(kernel.fn).parameters)

    def run(*args, grid, warmup=False, **kwargs):
        if not warmup:  # the interpreter's GridExecutor passes the hooks the kernel's own arguments only
            kwargs = {k: v for k, v in kwargs.items() if k in names}
            for hook in kernel.pre_run_hooks:
                hook(*args, **kwargs)

    return run


@pytest.mark.parametrize("dtype, packed, run_kernels", [
    pytest.param("float32", False, True, id="float32-False", marks=pytest.mark.extended),  # kernels interpreted: slow
    pytest.param("bfloat16", False, CUDA, id="bfloat16-False"),  # on a CPU: keys recorded, kernels not run
    pytest.param("bfloat16", True, CUDA, id="bfloat16-True"),
])
def test_warm_up_launches_every_kernel_variant_a_run_launches(tiny_model, cpu_config, monkeypatch, dtype, packed,
                                                              run_kernels):
    from tessellm.core.model import fused_ops
    from tessellm.plugins.attention.flash import decode, prefill, rope_store

    kernels = triton_kernels(prefill, decode, rope_store, fused_ops)
    if not run_kernels:
        for kernel in kernels:
            monkeypatch.setattr(kernel, "run", _hooks_only(kernel))
    llm = _llm(cpu_config, tiny_model("llama"), dtype, packed_prefill=packed)
    if not run_kernels:  # nothing is stored: the engine's check that a forward stores K/V stays off
        llm.engine._kv_check.armed = False
    pipeline = llm.pipeline
    model = pipeline.model
    if not model.fused:  # the CUDA model: fused norm/RoPE/SwiGLU kernels, stacked projections
        model.fused = True
        model.fuse_projections()
    cache = pipeline.cache
    with VariantRecorder(kernels) as rec:
        assert warm_up(pipeline.runner, pipeline.scheduler.max_step_tokens, MAX_LEN) == 3
        pipeline.runner.capture_graphs(max_batch=4, max_model_len=MAX_LEN, capture=CUDA)
        warm = set(rec.seen)
        assert cache.num_free_blocks == cache.num_blocks  # the warm-up held no block
        g = torch.Generator().manual_seed(0)
        # long prompts in chunks beside decodes, a burst of decodes above the graphs' largest
        # size (eager, one split) and, as sequences finish, few long decodes (split + merge)
        lens = (70, 3, 9, 120, 5, 40, 1, 17)
        prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lens]
        params = [{"max_tokens": m, "ignore_eos": True} for m in (30, 6, 12, 35, 4, 20, 9, 15)]
        llm.generate(prompts, params)
        assert pipeline.runner.graphs.replays > 0
    new = rec.seen - warm
    assert not new, f"variants first launched after warm-up: {sorted(new)}"
    launched = rec.names()
    assert {"_paged_flash_fwd", "_paged_decode_split", "_paged_decode_merge", "_add_rmsnorm_kernel",
            "_rope_store_kernel", "_silu_mul_packed_kernel"} <= launched
    packed_at = list(inspect.signature(prefill._paged_flash_fwd.fn).parameters).index("PACKED")
    prefills = {k[1][packed_at] for k in rec.seen if k[0] == "_paged_flash_fwd"}  # a key: one entry a parameter
    assert prefills == {("constexpr", packed)}  # the option's prefill variant, and only it
    # both decode variants were met: the split one, merged, and the single-split one; and
    # the run's split counts varied (1, 2 and 3: the longest context in a step grows)
    assert len({k for k in rec.seen if k[0] == "_paged_decode_split"}) == 2
    merges = [k for k in rec.launches if k[0] == "_paged_decode_merge"]
    assert len(merges) > 2
    assert cache.num_free_blocks == cache.num_blocks
