"""`flash` (Triton) against the float64 reference: random packed batches (decodes, chunks
after cached context, whole prompts), scattered block tables, GQA, sliding windows, shared
prefix blocks, decodes through the split-K kernel with 1 to 8 splits (some past the end of a
short context); unwritten cache slots hold NaN to prove the kernels never read them; the
layer features (logit softcaps that bind and saturate, attention sinks, windows per layer,
several layers on one plan, the CUDA-graph plan among them).

Without a GPU everything runs under Triton's interpreter on CPU tensors (small shapes; CI).
With one, the same tests run compiled on CUDA, plus larger shapes (lengths up to 2048)."""

from __future__ import annotations

import copy
import dataclasses
import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first imported

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

from tessellm.core.model.spec import LayerAttention  # noqa: E402
from tessellm.core.plugin import SelectionContext  # noqa: E402
from tessellm.plugins.attention.flash import FlashAttention, FlashOptions  # noqa: E402
from tessellm.testing import attention as ref  # noqa: E402
from tessellm.testing.conformance.attention import sink_logits  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
# float32 dots are exact-ish ("ieee"); bf16 is held to flash-attention's rule
TOLERANCE = {torch.float32: 2e-5}


def on_device(case: ref.PackedCase) -> ref.PackedCase:
    """The case with the kernel's inputs on DEVICE (the reference stays on the CPU)."""
    return case if DEVICE.type == "cpu" else ref.case_to(case, DEVICE)


@st.composite
def packed_batches(draw):
    num_seqs = draw(st.integers(1, 4))
    kv_lens = draw(st.lists(st.integers(1, 70), min_size=num_seqs, max_size=num_seqs))
    q_lens = [draw(st.sampled_from([1, n, draw(st.integers(1, n))])) for n in kv_lens]
    num_kv_heads = draw(st.integers(1, 2))
    block_size = draw(st.sampled_from([1, 4, 16, 32]))
    return dict(kv_lens=kv_lens, q_lens=q_lens, num_kv_heads=num_kv_heads,
                num_heads=num_kv_heads * draw(st.sampled_from([1, 2, 4])),
                head_dim=draw(st.sampled_from([16, 32, 48, 64])), block_size=block_size,
                shared_blocks=draw(st.sampled_from([0, 0, 1, 2])),
                window=draw(st.one_of(st.none(), st.integers(1, 24))),
                block_n=draw(st.sampled_from([16, 32])), seed=draw(st.integers(0, 2**16)),
                split_decode=draw(st.booleans()), decode_splits=draw(st.sampled_from([None, 1, 3, 8])),
                packed_prefill=draw(st.booleans()))


def stacked_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``q``, ``k``, ``v`` as views into one [T, (Hq + 2 Hkv) * D] tensor, as the stacked q/k/v
    projection hands them to the backend (rows strided, heads contiguous)."""
    t = q.shape[0]
    qkv = torch.cat([x.reshape(t, -1) for x in (q, k, v)], dim=1)
    a, b = q[0].numel(), k[0].numel()
    return (qkv[:, :a].view(q.shape), qkv[:, a:a + b].view(k.shape), qkv[:, a + b:].view(v.shape))


def model_of(p):
    """The model stub of case parameters ``p``: one layer with the model-wide ``window``, or,
    where ``p`` names a ``softcap`` or ``sinks`` (a [num_heads] tensor), one layer with them."""
    if p.get("softcap") is None and p.get("sinks") is None:
        return ref.model_stub(p["head_dim"], p["window"])
    layer = LayerAttention(sliding_window=p["window"], softcap=p.get("softcap"), sinks=p.get("sinks") is not None)
    return ref.model_stub(p["head_dim"], layers=(layer,))


def reference(case, p):
    """The float64 reference of case parameters ``p`` (window, softcap, sinks)."""
    return ref.reference_packed(case, p["head_dim"] ** -0.5, p["window"], p.get("softcap"), p.get("sinks"))


def run_flash(case, p, dtype):
    options = FlashOptions(block_n=p["block_n"], split_decode=p["split_decode"], decode_splits=p["decode_splits"],
                           packed_prefill=p.get("packed_prefill", False))
    backend = FlashAttention(options, model_of(p), DEVICE, dtype)
    case = on_device(case)
    plan = backend.plan(case.batch, cache=None)
    q, k, v = stacked_views(case.q, case.k_new, case.v_new) if options.packed_prefill else (case.q, case.k_new, case.v_new)
    sinks = {} if p.get("sinks") is None else {"sinks": p["sinks"].to(DEVICE)}
    out = backend.forward(0, q, k, v, case.storage, plan, **sinks)
    k_back, v_back = case.storage.gather(case.batch.slot_mapping)  # the new tokens went where mapped
    stored = case.storage.stored_value
    assert torch.equal(k_back, stored(case.k_new)) and torch.equal(v_back, stored(case.v_new))
    return out.cpu()


@given(packed_batches())
def test_flash_matches_float64_reference_float32(p):
    case = ref.make_case(p["kv_lens"], p["q_lens"], p["num_heads"], p["num_kv_heads"], p["head_dim"],
                         p["block_size"], torch.float32, p["seed"], shared_blocks=p["shared_blocks"])
    out = run_flash(case, p, torch.float32)
    expected = ref.reference_packed(case, p["head_dim"] ** -0.5, p["window"])
    assert out.shape == case.q.shape and out.dtype == torch.float32
    err = (out.double() - expected).abs().max().item()
    assert err <= TOLERANCE[torch.float32], f"max abs error {err:.3g}"


@settings(max_examples=15)
@given(packed_batches())
def test_flash_bfloat16_error_within_twice_torch_sdpa(p):
    check_bfloat16(p)


@settings(max_examples=10)
@given(packed_batches())
def test_flash_reads_an_int8_cache_float32(p):
    """An int8 cache (``kv_dtype: int8``), dequantized tile by tile inside the prefill and
    decode kernels: the float64 reference over the values the cache holds, within float32
    rounding (an int8 value times a float16 scale is exact in float32)."""
    case = ref.int8_case(ref.make_case(p["kv_lens"], p["q_lens"], p["num_heads"], p["num_kv_heads"], p["head_dim"],
                                       p["block_size"], torch.float32, p["seed"], shared_blocks=p["shared_blocks"]))
    out = run_flash(case, p, torch.float32)
    expected = ref.reference_packed(case, p["head_dim"] ** -0.5, p["window"])
    err = (out.double() - expected).abs().max().item()
    assert err <= TOLERANCE[torch.float32], f"max abs error {err:.3g}"


@settings(max_examples=8)
@given(packed_batches())
def test_flash_reads_an_int8_cache_bfloat16(p):
    check_bfloat16(p, int8=True)


def check_bfloat16(p, int8: bool = False):
    """flash-attention's own rule: the kernel's error against float64 is at most twice what
    torch's SDPA makes in bf16 on the same inputs (plus a small absolute floor). Under the
    interpreter the kernel's dots run in float32 (the interpreter cannot multiply bfloat16),
    so this checks bf16 loads, stores and the algorithm; the GPU run checks bf16 dots.
    ``int8``: both read the same int8 cache (SDPA through ``gather``)."""
    case = ref.make_case(p["kv_lens"], p["q_lens"], p["num_heads"], p["num_kv_heads"], p["head_dim"],
                         p["block_size"], torch.bfloat16, p["seed"], shared_blocks=p["shared_blocks"])
    if int8:
        case = ref.int8_case(case)
    case = dataclasses.replace(case, q=case.q * p.get("q_scale", 1.0))
    expected = reference(case, p)
    out = run_flash(case, p, torch.bfloat16)
    from tessellm.plugins.attention.sdpa import SdpaAttention, SdpaOptions

    sdpa = SdpaAttention(SdpaOptions(), model_of(p), DEVICE, torch.bfloat16)
    case = on_device(case)
    sinks = {} if p.get("sinks") is None else {"sinks": p["sinks"].to(DEVICE)}
    torch_out = sdpa.forward(0, case.q, case.k_new, case.v_new, case.storage, sdpa.plan(case.batch, None),
                             **sinks).cpu()
    ours = (out.double() - expected).abs().max().item()
    theirs = (torch_out.double() - expected).abs().max().item()
    assert ours <= 2 * theirs + 1e-3, f"flash {ours:.3g} vs sdpa {theirs:.3g}"


@pytest.mark.skipif(not CUDA, reason="large shapes need a GPU (the interpreter would take hours)")
@settings(max_examples=25)
@given(st.lists(st.integers(1, 2048), min_size=1, max_size=6), st.sampled_from([(8, 8), (32, 8), (16, 2), (8, 1)]),
       st.sampled_from([64, 128]), st.sampled_from([16, 32]), st.integers(0, 2**16), st.data())
def test_flash_large_shapes_on_gpu(kv_lens, heads, head_dim, block_size, seed, data):
    q_lens = [data.draw(st.sampled_from([1, n, data.draw(st.integers(1, n))])) for n in kv_lens]
    check_bfloat16(dict(kv_lens=kv_lens, q_lens=q_lens, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                        block_size=block_size, shared_blocks=data.draw(st.sampled_from([0, 4])), window=None,
                        block_n=64, seed=seed, split_decode=True, decode_splits=None,
                        packed_prefill=data.draw(st.booleans())), int8=data.draw(st.booleans()))


# ------------------------------------------------------------------ layer features (plugin API 1.8)

SOFTCAPS = [0.5, 2.0, 30.0]  # every cap binds on some scores; 0.5 saturates (tanh near +-1) on most


@st.composite
def featured_batches(draw):
    """``packed_batches`` whose one layer has a softcap, sinks or both (and a window or none):
    with a softcap, queries are at times scaled up eightfold, so capped scores saturate and
    ``exp`` overflows inside the cap (it must hold the cap, not give NaN)."""
    p = draw(packed_batches())
    which = draw(st.sampled_from(["softcap", "sinks", "both"]))
    softcap = draw(st.sampled_from(SOFTCAPS)) if which != "sinks" else None
    sinks = sink_logits(p["num_heads"], p["seed"]) if which != "softcap" else None
    return dict(p, softcap=softcap, sinks=sinks, q_scale=draw(st.sampled_from([1.0, 8.0])) if softcap else 1.0)


def featured_case(p, dtype=torch.float32, int8=False):
    case = ref.make_case(p["kv_lens"], p["q_lens"], p["num_heads"], p["num_kv_heads"], p["head_dim"],
                         p["block_size"], dtype, p["seed"], shared_blocks=p["shared_blocks"])
    case = ref.int8_case(case) if int8 else case
    return dataclasses.replace(case, q=case.q * p["q_scale"])


@settings(max_examples=20)
@given(featured_batches())
def test_softcap_and_sinks_match_float64_reference_float32(p):
    """A layer's softcap (after the scale, before the mask, in the kernels' base-2 domain) and
    sinks (once per softmax: in the merge of a split decode) in the prefill kernel, packed
    or gathered, and the split-K decode with 1 to 8 splits."""
    case = featured_case(p)
    out = run_flash(case, p, torch.float32)
    assert torch.isfinite(out).all()
    err = (out.double() - reference(case, p)).abs().max().item()
    assert err <= TOLERANCE[torch.float32], f"max abs error {err:.3g}"


@settings(max_examples=8)
@given(featured_batches())
def test_softcap_and_sinks_over_an_int8_cache_float32(p):
    case = featured_case(p, int8=True)
    err = (run_flash(case, p, torch.float32).double() - reference(case, p)).abs().max().item()
    assert err <= TOLERANCE[torch.float32], f"max abs error {err:.3g}"


@settings(max_examples=2)
@given(featured_batches())
def test_softcap_and_sinks_bfloat16_error_within_twice_torch_sdpa(p):
    check_bfloat16(p)


def _layers_case(kv_lens, q_lens, layers, seed=5):
    """A float32 case with a model of ``layers`` (2 KV heads, GQA 2, head dim 32, blocks of 4)."""
    case = ref.make_case(kv_lens, q_lens, 4, 2, 32, 4, torch.float32, seed, shared_blocks=1)
    model = ref.model_stub(32, layers=layers)
    model.num_kv_heads = 2  # the CUDA-graph plan sizes its splits by it
    return case, model


def _run_layers(backend, case, plan, layers, seed=5):
    """Every layer's forward on ``plan``, each over a cache of its own; each checked against
    the float64 reference of its own features."""
    for layer, features in enumerate(layers):
        layer_case = on_device(dataclasses.replace(case, storage=copy.deepcopy(case.storage)))
        sinks = sink_logits(4, seed + layer) if features.sinks else None
        extra = {} if sinks is None else {"sinks": sinks.to(DEVICE)}
        out = backend.forward(layer, layer_case.q, layer_case.k_new, layer_case.v_new, layer_case.storage, plan,
                              **extra).cpu()
        expected = ref.reference_packed(case, 32 ** -0.5, features.sliding_window, features.softcap, sinks)
        err = (out.double() - expected).abs().max().item()
        assert err <= TOLERANCE[torch.float32], f"layer {layer} ({features}): max abs error {err:.3g}"


GEMMA2_LIKE = (LayerAttention(sliding_window=6, softcap=1.5), LayerAttention(softcap=1.5))
GPT_OSS_LIKE = (LayerAttention(sliding_window=6, sinks=True), LayerAttention(sinks=True))


@pytest.mark.parametrize("layers", [GEMMA2_LIKE, GPT_OSS_LIKE, (LayerAttention(sliding_window=3), LayerAttention(),
                                                                 LayerAttention(sliding_window=10, softcap=0.5,
                                                                                sinks=True))],
                         ids=["gemma2", "gpt-oss", "mixed"])
def test_layers_share_one_plan(layers):
    """Layers of different windows, caps and sinks on one step's plan (prompts, a chunk after
    cached context, decodes split 3 ways), each with its own features; a window-less layer
    reads the prompts' own K/V as packed rows (``packed_prefill``) while a windowed one
    gathers them."""
    case, model = _layers_case([30, 21, 40, 9], [30, 7, 1, 1], layers)
    backend = FlashAttention(FlashOptions(block_n=16, decode_splits=3, packed_prefill=True), model, DEVICE,
                             torch.float32)
    _run_layers(backend, case, backend.plan(on_device(case).batch, cache=None), layers)


def test_graph_plan_serves_layers_with_features():
    """The CUDA-graph plan (every row through the split-K decode, the split count fixed for a
    context longer than any here, so some splits lie past a context's end and are empty)
    stays valid for layers with features: windows, caps and sinks are arguments of each
    layer's launch, the sinks counted once in the merge."""
    layers = GPT_OSS_LIKE + GEMMA2_LIKE
    case, model = _layers_case([37, 5, 64, 1], [1, 1, 1, 1], layers)
    backend = FlashAttention(FlashOptions(block_n=16), model, DEVICE, torch.float32)
    plan = backend.graph_plan(on_device(case).batch, None, max_seq_len=256)
    assert plan.decode_splits > 1 and plan.others is None
    _run_layers(backend, case, plan, layers)


def test_sinks_join_the_softmax_once_whatever_the_splits():
    """Sinks large enough to take most of each softmax: a decode split 1, 2 or 8 ways gives
    the one-split result (a sink counted per split would shrink the output by the splits)."""
    case, model = _layers_case([64, 48], [1, 1], (LayerAttention(sinks=True),))
    sinks = torch.tensor([4.0, 6.0, -3.0, 0.0])
    expected = ref.reference_packed(case, 32 ** -0.5, sinks=sinks)
    outs = []
    for splits in (1, 2, 8):
        backend = FlashAttention(FlashOptions(block_n=16, decode_splits=splits), model, DEVICE, torch.float32)
        layer_case = on_device(dataclasses.replace(case, storage=copy.deepcopy(case.storage)))
        outs.append(backend.forward(0, layer_case.q, layer_case.k_new, layer_case.v_new, layer_case.storage,
                                    backend.plan(layer_case.batch, None), sinks=sinks.to(DEVICE)).cpu())
        assert (outs[-1].double() - expected).abs().max().item() <= TOLERANCE[torch.float32]
    assert (expected - ref.reference_packed(case, 32 ** -0.5)).abs().max().item() > 0.1  # the sinks matter


def test_forward_rotary_passes_the_sinks():
    """``forward_rotary`` (RoPE fused into the KV store) serves a layer's softcap and sinks as
    ``forward`` does after rotating q and k itself."""
    from tessellm.core.model.fused_ops import rotary_reference

    layers = (LayerAttention(softcap=2.0, sinks=True),)
    case, model = _layers_case([12, 20], [12, 3], layers)
    backend = FlashAttention(FlashOptions(block_n=16), model, DEVICE, torch.float32)
    angles = torch.rand(case.q.shape[0], 16, generator=torch.Generator().manual_seed(1)) * 6.28
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    sinks = sink_logits(4, 9).to(DEVICE)
    fused_case = on_device(dataclasses.replace(case, storage=copy.deepcopy(case.storage)))
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    fused = backend.forward_rotary(0, fused_case.q.clone(), fused_case.k_new.clone(), fused_case.v_new, cos, sin,
                                   fused_case.storage, backend.plan(fused_case.batch, None), sinks=sinks)
    plain_case = on_device(dataclasses.replace(case, storage=copy.deepcopy(case.storage)))
    plain = backend.forward(0, rotary_reference(plain_case.q, cos, sin), rotary_reference(plain_case.k_new, cos, sin),
                            plain_case.v_new, plain_case.storage, backend.plan(plain_case.batch, None), sinks=sinks)
    assert (fused.cpu() - plain.cpu()).abs().max().item() <= 1e-5


def test_sinks_must_be_one_per_query_head():
    case, model = _layers_case([5], [5], (LayerAttention(sinks=True),))
    backend = FlashAttention(FlashOptions(), model, DEVICE, torch.float32)
    case = on_device(case)
    with pytest.raises(ValueError, match=r"one logit per query head, shape \(4,\)"):
        backend.forward(0, case.q, case.k_new, case.v_new, case.storage, backend.plan(case.batch, None),
                        sinks=torch.zeros(2, device=DEVICE))


def test_flash_declares_every_layer_feature():
    from tessellm.core.model.spec import LAYER_FEATURES

    # every feature but a window on a bidirectional (encoder) layer (sdpa and cascade serve it)
    # and attention bidirectional within each image (only sdpa)
    assert FlashAttention.layer_features == frozenset(LAYER_FEATURES) - {"bidirectional_window", "bidirectional_images"}
    model = ref.model_stub(64, layers=GEMMA2_LIKE + GPT_OSS_LIKE)
    ctx = SelectionContext(device=DEVICE, dtype=torch.float32, model=model, options=FlashOptions(), max_model_len=64)
    assert FlashAttention.unsupported_reasons(ctx) == []


def _ctx(device: str, auto: bool, dtype: torch.dtype = torch.float32) -> SelectionContext:
    return SelectionContext(device=torch.device(device), dtype=dtype, model=ref.model_stub(64), options=FlashOptions(),
                            max_model_len=4096, auto=auto)


def test_flash_is_refused_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ctx = _ctx("cpu", auto=False)
    reasons = FlashAttention.unsupported_reasons(ctx)
    assert any("TRITON_INTERPRET=1" in r for r in reasons)


@pytest.mark.parametrize("options,kv_dtype", [({"packed_prefill": False}, "auto"), ({"packed_prefill": True}, "auto"),
                                              ({"packed_prefill": True}, "int8")])
def test_whole_model_matches_sdpa(tiny_model, cpu_config, options, kv_dtype):
    """`--set attention.name=flash` on a machine without a GPU: the tiny model through the
    paged cache and continuous batching (prompts in chunks) gives sdpa's tokens and logits;
    also with the prompts' own K/V read as packed rows (``packed_prefill``), and over an int8
    cache (both read the same quantized K/V; flash turns the packed rows off there)."""
    from tessellm import LLM

    def llm(attention, options=None):
        return LLM(cpu_config(tiny_model("llama"), device=DEVICE.type,
                              attention={"name": attention, "options": options or {}},
                              cache={"name": "paged", "options": {"block_size": 16, "num_blocks": 64,
                                                                  "kv_dtype": kv_dtype}},
                              scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 24}}))

    flash, sdpa = llm("flash", options), llm("sdpa")
    assert flash.pipeline.resolved.summary()["attention"]["name"] == "flash"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 30, 17)]
    params = {"max_tokens": 6, "ignore_eos": True}
    assert [o.token_ids for o in flash.generate(prompts, params)] == [o.token_ids for o in sdpa.generate(prompts, params)]
    ids = prompts[1] + prompts[2]
    assert (flash.engine.score(ids) - sdpa.engine.score(ids)).abs().max().item() < 1e-4


def test_auto_picks_flash_on_cuda_only(monkeypatch):
    """flash outranks sdpa and cascade under ``auto`` on CUDA; on a CPU auto never picks it,
    even under the interpreter (named, it runs there)."""
    from tessellm.plugins.attention.cascade import CascadeAttention

    assert FlashAttention.auto_priority > CascadeAttention.auto_priority
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert FlashAttention.unsupported_reasons(_ctx("cuda", True, torch.bfloat16)) == []
    assert any("CUDA only" in r for r in FlashAttention.unsupported_reasons(_ctx("cpu", True, torch.bfloat16)))
    assert FlashAttention.unsupported_reasons(_ctx("cpu", False, torch.bfloat16)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_prefill_reads_new_tokens_from_the_packed_rows_with_the_same_result(monkeypatch, dtype):
    """``packed_prefill``: whole prompts (several key tiles), a chunk after cached context that
    does not start on a tile boundary, a chunk shorter than a tile, and decodes in one batch.
    The packed path is taken and gives exactly the gather path's output (same tiles, same
    order, same values)."""
    from tessellm.plugins.attention.flash import prefill as flash_kernels

    made = []
    real = flash_kernels._row_descriptor
    monkeypatch.setattr(flash_kernels, "_row_descriptor", lambda t, n: made.append(t.shape) or real(t, n))
    p = dict(kv_lens=[70, 53, 40, 9, 33], q_lens=[70, 21, 5, 1, 33], num_heads=4, num_kv_heads=2, head_dim=32,
             block_size=4, shared_blocks=1, window=None, block_n=16, seed=3, split_decode=True, decode_splits=None)
    case = ref.make_case(p["kv_lens"], p["q_lens"], p["num_heads"], p["num_kv_heads"], p["head_dim"],
                         p["block_size"], dtype, p["seed"], shared_blocks=p["shared_blocks"])
    gathered = run_flash(case, dict(p, packed_prefill=False), dtype)
    assert not made
    packed = run_flash(case, dict(p, packed_prefill=True), dtype)
    assert len(made) == 2  # one descriptor over K, one over V
    assert torch.equal(packed, gathered)
    expected = ref.reference_packed(case, p["head_dim"] ** -0.5, None)
    assert (packed.double() - expected).abs().max().item() <= (TOLERANCE[torch.float32] if dtype == torch.float32
                                                                 else 2e-2)


def test_packed_source_is_used_only_where_descriptors_fit():
    from tessellm.plugins.attention.flash.prefill import packed_source_ok

    t = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    assert packed_source_ok(t, 64, None)
    assert not packed_source_ok(t, 64, 16)  # sliding window: the gather path's window loop
    assert not packed_source_ok(torch.zeros(10, 2, 48, dtype=torch.bfloat16), 48, None)  # padded head dim
    wide = torch.zeros(10, 2 * 64 + 8, dtype=torch.bfloat16)
    assert packed_source_ok(wide[:, 8:136].view(10, 2, 64), 64, None)  # 16 bytes into each row: aligned
    assert not packed_source_ok(wide[:, 1:129].view(10, 2, 64), 64, None)  # 2 bytes in: not aligned
    assert not packed_source_ok(torch.zeros(10, 64, 2, dtype=torch.bfloat16).transpose(1, 2), 64, None)


def test_kernels_compile_for_hopper():
    """The compiled (not interpreted) kernels, the packed prefill's TMA path included, build
    for an H100 (sm_90a) with the installed Triton, without a GPU: bench/compile_hopper.py
    --check, in a process of its own (this one runs the kernels interpreted)."""
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this Triton has no NVIDIA backend tools")
    script = Path(__file__).parents[4] / "bench" / "compile_hopper.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert any('"tma_loads": 0' not in r and "PACKED=True" in r for r in rows)  # the packed path uses TMA
    assert all('"fits": true' in r for r in rows)  # no spills, shared memory within the H100's
