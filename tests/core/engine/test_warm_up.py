"""Start-up warm-up (core/engine/warm_up.py) and the count of Triton kernels built during
steps (core/model/kernel_builds.py)."""

from __future__ import annotations

import pytest
import torch

from tessellm import LLM
from tessellm.core.engine.engine import Engine
from tessellm.core.engine.warm_up import warm_up
from tessellm.core.interfaces.scheduler import Scheduler
from tessellm.core.model.kernel_builds import KernelBuildLog

MAX_LEN = 160


def _llm(cpu_config, model, dtype: str = "float32"):
    return LLM(cpu_config(model, dtype=dtype, attention={"name": "sdpa"},
                          cache={"name": "paged", "options": {"block_size": 4, "num_blocks": 160}},
                          scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 48,
                                                                       "max_num_seqs": 6}},
                          decoding={"name": "greedy"}, cuda_graphs=False, max_model_len=MAX_LEN))


def test_warm_up_leaves_outputs_and_cache_unchanged(tiny_model, cpu_config):
    model = tiny_model("llama")
    cold, warm = _llm(cpu_config, model), _llm(cpu_config, model)
    for layer in range(warm.pipeline.spec.num_layers):  # NaN marks every slot nobody wrote
        warm.pipeline.cache.layer(layer).k.fill_(float("nan"))
    warm_up(warm.pipeline.runner, 48, MAX_LEN)
    scratch = warm.pipeline.cache.scratch_block * 4
    written = ~warm.pipeline.cache.layer(0).k.isnan().any(-1).any(-1)
    assert not written[:scratch].any() and written[scratch:].any()  # only the scratch block was written
    prompts = [list(range(7, 7 + n)) for n in (5, 30, 12)]
    params = {"max_tokens": 8, "ignore_eos": True}
    assert [o.token_ids for o in warm.generate(prompts, params)] == [o.token_ids for o in cold.generate(prompts, params)]


def test_warm_up_without_a_scratch_block_runs_nothing(tiny_model, cpu_config):
    llm = LLM(cpu_config(tiny_model("llama")))  # the contiguous cache has no scratch block
    assert llm.pipeline.cache.scratch_block is None
    assert warm_up(llm.pipeline.runner, 64, 64) == 0


def test_step_budget_of_the_schedulers(tiny_model, cpu_config):
    assert _llm(cpu_config, tiny_model("llama")).pipeline.scheduler.max_step_tokens == 48
    static = LLM(cpu_config(tiny_model("llama"))).pipeline.scheduler
    assert static.max_step_tokens is None and Scheduler.max_step_tokens.fget(static) is None


class _Fn:
    name = "_my_kernel"


def test_build_log_counts_new_variants_and_keeps_an_earlier_hook(monkeypatch):
    knobs = pytest.importorskip("triton").knobs

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
    from tessellm.core.engine import engine as engine_module

    log = KernelBuildLog()
    monkeypatch.setattr(engine_module, "build_log", log)
    llm = LLM(cpu_config(tiny_model("llama")))
    real_step = Engine._step

    def step_that_builds(self):
        if self.stats.steps == 1:  # the second step meets a new variant
            log._hook(fn=_Fn())
        return real_step(self)

    monkeypatch.setattr(Engine, "_step", step_that_builds)
    with caplog.at_level("INFO", logger="tessellm.core.engine.engine"):
        llm.generate([[5, 6, 7]], {"max_tokens": 4, "ignore_eos": True})
    assert llm.engine.stats.kernel_builds == 1
    assert "step 2 built 1 new Triton kernel variant" in caplog.text and "_my_kernel x1" in caplog.text


def test_pipeline_warms_up_where_kernels_compile_and_says_why_it_ran_out_of_memory(tiny_model, cpu_config,
                                                                                    monkeypatch):
    from tessellm.core.engine import pipeline as pipeline_module
    from tessellm.core.errors import ConfigError
    from tessellm.core.model.runner import ModelRunner

    calls = []
    monkeypatch.setattr(ModelRunner, "compiles_kernels", lambda self: True)  # as on CUDA
    monkeypatch.setattr(pipeline_module, "warm_up", lambda runner, tokens, max_len: calls.append((tokens, max_len)) or 3)
    _llm(cpu_config, tiny_model("llama"))
    assert calls == [(48, MAX_LEN)]  # the scheduler's token budget, the context window

    def oom(runner, tokens, max_len):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")

    monkeypatch.setattr(pipeline_module, "warm_up", oom)
    with pytest.raises(ConfigError, match="max_num_batched_tokens") as info:
        _llm(cpu_config, tiny_model("llama"))
    assert "48 tokens" in str(info.value) and "gpu_memory_fraction" in str(info.value)
