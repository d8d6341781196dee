"""A third party's logits processor that writes rows it was not handed (a typical-p
processor that filters the whole logits tensor) cannot change another request's tokens: by
default it is handed its own rows only, and with ``TESSELLM_CHECK_CONTRACTS=1`` it is a
``ContractError`` naming it, failing its own requests while the others finish."""

from __future__ import annotations

import sys

import pytest
import torch

import tessellm
from tessellm import LLM
from tessellm.core.engine.processors import LogitsProcessors, shipped_with_tessellm
from tessellm.core.errors import ContractError
from tessellm.core.interfaces.logits import LogitsProcessor, ProcessorRows
from tessellm.core.plugin import PluginOptions
from tessellm.core.version import PLUGIN_API_VERSION


class TypicalArgs(PluginOptions):
    mass: float = 0.3
    """The typical set's probability mass."""


class TypicalP(LogitsProcessor):
    """Locally typical sampling's filter, written with the slip of the issue: it filters every
    row of ``logits``, not just ``rows.rows``."""

    name = "typical-p"
    api_version = PLUGIN_API_VERSION
    Args = TypicalArgs

    def apply(self, logits: torch.Tensor, rows: ProcessorRows) -> None:
        mass = rows.args[0].mass
        logp = logits.log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1, keepdim=True)
        surprise = (-logp - entropy).abs()
        order = surprise.argsort(-1)
        kept = logp.exp().gather(-1, order).cumsum(-1) < mass
        kept[..., 0] = True
        drop = torch.ones_like(kept).scatter(-1, order, ~kept)
        logits.masked_fill_(drop, float("-inf"))  # the slip: every row, not logits[rows.index]


@tessellm.hookimpl
def register_logits(register):
    register(TypicalP)


@pytest.fixture(scope="module")
def llm(tiny_model, cpu_config):
    from tessellm.core.engine.pipeline import Pipeline
    from tessellm.core.registry import PluginRegistry

    registry = PluginRegistry()
    registry.add_module(sys.modules[__name__], package="authors-package")
    config = cpu_config(tiny_model("llama"), dtype="float64", decoding={"name": "sample"})
    return LLM(pipeline=Pipeline.from_config(config, registry=registry))


def typical_rows(rows: list[int], mass: float = 0.2) -> ProcessorRows:
    n = len(rows)
    return ProcessorRows(rows, [None] * n, [TypicalArgs(mass=mass)] * n, [()] * n, [0] * n, index=torch.tensor(rows))


def test_the_slip_changes_no_other_row_and_is_caught_with_checks():
    """The engine's step without a model (the default set's case; the end-to-end runs below
    are extended): handed rows 1 and 3 of 4, the typical-p slip leaves rows 0 and 2 as they
    were; with the contract check it is a ContractError naming it."""
    proc = TypicalP(TypicalArgs(), None)
    processors = LogitsProcessors([proc])
    assert processors.isolated == {proc}
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = processors.apply(logits, [(proc, typical_rows([1, 3]))])
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    assert out[[1, 3]].isinf().any(dim=-1).all()  # its own rows still filtered
    alone = logits[[1, 3]].clone()
    proc.apply(alone, typical_rows([0, 1]))
    assert torch.equal(out[[1, 3]], alone)  # as the processor computes them on its own
    processors.check_rows = True
    with pytest.raises(ContractError, match="logits plugin .typical-p.*apply changed 3 of the 3 logits rows"):  # 2 + the guard
        processors.apply(logits, [(proc, typical_rows([1, 3]))])
    with pytest.raises(ContractError, match="apply changed 1 of the 1 logits rows"):  # the guard row
        processors.apply(logits[:1], [(proc, typical_rows([0]))])


PLAIN = {"max_tokens": 8, "ignore_eos": True, "temperature": 1.0, "seed": 3}
TYPICAL = {**PLAIN, "seed": 4, "logits_processors": [{"name": "typical-p", "args": {"mass": 0.2}}]}
PROMPTS = [[5, 9, 17, 23], [31, 5, 9]]


@pytest.mark.extended
def test_a_plain_request_batched_with_a_typical_p_one_gets_plain_tokens(llm, monkeypatch):
    alone = llm.generate(PROMPTS[:1], PLAIN)[0].token_ids
    batched = llm.generate(PROMPTS, [PLAIN, TYPICAL])
    assert batched[0].token_ids == alone
    typical_alone = llm.generate(PROMPTS[1:], TYPICAL)[0].token_ids
    assert batched[1].token_ids == typical_alone  # its own rows still filtered
    processors = llm.engine.processors
    assert processors.isolated == {processors._by_name["typical-p"]}
    # the test has teeth: handed the whole tensor, the slip does change the plain request's tokens
    monkeypatch.setattr(processors, "isolated", frozenset())
    assert llm.generate(PROMPTS, [PLAIN, TYPICAL])[0].token_ids != alone


@pytest.mark.extended
def test_with_contract_checks_the_processor_is_named_and_only_its_request_fails(llm, monkeypatch):
    alone = llm.generate(PROMPTS[:1], PLAIN)[0].token_ids
    monkeypatch.setattr(llm.engine.processors, "check_rows", True)
    engine = llm.engine
    engine.add_request("plain", PROMPTS[0], tessellm.SamplingParams(**PLAIN))
    engine.add_request("typical", PROMPTS[1], tessellm.SamplingParams(**TYPICAL))
    finished = {}
    while engine.has_unfinished():
        for state in engine.step():
            finished[state.request_id] = engine.pop_finished(state.request_id)
    assert finished["plain"].seqs[0].output_token_ids == alone
    error = engine.failures.pop("typical")
    assert isinstance(error, ContractError), error
    message = str(error)
    assert "logits plugin 'typical-p'" in message and "broke its contract: apply changed" in message
    assert "rows it was not handed" in message and "docs/plugins.md#contract-checks-at-run-time" in message
    assert not engine.processors.bound and engine.cache.num_free_blocks == engine.cache.num_blocks


@pytest.mark.extended
def test_with_contract_checks_a_processor_alone_is_still_caught(llm, monkeypatch):
    """The guard row: a processor that writes every row is caught even when its request is the
    only one in the step (the run fault isolation does to find it)."""
    monkeypatch.setattr(llm.engine.processors, "check_rows", True)
    with pytest.raises(ContractError, match="logits plugin 'typical-p'.*apply changed 1 of the 1 logits rows"):
        llm.generate(PROMPTS[1:], TYPICAL)


@pytest.mark.extended
def test_the_built_ins_are_trusted_and_a_well_behaved_processor_passes_the_check(llm, monkeypatch):
    processors = llm.engine.processors
    assert all(shipped_with_tessellm(p) for p in processors.processors if p.name != "typical-p")
    monkeypatch.setattr(processors, "check_rows", True)
    params = {**PLAIN, "presence_penalty": 1.0, "logit_bias": {7: 3.0}, "min_tokens": 4}
    checked = [o.token_ids for o in llm.generate(PROMPTS, [params, PLAIN])]
    monkeypatch.setattr(processors, "check_rows", False)
    assert checked == [o.token_ids for o in llm.generate(PROMPTS, [params, PLAIN])]


def test_own_rows_are_renumbered_and_copied_back():
    seen = {}

    class Recorder(LogitsProcessor):
        name = "recorder"
        api_version = PLUGIN_API_VERSION

        def apply(self, logits, rows):
            seen.update(shape=tuple(logits.shape), rows=list(rows.rows), index=rows.index.tolist())
            logits[rows.index] += 1.0
            logits[:, 0] = -5.0  # every row it holds: its own only

    proc = Recorder(PluginOptions(), None)
    processors = LogitsProcessors([proc])
    logits = torch.zeros(5, 4)
    rows = ProcessorRows([1, 3], [None, None], [None, None], [(), ()], [0, 0], index=torch.tensor([1, 3]))
    out = processors.apply(logits, [(proc, rows)])
    assert seen == {"shape": (2, 4), "rows": [0, 1], "index": [0, 1]}
    assert out[[0, 2, 4]].eq(0).all() and out[[1, 3], 1:].eq(1).all() and out[[1, 3], 0].eq(-5).all()
    assert logits.eq(0).all()  # the engine's copy, not the model's logits
