"""The pooling contract as properties, written against the interface alone (``Pooler``,
``PoolingParams``, ``PoolingContext``), on random hidden states of random batches: ``rows`` is
one of first/last/all; ``pool`` returns one finite 1-D float32 tensor per sequence, ``width``
long for an embedding (or ``dimensions``, unit length when asked) and one score per label;
a sequence's output depends on its own rows only (pooled alone or in any batch, in float64
or float32 hidden states); the same call gives the same output; ``check`` refuses what the
pooler's task cannot serve; ``encode_pair`` gives token ids (and type ids of the same
length, or None). The model's heads a pooler may read (an LM head's rows, a classification
head) are random stand-ins here; that a built-in equals sentence-transformers on real
checkpoints is for its own tests."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, strategies as st

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.pooling import CheckpointPooling, Pooler, PoolingContext, PoolingParams
from tessellm.testing.conformance.base import ConformanceSuite, property_settings


class PairTokenizer:
    """A stand-in tokenizer: each word is its length plus 10; a pair is ``[1] a [2] b [2]``
    with segment ids, as BERT's pair encoding lays it out."""

    def __call__(self, text: str, pair: str | None = None, add_special_tokens: bool = True,
                 truncation: bool = False, max_length: int | None = None) -> dict[str, list[int]]:
        ids = [10 + len(w) for w in text.split()]
        if pair is None:
            return {"input_ids": [1, *ids, 2] if add_special_tokens else ids}
        second = [10 + len(w) for w in pair.split()]
        return {"input_ids": [1, *ids, 2, *second, 2], "token_type_ids": [0] * (len(ids) + 2) + [1] * (len(second) + 1)}


@st.composite
def batches(draw: Any) -> dict[str, Any]:
    hidden = draw(st.sampled_from([8, 16, 33]))
    lengths = draw(st.lists(st.integers(1, 20), min_size=1, max_size=5))
    return dict(hidden=hidden, lengths=lengths, dtype=draw(st.sampled_from([torch.float32, torch.float64])),
                seed=draw(st.integers(0, 2**16)), labels=draw(st.sampled_from([1, 3])))


class PoolingConformance(ConformanceSuite):
    """The contract every pooler honours (core/interfaces/pooling.py), checked on the plugin
    named by ``plugin`` (or ``plugin_class``) with ``options``."""

    kind = "pooling"
    vocabulary: ClassVar[dict[str, int]] = {"yes": 11, "no": 12}
    """One-token texts the stand-in tokenizer knows (``PoolingContext.token_id``); others are None."""

    def build(self, case: dict[str, Any], normalize: bool = False) -> Pooler:
        """The pooler under test over a model of ``case``'s hidden size, with random heads."""
        g = torch.Generator().manual_seed(case["seed"])
        h, labels = case["hidden"], case["labels"]
        head = torch.randn(h, labels, generator=g, dtype=torch.float64)
        lm_head = torch.randn(64, h, generator=g, dtype=torch.float64)
        ctx = PoolingContext(
            model=SimpleNamespace(hidden_size=h, model_type="stub", vocab_size=64),
            checkpoint=CheckpointPooling(mode=None, normalize=normalize, num_labels=labels),
            device=torch.device("cpu"), dtype=case["dtype"],
            lm_head_rows=lambda ids: lm_head[ids].to(case["dtype"]),
            classify=lambda x: x.to(torch.float64) @ head, classify_rows="first",
            token_id=lambda text: self.vocabulary.get(text))
        return self.under_test()(self.plugin_options(), ctx)

    @staticmethod
    def hidden(pooler: Pooler, case: dict[str, Any]) -> list[torch.Tensor]:
        """Each sequence's rows as the engine hands them: [1, H] for first/last, [L, H] for all."""
        g = torch.Generator().manual_seed(case["seed"] + 1)
        rows = [torch.randn(n if pooler.rows == "all" else 1, case["hidden"], generator=g, dtype=case["dtype"])
                for n in case["lengths"]]
        return rows

    def outputs(self, pooler: Pooler, rows: list[torch.Tensor], params: PoolingParams | None = None) -> list:
        out = pooler.pool(rows, [params or PoolingParams()] * len(rows))
        assert isinstance(out, list) and len(out) == len(rows), \
            f"pool returned {type(out).__name__} of {len(out) if hasattr(out, '__len__') else '?'} for {len(rows)} sequences"
        for o in out:
            assert isinstance(o, torch.Tensor) and o.dim() == 1 and o.dtype == torch.float32, \
                f"an output is {getattr(o, 'shape', o)} {getattr(o, 'dtype', '')}; the contract is a 1-D float32 tensor"
            assert torch.isfinite(o).all(), "an output holds a NaN or an infinity"
        return out

    def test_rows_task_and_width_are_declared(self):
        self.case()
        pooler = self.build(dict(hidden=16, lengths=[3], dtype=torch.float32, seed=0, labels=1))
        assert pooler.rows in ("first", "last", "all"), f"rows is {pooler.rows!r}"
        assert pooler.task in ("embed", "score"), f"task is {pooler.task!r}"
        assert isinstance(pooler.width, int) and pooler.width >= 1

    @property_settings(max_examples=25)
    @given(case=batches())
    def test_one_float32_vector_per_sequence_of_the_declared_width(self, case):
        self.case()
        pooler = self.build(case)
        for o in self.outputs(pooler, self.hidden(pooler, case)):
            assert o.shape[0] == pooler.width, f"an output has {o.shape[0]} values; width says {pooler.width}"

    @property_settings(max_examples=20)
    @given(case=batches())
    def test_a_sequence_output_depends_on_its_own_rows_only(self, case):
        self.case()
        pooler = self.build(case)
        rows = self.hidden(pooler, case)
        together = self.outputs(pooler, rows)
        alone = [self.outputs(pooler, [r])[0] for r in rows]
        tol = 1e-6 if case["dtype"] == torch.float64 else 1e-5
        for i, (a, b) in enumerate(zip(together, alone)):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol,
                                       msg=f"sequence {i} pooled in a batch differs from it pooled alone")
        again = self.outputs(pooler, rows)
        assert all(torch.equal(a, b) for a, b in zip(together, again)), "the same call gave another output"

    @property_settings(max_examples=15)
    @given(case=batches(), dims=st.integers(1, 8))
    def test_embeddings_cut_to_dimensions_and_normalise_when_asked(self, case, dims):
        self.case()
        pooler = self.build(case)
        if pooler.task != "embed":
            pytest.skip(f"pooling plugin {pooler.name!r} scores; dimensions and normalize are for embeddings")
        rows = self.hidden(pooler, case)
        full = self.outputs(pooler, rows, PoolingParams(normalize=False))
        cut = self.outputs(pooler, rows, PoolingParams(dimensions=dims, normalize=True))
        for f, c in zip(full, cut):
            assert c.shape[0] == min(dims, pooler.width)
            assert math.isclose(float(c.norm()), 1.0, rel_tol=1e-4) or float(f[:dims].norm()) == 0.0
            torch.testing.assert_close(c, torch.nn.functional.normalize(f[:dims], dim=-1), atol=1e-5, rtol=1e-4)

    def test_check_refuses_what_the_task_cannot_serve(self):
        self.case()
        pooler = self.build(dict(hidden=16, lengths=[3], dtype=torch.float32, seed=0, labels=1))
        if pooler.task == "embed":
            pooler.check(PoolingParams(dimensions=pooler.width))
            with pytest.raises(InvalidRequestError, match="dimensions"):
                pooler.check(PoolingParams(dimensions=pooler.width + 1))
        else:
            pooler.check(PoolingParams(use_activation=False))
            with pytest.raises(InvalidRequestError, match="dimensions"):
                pooler.check(PoolingParams(dimensions=2))

    def test_encode_pair_gives_token_ids_and_matching_type_ids(self):
        self.case()
        pooler = self.build(dict(hidden=16, lengths=[3], dtype=torch.float32, seed=0, labels=1))
        ids, types = pooler.encode_pair(PairTokenizer(), "a short query", "and a longer document here")
        assert ids and all(isinstance(t, int) and t >= 0 for t in ids), ids
        assert types is None or (len(types) == len(ids) and all(isinstance(t, int) for t in types)), types
        ids, _ = pooler.encode_pair(PairTokenizer(), "a short query", "and a longer document here", max_length=64)
        assert ids and len(ids) <= 64
