"""Bidirectional (encoder) layers, plugin API 1.18: `sdpa`, `cascade` and `flash` (without
windows; under Triton's interpreter on a CPU) against the float64
reference with ``causal`` False (every query sees every key of its sequence; a window bounds
the distance both ways), over packed batches of whole prompts (an encoder's steps) and of
chunks and single tokens (what the contract defines, though an engine never sends an
encoder's prompt in pieces); backends that do not serve it decline, naming the feature."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessellm.core.model.spec import LayerAttention
from tessellm.plugins.attention.cascade import CascadeAttention, CascadeOptions
from tessellm.plugins.attention.flash import FlashAttention, FlashOptions
from tessellm.plugins.attention.sdpa import SdpaAttention, SdpaOptions
from tessellm.testing import attention as ref

TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}


@st.composite
def encoder_batches(draw):
    num_seqs = draw(st.integers(1, 5))
    kv_lens = draw(st.lists(st.integers(1, 60), min_size=num_seqs, max_size=num_seqs))
    whole = draw(st.booleans())  # an encoder's step: every prompt whole
    q_lens = kv_lens if whole else [draw(st.sampled_from([1, n, draw(st.integers(1, n))])) for n in kv_lens]
    num_kv_heads = draw(st.integers(1, 2))
    return dict(kv_lens=kv_lens, q_lens=q_lens, num_kv_heads=num_kv_heads,
                num_heads=num_kv_heads * draw(st.sampled_from([1, 2, 4])), head_dim=draw(st.sampled_from([16, 32, 64])),
                block_size=draw(st.sampled_from([1, 4, 16])), window=draw(st.one_of(st.none(), st.integers(1, 12))),
                batch_decode=draw(st.booleans()), dtype=draw(st.sampled_from([torch.float64, torch.float32])),
                seed=draw(st.integers(0, 2**16)), backend=draw(st.sampled_from(["sdpa", "cascade", "flash"])))


BACKENDS = {"sdpa": (SdpaAttention, SdpaOptions), "cascade": (CascadeAttention, CascadeOptions),
            "flash": (FlashAttention, FlashOptions)}


@settings(max_examples=8)  # the CI profile's 15 cost 10 s on the CPU for one layer feature
@given(encoder_batches())
def test_bidirectional_layers_match_the_float64_reference(p):
    case = ref.make_case(p["kv_lens"], p["q_lens"], p["num_heads"], p["num_kv_heads"], p["head_dim"],
                         p["block_size"], p["dtype"], p["seed"])
    window = None if p["backend"] == "flash" else p["window"]  # flash serves no window on such layers
    layers = [LayerAttention(sliding_window=window, rope=None, causal=False), LayerAttention(rope=None, causal=False)]
    model = ref.model_stub(p["head_dim"], layers=layers)
    cls, options = BACKENDS[p["backend"]]
    backend = cls(options() if cls is FlashAttention else options(batch_decode=p["batch_decode"]), model,
                  torch.device("cpu"), p["dtype"])
    plan = backend.plan(case.batch, cache=None)
    for layer, window in ((0, window), (1, None)):  # a windowed layer and a global one share the plan
        out = backend.forward(layer, case.q, case.k_new, case.v_new, case.storage, plan)
        expected = ref.reference_packed(case, p["head_dim"] ** -0.5, window, causal=False)
        err = (out.double() - expected).abs().max().item()
        assert err <= TOLERANCE[p["dtype"]], f"layer {layer}: max abs error {err:.3g}"
    ref.assert_stored(case)


def test_a_whole_prompt_differs_from_causal_where_later_keys_matter():
    """The non-causal path is not the causal one by accident: a prompt's first query sees the
    last key."""
    case = ref.make_case([12], [12], 4, 2, 32, 4, torch.float64, seed=3)
    both = SdpaAttention(SdpaOptions(), ref.model_stub(32, layers=[LayerAttention(rope=None, causal=False)]),
                         torch.device("cpu"), torch.float64)
    one = SdpaAttention(SdpaOptions(), ref.model_stub(32), torch.device("cpu"), torch.float64)
    out_both = both.forward(0, case.q, case.k_new, case.v_new, case.storage, both.plan(case.batch, None))
    out_one = one.forward(0, case.q, case.k_new, case.v_new, case.storage, one.plan(case.batch, None))
    assert not torch.allclose(out_both[0], out_one[0]) and torch.allclose(out_both[-1], out_one[-1])


@pytest.mark.parametrize("name,window", [("quest", None), ("mla", None), ("flash", 8)])
def test_backends_without_the_feature_decline_naming_it(name, window):
    from tessellm.core.registry import get_registry

    entry = get_registry().get("attention", name)
    stub = ref.model_stub(32, layers=[LayerAttention(sliding_window=window, rope=None, causal=False)])
    reasons = entry.cls.layer_feature_reasons(stub)
    words = "a symmetric window on bidirectional layers" if window else "bidirectional (encoder) attention"
    assert any(words in r and "serve it" in r for r in reasons), reasons
