"""Start-up warm-up (``ModelRunner.warm_up``) and the kernel-build count.

A Triton kernel variant first launched mid-run stalls that step for its compile (on the H100,
the first 8192-token prefill of a run took 890 ms against 32 ms warm). The warm-up must
launch every variant a run launches. Without a GPU the kernels run interpreted, and
``VariantRecorder`` computes the key Triton would compile each launch under on a Hopper GPU,
so the check runs here: warm up (and capture the padded graph path), record, then serve
prompts of mixed lengths through prefill chunks, mixed steps, split and single-split
decodes and graph replays; no key may be new."""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the flash kernels run interpreted on CPU

import pytest  # noqa: E402

pytest.importorskip("triton")

from tessellm import LLM  # noqa: E402
from tessellm.core.engine import Engine  # noqa: E402
from tessellm.core.kernel_builds import KernelBuildLog  # noqa: E402
from tessellm.core.scheduler import Scheduler  # noqa: E402
from tessellm.testing.triton_variants import VariantRecorder, triton_kernels  # noqa: E402

MAX_LEN = 160  # 16-key tiles: decodes split 1 to 3 ways (4 tiles a split at least) as contexts grow


def _llm(cpu_config, model, dtype: str = "float32", **flash_options):
    return LLM(cpu_config(model, device="cuda" if CUDA else "cpu", dtype=dtype,
                          attention={"name": "flash", "options": {"block_n": 16, **flash_options}},
                          cache={"name": "paged", "options": {"block_size": 4, "num_blocks": 160}},
                          scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 48,
                                                                       "max_num_seqs": 6}},
                          decoding={"name": "greedy"}, cuda_graphs=False, max_model_len=MAX_LEN))


@pytest.mark.parametrize("dtype, packed", [("float32", False), ("bfloat16", False), ("bfloat16", True)])
def test_warm_up_launches_every_kernel_variant_a_run_launches(tiny_model, cpu_config, dtype, packed):
    from tessellm.core import fused_ops
    from tessellm.plugins.attention import flash_kernels

    llm = _llm(cpu_config, tiny_model("llama"), dtype, packed_prefill=packed)
    pipeline = llm.pipeline
    model = pipeline.model
    if not model.fused:  # the CUDA model: fused norm/RoPE/SwiGLU kernels, stacked projections
        model.fused = True
        model.fuse_projections()
    cache = pipeline.cache
    with VariantRecorder(triton_kernels(flash_kernels, fused_ops)) as rec:
        assert pipeline.runner.warm_up(pipeline.scheduler.max_step_tokens, MAX_LEN) == 3
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
    prefills = {k[1][-1] for k in rec.seen if k[0] == "_paged_flash_fwd"}  # its last argument: PACKED
    assert prefills == {("constexpr", packed)}  # the option's prefill variant, and only it
    # both decode variants were met: the split one, merged, and the single-split one; and
    # the run's split counts varied (1, 2 and 3: the longest context in a step grows)
    assert len({k for k in rec.seen if k[0] == "_paged_decode_split"}) == 2
    merges = [k for k in rec.launches if k[0] == "_paged_decode_merge"]
    assert len(merges) > 2
    assert cache.num_free_blocks == cache.num_blocks


def test_warm_up_leaves_outputs_and_cache_unchanged(tiny_model, cpu_config):
    model = tiny_model("llama")
    cold, warm = _llm(cpu_config, model), _llm(cpu_config, model)
    for layer in range(warm.pipeline.spec.num_layers):  # NaN marks every slot nobody wrote
        warm.pipeline.cache.layer(layer).k.fill_(float("nan"))
    warm.pipeline.runner.warm_up(48, MAX_LEN)
    scratch = warm.pipeline.cache.scratch_block * 4
    written = ~warm.pipeline.cache.layer(0).k.isnan().any(-1).any(-1)
    assert not written[:scratch].any() and written[scratch:].any()  # only the scratch block was written
    prompts = [list(range(7, 7 + n)) for n in (5, 30, 12)]
    params = {"max_tokens": 8, "ignore_eos": True}
    assert [o.token_ids for o in warm.generate(prompts, params)] == [o.token_ids for o in cold.generate(prompts, params)]


def test_warm_up_without_a_scratch_block_runs_nothing(tiny_model, cpu_config):
    llm = LLM(cpu_config(tiny_model("llama")))  # the contiguous cache has no scratch block
    assert llm.pipeline.cache.scratch_block is None
    assert llm.pipeline.runner.warm_up(64, 64) == 0


def test_step_budget_of_the_schedulers(tiny_model, cpu_config):
    assert _llm(cpu_config, tiny_model("llama")).pipeline.scheduler.max_step_tokens == 48
    static = LLM(cpu_config(tiny_model("llama"))).pipeline.scheduler
    assert static.max_step_tokens is None and Scheduler.max_step_tokens.fget(static) is None


class _Fn:
    name = "_my_kernel"


def test_build_log_counts_new_variants_and_keeps_an_earlier_hook(monkeypatch):
    from triton import knobs

    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda *a, **k: calls.append(k["fn"].name) or True)
    log = KernelBuildLog()
    assert log.install() and log.install()  # idempotent
    assert knobs.runtime.jit_cache_hook == log._hook
    # Triton calls the hook once per variant new to the process, before compiling it
    assert knobs.runtime.jit_cache_hook(key="k", repr="r", fn=_Fn(), compile={}, is_manual_warmup=False,
                                        already_compiled=False) is True  # the earlier hook's answer stands
    assert log.total == 1 and log.by_kernel == {"_my_kernel": 1} and calls == ["_my_kernel"]


def test_engine_counts_builds_during_its_steps(tiny_model, cpu_config, monkeypatch, caplog):
    from tessellm.core import engine as engine_module

    log = KernelBuildLog()
    monkeypatch.setattr(engine_module, "build_log", log)
    llm = LLM(cpu_config(tiny_model("llama")))
    real_step = Engine._step

    def step_that_builds(self, start, finished):
        if self.stats.steps == 1:  # the second step meets a new variant
            log._hook(fn=_Fn())
        return real_step(self, start, finished)

    monkeypatch.setattr(Engine, "_step", step_that_builds)
    with caplog.at_level("INFO", logger="tessellm.core.engine"):
        llm.generate([[5, 6, 7]], {"max_tokens": 4, "ignore_eos": True})
    assert llm.engine.stats.kernel_builds == 1
    assert "step 2 built 1 new Triton kernel variant" in caplog.text and "_my_kernel x1" in caplog.text


def test_pipeline_warms_up_where_kernels_compile_and_says_why_it_ran_out_of_memory(tiny_model, cpu_config,
                                                                                    monkeypatch):
    from tessellm.core.errors import ConfigError
    from tessellm.core.model_runner import ModelRunner

    calls = []
    monkeypatch.setattr(ModelRunner, "compiles_kernels", lambda self: True)  # as on CUDA
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self, tokens, max_len: calls.append((tokens, max_len)) or 3)
    _llm(cpu_config, tiny_model("llama"))
    assert calls == [(48, MAX_LEN)]  # the scheduler's token budget, the context window

    def oom(self, tokens, max_len):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")

    monkeypatch.setattr(ModelRunner, "warm_up", oom)
    with pytest.raises(ConfigError, match="max_num_batched_tokens") as info:
        _llm(cpu_config, tiny_model("llama"))
    assert "48 tokens" in str(info.value) and "gpu_memory_fraction" in str(info.value)
