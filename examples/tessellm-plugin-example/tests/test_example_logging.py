"""`example-logging` against the float64 reference, its registration and its reasons."""

from __future__ import annotations

import pytest
import torch

import tessellm
from tessellm.testing import attention as ref
from tessellm_plugin_example import attention as plugin_module
from tessellm_plugin_example.attention import LoggingAttention, LoggingOptions

TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("window", [None, 8])
def test_matches_reference(dtype, window):
    # three sequences: a decode (1 query token), a prefill chunk after cached context, a whole prompt
    case = ref.make_case(kv_lens=[37, 20, 9], q_lens=[1, 6, 9], num_heads=8, num_kv_heads=2, head_dim=64,
                         block_size=16, dtype=dtype, seed=0)
    backend = LoggingAttention(LoggingOptions(log_every=0), ref.model_stub(64, window), torch.device("cpu"), dtype)
    plan = backend.plan(case.batch, cache=None)
    out = backend.forward(0, case.q, case.k_new, case.v_new, case.storage, plan)
    expected = ref.reference_packed(case, 64 ** -0.5, window)
    assert out.shape == case.q.shape and out.dtype == dtype
    assert (out.double() - expected).abs().max().item() <= TOLERANCE[dtype]
    ref.assert_stored(case)  # the step's K/V are in the cache for the next step
    assert (backend.steps, backend.layer_calls, backend.query_tokens) == (1, 1, 16)


def test_registers_through_its_hook():
    registry = tessellm.PluginRegistry(entry_points=False, modules=[plugin_module])
    assert registry.failures == []
    assert registry.get("attention", "example-logging").cls is LoggingAttention


def test_options_reject_unknown_keys():
    with pytest.raises(ValueError):
        LoggingOptions(log_evry=2)


def test_unsupported_reasons():
    def ctx(max_context):
        return tessellm.SelectionContext(device=torch.device("cpu"), dtype=torch.float32, model=ref.model_stub(64),
                                         options=LoggingOptions(max_context=max_context), max_model_len=8192)

    assert LoggingAttention.unsupported_reasons(ctx(None)) == []
    [reason] = LoggingAttention.unsupported_reasons(ctx(2048))
    assert "max_context=2048" in reason and "8192" in reason
