"""int8 K/V in the paged cache: per token and head the round trip is within half a
quantization step, a token's stored value depends on it alone, copy-on-write copies scales
too, the memory per token is about half of bfloat16's, and a pipeline runs on it by config
(backends that need plain tensors decline it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, strategies as st

from tessellm import LLM
from tessellm.core.plugin import SelectionContext
from tessellm.core.interfaces.kv import KVLayout
from tessellm.core.model.spec import KVShape
from tessellm.plugins.cache.paged.int8_kv import Int8KVStorage, quantize_heads
from tessellm.plugins.cache.paged.manager import PagedOptions, bytes_per_block


def storage(slots: int = 64, heads: int = 2, dim: int = 16, dtype=torch.float32) -> Int8KVStorage:
    return Int8KVStorage(KVLayout("kv", 4, torch.int8), slots, heads, dim, torch.device("cpu"), dtype)


@given(tokens=st.integers(1, 24), heads=st.integers(1, 4), dim=st.sampled_from([8, 16, 64, 80]),
       seed=st.integers(0, 2**16), outlier=st.floats(1.0, 1000.0))
def test_round_trip_is_within_half_a_step_per_token_and_head(tokens, heads, dim, seed, outlier):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, dim, generator=g)
    x[0, 0, 0] *= outlier  # an outlier widens only its own token's and head's scale
    kv = storage(64, heads, dim)
    slots = torch.randperm(64, generator=g)[:tokens]
    kv.store(x, -x, slots)
    k, v = kv.gather(slots)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert k.dtype == torch.float32 and k.shape == x.shape
    assert bool(((k - x).abs() <= step * 0.5 * (1 + 2e-3) + 1e-6).all())  # float16 scales round a little
    assert torch.equal(v, -k)
    assert torch.equal(k, kv.stored_value(x))  # a function of the token alone
    if tokens > 1:  # the outlier did not coarsen another token
        assert bool(((k[1:] - x[1:]).abs() <= step[1:] * 0.5 * (1 + 2e-3) + 1e-6).all())


def test_zero_vectors_and_bfloat16_compute():
    kv = storage(8, 1, 8, torch.bfloat16)
    x = torch.zeros(2, 1, 8)
    x[1] = torch.linspace(-3, 3, 8)
    kv.store(x, x, torch.tensor([3, 5]))
    k, _ = kv.gather(torch.tensor([[3, 5]]))
    assert k.dtype == torch.bfloat16 and k.shape == (1, 2, 1, 8)
    assert torch.equal(k[0, 0].float(), torch.zeros(1, 8)) and torch.isfinite(k).all()


def test_copy_slots_copies_values_and_scales():
    kv = storage()
    x = torch.randn(4, 2, 16) * torch.tensor([1.0, 10.0, 100.0, 0.1])[:, None, None]
    kv.store(x, x, torch.arange(4))
    kv.copy_slots(torch.arange(4), torch.arange(8, 12))
    assert torch.equal(kv.gather(torch.arange(8, 12))[0], kv.gather(torch.arange(4))[0])


def test_quantized_values_use_the_whole_int8_range():
    q, scale = quantize_heads(torch.tensor([[0.5, -1.0, 0.25]]))
    assert q.tolist() == [[64, -127, 32]] and scale.dtype == torch.float16


@pytest.mark.parametrize("head_dim,ratio", [(64, 1.93), (128, 1.96)])
def test_about_twice_the_tokens_of_bfloat16_in_the_same_memory(head_dim, ratio):
    Spec = SimpleNamespace(num_layers=30, kv_shape=KVShape("kv", 3, head_dim))
    assert bytes_per_block(Spec, 16, torch.bfloat16) / bytes_per_block(Spec, 16, torch.int8) >= ratio
    assert bytes_per_block(Spec, 16, torch.float32) / bytes_per_block(Spec, 16, torch.int8) >= 2 * ratio


def test_a_pipeline_runs_on_int8_kv_by_config(cpu_config, tiny_model):
    def config(**cache_options):
        return cpu_config(tiny_model("llama"), cache={"name": "paged", "options": {"num_blocks": 64, **cache_options}},
                          scheduler={"name": "continuous"}, decoding={"name": "greedy"})

    int8 = LLM(config(kv_dtype="int8"))
    dense = LLM(config())
    assert isinstance(int8.pipeline.cache.layer(0), Int8KVStorage)
    assert int8.pipeline.resolved.choices["attention"].entry.name in ("sdpa", "cascade")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 20, 21]]  # a shared prefix block, then decode
    outs = int8.generate(prompts, {"max_tokens": 6, "ignore_eos": True})
    assert [len(o.token_ids) for o in outs] == [6, 6]
    ids = prompts[0] + outs[0].token_ids
    error = (int8.engine.score(ids) - dense.engine.score(ids)).norm() / dense.engine.score(ids).norm()
    assert error < 0.05


def test_kv_dtype_is_validated():
    with pytest.raises(ValueError, match="kv_dtype"):
        PagedOptions(kv_dtype="fp8")


def test_a_backend_that_reads_only_float_caches_is_declined_with_the_reason():
    """Backends say which storage dtypes they read; one that reads only floating-point K/V
    is not selected over an int8 cache, and the error names the dtypes."""
    from tessellm.plugins.attention.sdpa import SdpaAttention

    class FloatOnly(SdpaAttention):
        cache_dtypes = frozenset({torch.float32, torch.bfloat16})

    ctx = SelectionContext(device=torch.device("cpu"), dtype=torch.float32, model=SimpleNamespace(head_dim=16),
                           options=FloatOnly.Options(), max_model_len=64, kv_layout=KVLayout("kv", 16, torch.int8))
    assert any("torch.int8" in r and "reads cache dtypes" in r for r in FloatOnly.unsupported_reasons(ctx))


def test_bench_reports_what_the_int8_cache_holds_in_the_same_budget(cpu_config, tiny_model):
    from tessellm.bench.offline import run_offline
    from tessellm.bench.workloads import make_workload

    def run(kv_dtype):
        llm = LLM(cpu_config(tiny_model("llama"), dtype="bfloat16", scheduler={"name": "continuous"},
                             cache={"name": "paged", "options": {"cpu_memory_bytes": 2**22, "kv_dtype": kv_dtype}}))
        requests = make_workload("mixed", num_requests=2, tokenizer=llm.tokenizer, max_model_len=64,
                                 prompt_median=8, prompt_max=16, output_median=2, output_min=1, output_max=4)
        return run_offline(llm, requests).metrics()

    dense, int8 = run("auto"), run("int8")
    ratio = 2 * 16 / (16 + 2)  # the tiny model's head_dim is 16: bfloat16 bytes over int8 plus a float16 scale
    assert dense["kv_bytes_per_token"] / int8["kv_bytes_per_token"] == pytest.approx(ratio)
    assert int8["kv_capacity_tokens"] / dense["kv_capacity_tokens"] == pytest.approx(ratio, rel=0.01)  # same 4 MiB
