"""The attention contract as properties, checked against the float64 reference of
tessellm.testing.attention on random packed batches over a scattered, NaN-filled cache.

The tolerance rule (flash-attention's): in a dtype below float64, the plugin's largest
absolute error against the float64 reference may be at most twice that of plain torch
attention computed in the same dtype, plus a small floor for dtypes whose torch error is
near zero (``ERROR_FLOOR``)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, strategies as st

from tessellm.core.interfaces.kv import KVLayout
from tessellm.core.model.spec import LayerAttention, MLASpec, ModelSpec
from tessellm.core.plugin import SelectionContext
from tessellm.testing import attention as ref
from tessellm.testing.conformance.base import ConformanceSuite, property_settings

KEPT_EXTRAS = frozenset({"key_bounds"})
"""Layout extras the suite's reference storage keeps for a backend that asks for them."""

ERROR_FLOOR = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}
"""Absolute error always allowed in each dtype, beside twice torch's own error."""

PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


SOFTCAPS = (0.5, 1.0, 2.0, 4.0)
"""Logit softcaps the suite draws: the suite's scaled scores are about unit normal, so each
of these binds (a backend that ignores the cap misses by far more than the tolerance)."""


def model_spec(num_heads: int, num_kv_heads: int, head_dim: int, window: int | None = None,
               layers: tuple[LayerAttention, ...] = ()) -> ModelSpec:
    """A model of these attention shapes (the rest of it is irrelevant to attention);
    ``layers``: one ``LayerAttention`` per layer (empty: one layer with the model-wide
    ``window``)."""
    return ModelSpec(model_type="llama", vocab_size=256, hidden_size=num_heads * head_dim, intermediate_size=64,
                     num_layers=max(len(layers), 1), num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=True,
                     qkv_bias=False, o_bias=False, mlp_bias=False, sliding_window=window, rope_type="default",
                     hf_config=None, layer_attention=tuple(layers))


def sink_logits(num_heads: int, seed: int) -> torch.Tensor:
    """Random attention-sink logits [num_heads] float32, as a layer with sinks passes them:
    spread so that some heads' sinks take most of the weight and others almost none."""
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2.0 + 1.0


def describe(layer: LayerAttention) -> str:
    """A layer's features in words, for failure messages: "window 4, softcap 2.0, sinks"."""
    parts = [f"window {layer.sliding_window}"] if layer.sliding_window is not None else []
    parts += [f"softcap {layer.softcap}"] if layer.softcap is not None else []
    parts += ["sinks"] if layer.sinks else []
    return ", ".join(parts) or "plain"


LATENT_SHAPE = MLASpec(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
                       rope_interleave=False)
"""The multi-head latent attention shape a latent backend is checked on: latent widths that
are not head-sized, a value head unlike the query head."""


def latent_model_spec(num_heads: int, mla: MLASpec = LATENT_SHAPE) -> ModelSpec:
    """A DeepSeek-V2-like model of these MLA shapes (its attention only)."""
    return ModelSpec(model_type="deepseek_v2", vocab_size=256, hidden_size=num_heads * mla.v_head_dim,
                     intermediate_size=64, num_layers=1, num_heads=num_heads, num_kv_heads=num_heads,
                     head_dim=mla.qk_head_dim, rms_norm_eps=1e-6, max_position_embeddings=4096,
                     tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, sliding_window=None,
                     rope_type="default", hf_config=None, mla=mla)


def torch_latent_attention(case: ref.LatentCase) -> torch.Tensor:
    """Decompressed MLA computed in the case's own dtype: the error a latent backend is
    allowed to double."""
    outs, start = [], 0
    r = case.up.kv_lora_rank
    for lat, n_q in zip(case.latent_full, case.q_lens):
        keys = torch.cat((torch.einsum("lr,hnr->lhn", lat[:, :r], case.up.w_uk),
                          lat[:, None, r:].expand(-1, case.up.w_uk.shape[0], -1)), dim=-1)
        values = torch.einsum("lr,hvr->lhv", lat[:, :r], case.up.w_uv)
        q = torch.cat((case.q_nope[start:start + n_q], case.q_pe[start:start + n_q]), dim=-1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * case.scale
        visible = torch.arange(len(lat))[None, :] <= torch.arange(len(lat) - n_q, len(lat))[:, None]
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values))
        start += n_q
    return torch.cat(outs)


def torch_attention(case: ref.PackedCase, scale: float, window: int | None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch attention computed in the case's own dtype: the error a kernel is allowed
    to double (``softcap``, ``sinks`` as in ``tessellm.testing.attention.reference_attention``)."""
    outs, start = [], 0
    for k, v, n_q in zip(case.k_full, case.v_full, case.q_lens):
        q = case.q[start:start + n_q]
        group = q.shape[1] // k.shape[1]
        keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(len(k) - n_q, len(k))[:, None]
        k_pos = torch.arange(len(k))[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= q_pos - k_pos < window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.to(scores.dtype)[:, None, None].expand(-1, n_q, 1)
            weights = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            weights = scores.softmax(dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", weights, values))
        start += n_q
    return torch.cat(outs)


@st.composite
def lengths(draw: Any, kind: str) -> tuple[list[int], list[int]]:
    """(context lengths, query lengths) of 1-4 sequences: ``prefill`` (whole prompts),
    ``decode`` (one query token), ``chunked`` (a chunk after a cached prefix) or ``mixed``.
    Lengths include 1 and primes."""
    count = draw(st.integers(1, 4))
    contexts = draw(st.lists(st.one_of(st.sampled_from((1, *PRIMES)), st.integers(1, 48)),
                             min_size=count, max_size=count))
    if kind == "chunked":
        contexts = [max(n, 2) for n in contexts]
    queries = []
    for n in contexts:
        choice = {"prefill": "all", "decode": "one", "chunked": "chunk"}.get(kind) or \
            draw(st.sampled_from(("all", "one", "chunk")))
        if choice == "all":
            queries.append(n)
        elif choice == "one" or n == 1:
            queries.append(1)
        else:
            queries.append(draw(st.integers(1, n - 1)))
    return contexts, queries


class AttentionConformance(ConformanceSuite):
    """The contract every attention backend honours (core/interfaces/attention.py), checked
    on the plugin named by ``plugin`` (or ``plugin_class``) with ``options``:

    - prefill, decode, mixed batches and chunked prefill after a cached prefix, with ragged
      lengths including 1 and primes, some sequences sharing their first cache blocks, match
      the float64 reference within the tolerance rule (module docstring);
    - GQA and MQA head ratios (``head_ratios``) and head dims 64, 128 and 80 (``head_dims``);
      sliding windows;
    - the layer features (``LAYER_FEATURES``, core/model/spec.py) the backend declares in
      ``layer_features``: windows differing per layer, logit softcaps, attention sinks, and
      the combinations GPT-OSS (windows and sinks) and Gemma 2 (windows and softcap) use,
      several layers on one plan, each against the float64 reference of its own features. A
      feature it does not declare must be declined: its ``unsupported_reasons`` for a model
      needing it names the feature;
    - cache slots no sequence has written hold NaN, and none of it reaches the output;
    - ``forward`` stores the step's new K and V at the batch's slot mapping.

    A backend whose ``cache_formats`` hold "latent" and not "kv" serves multi-head latent
    attention: the same batches run through ``forward_latent`` on ``LATENT_SHAPE`` over a
    NaN-filled latent cache, against the float64 decompressed reference, and it must store the
    step's latents (nothing for values); head ratios, head dims and windows, which MLA models
    do not have, are skipped.

    A backend that asks for layout extras (``kv_extras``, e.g. "key_bounds") gets them from
    the reference storage. An approximate backend (sparse attention) is checked where its
    options make it exact (for QUEST: a token budget above every context the suite draws);
    its approximate cases belong in its own tests.

    Each case runs in each of ``dtypes``. A shape, window or dtype the plugin declares
    unsupported (its ``unsupported_reasons``, or ``head_dims``) is skipped with its reasons.
    ``max_examples`` caps hypothesis' cases per property (None: the loaded profile's).
    """

    kind = "attention"
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16)
    head_dims: ClassVar[tuple[int, ...]] = (64, 128, 80)
    head_ratios: ClassVar[tuple[tuple[int, int], ...]] = ((4, 4), (4, 2), (8, 1))
    block_size: ClassVar[int] = 16
    max_examples: ClassVar[int | None] = None
    device: ClassVar[str] = "cpu"

    def check_case(self, contexts: list[int], queries: list[int], *, heads: tuple[int, int] = (4, 2),
                   head_dim: int = 64, window: int | None = None, dtype: torch.dtype = torch.float32,
                   seed: int = 0, shared_blocks: int = 0, count: bool = True,
                   layers: tuple[LayerAttention, ...] = ()) -> None:
        """Run one packed batch through the backend; assert every property of the contract.
        ``count``: count it as a case (not when it is another dtype of the same case).
        ``layers``: the model's layers (windows, softcaps, sinks; empty: one layer with the
        model-wide ``window``): one plan serves them all, each layer's forward (its index
        passed, random sink logits where it has sinks) runs over a cache of its own holding
        the same context, and is held to the reference of its own features."""
        if self.serves_latent():
            self.check_latent_case(contexts, queries, num_heads=heads[0], dtype=dtype, seed=seed,
                                   shared_blocks=shared_blocks, count=count)
            return
        if count:
            self.case()
        num_heads, num_kv_heads = heads
        spec = model_spec(num_heads, num_kv_heads, head_dim, window, layers)
        device = torch.device(self.device)
        plugin = self.under_test()
        extras = frozenset(getattr(plugin, "kv_extras", frozenset())) & KEPT_EXTRAS
        ctx = SelectionContext(device=device, dtype=dtype, model=spec, options=self.plugin_options(),
                               max_model_len=spec.max_position_embeddings,
                               kv_layout=KVLayout("kv", self.block_size, dtype, extras))
        shown = "; ".join(f"layer {i}: {describe(a)}" for i, a in enumerate(layers)) or f"window {window}"
        self.require(ctx, f"heads {num_heads}/{num_kv_heads}, head dim {head_dim}, {shown}, {dtype}")
        case = ref.make_case(contexts, queries, num_heads, num_kv_heads, head_dim, self.block_size, dtype, seed,
                             shared_blocks=shared_blocks, extras=extras)
        backend = plugin(self.plugin_options(), spec, device, dtype)
        plan = backend.plan(case.batch, cache=None)
        storages = [case.storage] + [copy.deepcopy(case.storage) for _ in layers[1:]]  # one cache per layer
        for layer, storage in enumerate(storages):
            what = (f"{self.label()}, contexts {contexts}, queries {queries}, heads {num_heads}/{num_kv_heads}, "
                    f"head dim {head_dim}, layer {layer} of {len(storages)} ({describe(spec.attention_of(layer))}), "
                    f"{dtype}")
            self.check_layer(backend, dataclasses.replace(case, storage=storage), plan, layer, spec, seed, what)

    def check_layer(self, backend: Any, case: ref.PackedCase, plan: Any, layer: int, spec: ModelSpec, seed: int,
                    what: str) -> None:
        """One layer's forward over ``case`` with the step's ``plan``: its output against the
        float64 reference of the layer's own window, softcap and sinks; its K/V stored."""
        device, dtype = torch.device(self.device), case.q.dtype
        features = spec.attention_of(layer)
        sinks = sink_logits(spec.num_heads, seed + layer) if features.sinks else None
        extra = {} if sinks is None else {"sinks": sinks.to(device)}  # a backend before API 1.8 takes none
        out = backend.forward(layer, case.q.to(device), case.k_new.to(device), case.v_new.to(device), case.storage,
                              plan, **extra).cpu()
        assert out.shape == case.q.shape and out.dtype == dtype, \
            f"{what}: forward returned {tuple(out.shape)} {out.dtype}, expected {tuple(case.q.shape)} {dtype}"
        assert torch.isfinite(out).all(), f"{what}: the output is not finite (NaN of unwritten cache slots reached it?)"
        window, softcap, scale = features.sliding_window, features.softcap, spec.attention_scale
        expected = ref.reference_packed(case, scale, window, softcap, sinks)
        allowed = 2 * (torch_attention(case, scale, window, softcap, sinks).double() - expected).abs().max().item() \
            + ERROR_FLOOR[dtype]
        error = (out.double() - expected).abs().max().item()
        assert error <= allowed, f"{what}: max abs error {error:.3g} against float64, allowed {allowed:.3g}"
        ref.assert_stored(case, what)

    def declines(self, layers: tuple[LayerAttention, ...] = (), window: int | None = None) -> bool:
        """Whether the backend leaves out of its ``layer_features`` a feature that a model of
        ``layers`` (or of the model-wide ``window``) needs. If so, assert that its
        ``unsupported_reasons`` for that model names each such feature: a backend must
        decline what it does not serve, never ignore it (a dropped softcap or sink gives
        plausible, wrong text)."""
        plugin = self.under_test()
        spec = model_spec(4, 2, 64, window, layers)
        missing = sorted(set(spec.attention_features()) - set(getattr(plugin, "layer_features", frozenset())))
        if not missing:
            return False
        self.case()
        dtype = self.dtypes[0]
        ctx = SelectionContext(device=torch.device(self.device), dtype=dtype, model=spec,
                               options=self.plugin_options(), max_model_len=spec.max_position_embeddings,
                               kv_layout=KVLayout("kv", self.block_size, dtype))
        reasons = plugin.unsupported_reasons(ctx)
        for feature in missing:
            assert any(feature in r for r in reasons), \
                (f"{self.label()} does not declare layer feature {feature!r} (its layer_features: "
                 f"{sorted(getattr(plugin, 'layer_features', ()))}), so it must decline a model whose layers need it "
                 f"with a reason naming {feature!r}; its reasons: {reasons}")
        return True

    @classmethod
    def serves_latent(cls) -> bool:
        """Whether the backend reads only the latent cache format (an MLA backend)."""
        formats = cls.under_test().cache_formats
        return "latent" in formats and "kv" not in formats

    def skip_if_latent(self, what: str) -> None:
        if self.serves_latent():
            pytest.skip(f"{self.label()} serves multi-head latent attention, whose models have no {what}")

    def check_latent_case(self, contexts: list[int], queries: list[int], *, num_heads: int = 4,
                          dtype: torch.dtype = torch.float32, seed: int = 0, shared_blocks: int = 0,
                          count: bool = True) -> None:
        """One packed batch through ``forward_latent``; the latent contract's properties."""
        if count:
            self.case()
        mla = LATENT_SHAPE
        spec = latent_model_spec(num_heads, mla)
        device = torch.device(self.device)
        plugin = self.under_test()
        ctx = SelectionContext(device=device, dtype=dtype, model=spec, options=self.plugin_options(),
                               max_model_len=spec.max_position_embeddings,
                               kv_layout=KVLayout("latent", self.block_size, dtype))
        self.require(ctx, f"latent attention, {num_heads} heads, {dtype}")
        case = ref.make_latent_case(contexts, queries, num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim,
                                    mla.qk_nope_head_dim, mla.v_head_dim, self.block_size, dtype, seed,
                                    shared_blocks=shared_blocks)
        backend = plugin(self.plugin_options(), spec, device, dtype)
        what = f"{self.label()}, latent, contexts {contexts}, queries {queries}, heads {num_heads}, {dtype}"
        up = type(case.up)(case.up.w_uk.to(device), case.up.w_uv.to(device))
        out = backend.forward_latent(0, case.q_nope.to(device), case.q_pe.to(device), case.latent_new.to(device),
                                     up, case.storage, backend.plan(case.batch, cache=None)).cpu()
        expected_shape = (*case.q_nope.shape[:2], mla.v_head_dim)
        assert out.shape == expected_shape and out.dtype == dtype, \
            f"{what}: forward_latent returned {tuple(out.shape)} {out.dtype}, expected {expected_shape} {dtype}"
        assert torch.isfinite(out).all(), f"{what}: the output is not finite (NaN of unwritten cache slots reached it?)"
        expected = ref.reference_latent_attention(case)
        allowed = 2 * (torch_latent_attention(case).double() - expected).abs().max().item() + ERROR_FLOOR[dtype]
        error = (out.double() - expected).abs().max().item()
        assert error <= allowed, f"{what}: max abs error {error:.3g} against float64, allowed {allowed:.3g}"
        stored, values = case.storage.gather(case.batch.slot_mapping)
        assert values is None and torch.equal(stored[:, 0].cpu(), case.latent_new), \
            f"{what}: forward_latent did not store the step's latents at the slot mapping"

    def _settings(self) -> Any:
        return property_settings() if self.max_examples is None else property_settings(max_examples=self.max_examples)

    @pytest.mark.parametrize("kind", ["prefill", "decode", "mixed", "chunked"])
    def test_batches_match_the_reference(self, kind: str) -> None:
        """Prefill, decode, mixed and chunked-prefill batches, some sharing leading blocks."""

        @given(lengths(kind), st.integers(0, 2**16), st.integers(0, 1))
        @self._settings()
        def run(lens: tuple[list[int], list[int]], seed: int, shared: int) -> None:
            for i, dtype in enumerate(self.dtypes):  # one case, checked in every dtype
                self.check_case(*lens, dtype=dtype, seed=seed, shared_blocks=shared, count=i == 0)

        run()

    @pytest.mark.parametrize("heads", [pytest.param(h, id=f"{h[0]}q{h[1]}kv") for h in
                                       ((4, 4), (4, 2), (8, 1))])
    def test_head_ratios(self, heads: tuple[int, int]) -> None:
        """GQA and MQA: each KV head serves num_heads // num_kv_heads query heads."""
        self.skip_if_latent("KV head groups")
        if heads not in self.head_ratios:
            pytest.skip(f"{self.label()}: head ratio {heads} not among the suite's head_ratios")

        @given(lengths("mixed"), st.integers(0, 2**16))
        @self._settings()
        def run(lens: tuple[list[int], list[int]], seed: int) -> None:
            self.check_case(*lens, heads=heads, dtype=self.dtypes[0], seed=seed)

        run()

    @pytest.mark.parametrize("head_dim", [64, 128, 80])
    def test_head_dims(self, head_dim: int) -> None:
        """The head dims the plugin declares (``AttentionBackend.head_dims``); others skip."""
        self.skip_if_latent("head dims to vary independently of the latent")
        if head_dim not in self.head_dims:
            pytest.skip(f"{self.label()}: head dim {head_dim} not among the suite's head_dims")

        @given(lengths("mixed"), st.integers(0, 2**16))
        @self._settings()
        def run(lens: tuple[list[int], list[int]], seed: int) -> None:
            self.check_case(*lens, head_dim=head_dim, dtype=self.dtypes[0], seed=seed)

        run()

    def test_sliding_window(self) -> None:
        """Query i sees only the last ``window`` keys up to its own position."""
        if self.declines(window=8):
            return
        self.skip_if_latent("sliding windows")

        @given(lengths("mixed"), st.integers(1, 12), st.integers(0, 2**16))
        @self._settings()
        def run(lens: tuple[list[int], list[int]], window: int, seed: int) -> None:
            self.check_case(*lens, window=window, dtype=self.dtypes[0], seed=seed)

        run()

    def run_layers(self, draw_layers: Any, every_dtype: bool = True) -> None:
        """The property for models whose layers ``draw_layers`` (a strategy) draws: mixed
        batches through every layer on one plan, in each of ``dtypes`` (``every_dtype``) or
        the first."""
        dtypes = self.dtypes if every_dtype else self.dtypes[:1]

        @given(lengths("mixed"), draw_layers, st.integers(0, 2**16))
        @self._settings()
        def run(lens: tuple[list[int], list[int]], layers: tuple[LayerAttention, ...], seed: int) -> None:
            for i, dtype in enumerate(dtypes):
                self.check_case(*lens, layers=layers, dtype=dtype, seed=seed, count=i == 0)

        run()

    def test_per_layer_windows(self) -> None:
        """Layer feature "per_layer_window": two layers with different windows and one
        without (sliding and global layers interleaved, as in Gemma 2/3), one plan for all,
        each forward masking by its own layer's window."""
        if self.declines((LayerAttention(sliding_window=4), LayerAttention(), LayerAttention(sliding_window=9))):
            return
        self.skip_if_latent("sliding windows")
        windows = st.integers(1, 12)
        self.run_layers(st.tuples(windows, windows).map(lambda w: (
            LayerAttention(sliding_window=w[0]), LayerAttention(), LayerAttention(sliding_window=w[1]))),
            every_dtype=False)

    def test_softcap(self) -> None:
        """Layer feature "softcap" (Gemma 2): scaled scores s become cap * tanh(s / cap)
        before masking, on the capped layer only (a plain layer beside it); caps that bind."""
        if self.declines((LayerAttention(softcap=2.0),)):
            return
        self.skip_if_latent("logit softcaps")
        self.run_layers(st.sampled_from(SOFTCAPS).map(lambda cap: (LayerAttention(softcap=cap), LayerAttention())))

    def test_sinks(self) -> None:
        """Layer feature "sinks" (GPT-OSS): each query head's sink logit (``forward(...,
        sinks=t)``, float32 [num_heads]) joins every softmax denominator and attends no
        value, on the layer that has sinks only (a plain layer beside it)."""
        if self.declines((LayerAttention(sinks=True),)):
            return
        self.skip_if_latent("attention sinks")
        self.run_layers(st.just((LayerAttention(sinks=True), LayerAttention())))

    def test_windows_with_sinks(self) -> None:
        """GPT-OSS's layers: sliding-window and full layers alternating, sinks on both."""
        if self.declines((LayerAttention(sliding_window=4, sinks=True), LayerAttention(sinks=True))):
            return
        self.skip_if_latent("sliding windows or sinks")
        self.run_layers(st.integers(1, 12).map(lambda w: (LayerAttention(sliding_window=w, sinks=True),
                                                          LayerAttention(sinks=True))), every_dtype=False)

    def test_windows_with_softcap(self) -> None:
        """Gemma 2's layers: sliding-window and full layers alternating, one softcap on both."""
        if self.declines((LayerAttention(sliding_window=4, softcap=2.0), LayerAttention(softcap=2.0))):
            return
        self.skip_if_latent("sliding windows or softcaps")
        self.run_layers(st.tuples(st.integers(1, 12), st.sampled_from(SOFTCAPS)).map(lambda p: (
            LayerAttention(sliding_window=p[0], softcap=p[1]), LayerAttention(softcap=p[1]))), every_dtype=False)
