"""The attention contract as properties, checked against the float64 reference of
tessellm.testing.attention on random packed batches over a scattered, NaN-filled cache.

The tolerance rule (flash-attention's): in a dtype below float64, the plugin's largest
absolute error against the float64 reference may be at most twice that of plain torch
attention computed in the same dtype, plus a small floor for dtypes whose torch error is
near zero (``ERROR_FLOOR``)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, strategies as st

from tessellm.core.interfaces.kv import KVLayout
from tessellm.core.model.spec import MLASpec, ModelSpec
from tessellm.core.plugin import SelectionContext
from tessellm.testing import attention as ref
from tessellm.testing.conformance.base import ConformanceSuite, property_settings

KEPT_EXTRAS = frozenset({"key_bounds"})
"""Layout extras the suite's reference storage keeps for a backend that asks for them."""

ERROR_FLOOR = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}
"""Absolute error always allowed in each dtype, beside twice torch's own error."""

PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def model_spec(num_heads: int, num_kv_heads: int, head_dim: int, window: int | None = None) -> ModelSpec:
    """A model of these attention shapes (the rest of it is irrelevant to attention)."""
    return ModelSpec(model_type="llama", vocab_size=256, hidden_size=num_heads * head_dim, intermediate_size=64,
                     num_layers=1, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=True, qkv_bias=False,
                     o_bias=False, mlp_bias=False, sliding_window=window, rope_type="default", hf_config=None)


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


def torch_attention(case: ref.PackedCase, scale: float, window: int | None) -> torch.Tensor:
    """Plain torch attention computed in the case's own dtype: the error a kernel is allowed
    to double."""
    outs, start = [], 0
    for k, v, n_q in zip(case.k_full, case.v_full, case.q_lens):
        q = case.q[start:start + n_q]
        group = q.shape[1] // k.shape[1]
        keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        q_pos = torch.arange(len(k) - n_q, len(k))[:, None]
        k_pos = torch.arange(len(k))[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= q_pos - k_pos < window
        weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
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
                   seed: int = 0, shared_blocks: int = 0, count: bool = True) -> None:
        """Run one packed batch through the backend; assert every property of the contract.
        ``count``: count it as a case (not when it is another dtype of the same case)."""
        if self.serves_latent():
            self.check_latent_case(contexts, queries, num_heads=heads[0], dtype=dtype, seed=seed,
                                   shared_blocks=shared_blocks, count=count)
            return
        if count:
            self.case()
        num_heads, num_kv_heads = heads
        spec = model_spec(num_heads, num_kv_heads, head_dim, window)
        device = torch.device(self.device)
        plugin = self.under_test()
        extras = frozenset(getattr(plugin, "kv_extras", frozenset())) & KEPT_EXTRAS
        ctx = SelectionContext(device=device, dtype=dtype, model=spec, options=self.plugin_options(),
                               max_model_len=spec.max_position_embeddings,
                               kv_layout=KVLayout("kv", self.block_size, dtype, extras))
        self.require(ctx, f"heads {num_heads}/{num_kv_heads}, head dim {head_dim}, window {window}, {dtype}")
        case = ref.make_case(contexts, queries, num_heads, num_kv_heads, head_dim, self.block_size, dtype, seed,
                             shared_blocks=shared_blocks, extras=extras)
        backend = plugin(self.plugin_options(), spec, device, dtype)
        what = (f"{self.label()}, contexts {contexts}, queries {queries}, heads {num_heads}/{num_kv_heads}, "
                f"head dim {head_dim}, window {window}, {dtype}")
        out = backend.forward(0, case.q.to(device), case.k_new.to(device), case.v_new.to(device), case.storage,
                              backend.plan(case.batch, cache=None)).cpu()
        assert out.shape == case.q.shape and out.dtype == dtype, \
            f"{what}: forward returned {tuple(out.shape)} {out.dtype}, expected {tuple(case.q.shape)} {dtype}"
        assert torch.isfinite(out).all(), f"{what}: the output is not finite (NaN of unwritten cache slots reached it?)"
        expected = ref.reference_packed(case, spec.attention_scale, window)
        allowed = 2 * (torch_attention(case, spec.attention_scale, window).double() - expected).abs().max().item() \
            + ERROR_FLOOR[dtype]
        error = (out.double() - expected).abs().max().item()
        assert error <= allowed, f"{what}: max abs error {error:.3g} against float64, allowed {allowed:.3g}"
        ref.assert_stored(case, what)

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
        self.skip_if_latent("sliding windows")

        @given(lengths("mixed"), st.integers(1, 12), st.integers(0, 2**16))
        @self._settings()
        def run(lens: tuple[list[int], list[int]], window: int, seed: int) -> None:
            self.check_case(*lens, window=window, dtype=self.dtypes[0], seed=seed)

        run()
