"""The logits-processor conformance suite on every built-in processor, each with requests
that set its fields in several ways (one request per row of a batch: different arguments in
one call); and the suite itself, shown to catch processors that break the contract."""

from __future__ import annotations

import pytest
import torch
from pydantic import Field

from tessellm.cli import main
from tessellm.core.interfaces.logits import LogitsProcessor
from tessellm.core.plugin import PluginOptions
from tessellm.core.version import PLUGIN_API_VERSION
from tessellm.testing.conformance import LogitsConformance


class TestMinTokens(LogitsConformance):
    plugin = "min_tokens"
    requests = [{"min_tokens": 4}, {"min_tokens": 1, "stop_token_ids": [5, 9]},
                {"min_tokens": 12, "stop_token_ids": [7], "ignore_eos": True}]


class TestLogitBias(LogitsConformance):
    plugin = "logit_bias"
    requests = [{"logit_bias": {3: -100.0, 10: 4.5, 60: 100.0}}, {"logit_bias": {2: -2.5}},
                {"logit_bias": {0: 0.25, 5: -0.5, 7: 1.0, 11: -100.0}}]


class TestRepetitionPenalty(LogitsConformance):
    plugin = "repetition_penalty"
    requests = [{"repetition_penalty": 1.4}, {"repetition_penalty": 0.7}, {"repetition_penalty": 10.0}]


class TestPresenceFrequency(LogitsConformance):
    plugin = "presence_frequency"
    requests = [{"presence_penalty": 0.8}, {"frequency_penalty": -0.6},
                {"presence_penalty": -2.0, "frequency_penalty": 2.0}]


class TestBadWords(LogitsConformance):
    plugin = "bad_words"
    requests = [{"bad_words_ids": [[7], [3, 4], [5, 6, 7]]}, {"bad_words": ["ab", "c"]},
                {"bad_words": ["abc"], "bad_words_ids": [[2], [9, 9]]}]


class TestAllowedTokenIds(LogitsConformance):
    plugin = "allowed_token_ids"
    requests = [{"allowed_token_ids": [2, 3, 5, 8, 13, 21, 34, 55]}, {"allowed_token_ids": [7]},
                {"allowed_token_ids": list(range(0, 64, 2))}]


class TestNoRepeatNGram(LogitsConformance):
    plugin = "no_repeat_ngram"
    requests = [{"no_repeat_ngram_size": 2}, {"no_repeat_ngram_size": 1}, {"no_repeat_ngram_size": 3}]


# ---------------------------------------------------------------------- the suite's power


class CountArgs(PluginOptions):
    weight: float = Field(1.0, gt=0.0, le=10.0)
    """Subtracted from a token's logit once per time the output holds it."""


class CountPenalty(LogitsProcessor):
    """A frequency penalty whose counts live on the device (``accept_on_device`` adds the
    overlapped step's tokens there): stateful and overlap-safe, the contract's hardest case."""

    name = "count-penalty"
    api_version = PLUGIN_API_VERSION
    Args = CountArgs
    overlap_safe = True

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.counts: dict[object, torch.Tensor] = {}  # key(seq) -> [vocab] token counts of its output

    def key(self, seq):
        return seq.seq_id

    def add(self, seq, args):
        tokens = torch.tensor(seq.output_token_ids, dtype=torch.long)
        self.counts[self.key(seq)] = torch.bincount(tokens, minlength=self.ctx.vocab_size).float()

    def accept(self, updates):
        for seq, tokens in updates:
            self.counts[self.key(seq)].index_add_(0, torch.tensor(tokens), torch.ones(len(tokens)))

    def accept_on_device(self, seqs, tokens):
        for i, seq in enumerate(seqs):
            self.counts[self.key(seq)].index_add_(0, tokens[i:i + 1], torch.ones(1))

    def remove(self, seq):
        self.counts.pop(self.key(seq), None)

    def row_counts(self, rows):
        counts = torch.stack([self.counts[self.key(seq)] for seq in rows.seqs])  # a copy: drafts stay out of state
        for i, drafts in enumerate(rows.drafts):
            counts[i].index_add_(0, torch.tensor(drafts, dtype=torch.long), torch.ones(len(drafts)))
        return counts

    def apply(self, logits, rows):
        weights = torch.tensor([args.weight for args in rows.args])[:, None]
        logits[rows.index] = logits[rows.index] - weights * self.row_counts(rows)


class LeaksIntoOtherRows(CountPenalty):
    def apply(self, logits, rows):
        super().apply(logits, rows)
        logits[:, 0] -= 1.0


class BuildsANewTensor(CountPenalty):
    def apply(self, logits, rows):
        logits = logits - 1.0  # a new tensor: the one the engine handed over is left as it was


class DependsOnTheBatch(CountPenalty):
    def apply(self, logits, rows):
        logits[rows.index] = logits[rows.index] - self.row_counts(rows).mean(dim=0)


class IgnoresAccept(CountPenalty):
    def accept(self, updates):
        pass


class KeepsDrafts(CountPenalty):
    def row_counts(self, rows):
        for seq, drafts in zip(rows.seqs, rows.drafts):
            self.counts[self.key(seq)].index_add_(0, torch.tensor(drafts, dtype=torch.long), torch.ones(len(drafts)))
        return torch.stack([self.counts[self.key(seq)] for seq in rows.seqs])


class SharesStateAcrossSamples(CountPenalty):
    def key(self, seq):
        return seq.request_id


class ForgetsDeviceTokens(CountPenalty):
    def accept_on_device(self, seqs, tokens):
        pass


def suite_for(cls: type[LogitsProcessor]) -> LogitsConformance:
    """The suite on ``cls``, with two requests of different weights (not a Test class: the
    broken processors are checked property by property below)."""
    name = cls.name
    suite = type(f"Suite{cls.__name__}", (LogitsConformance,), {
        "plugin_class": cls, "requests": [{"logits_processors": [{"name": name, "args": {"weight": 0.5}}]},
                                          {"logits_processors": [{"name": name, "args": {"weight": 2.0}}]}]})
    return suite()


def failure(suite: LogitsConformance, prop: str, cases: list[dict]) -> str:
    """The first of ``cases`` on which property ``prop`` fails (its message), "" if none."""
    test = getattr(type(suite), prop)
    inner = getattr(getattr(test, "hypothesis", None), "inner_test", None)
    for case in cases:
        try:
            inner(suite, **case) if inner is not None else test(suite)
        except AssertionError as exc:
            return str(exc)
    return ""


class TestCountPenalty(LogitsConformance):
    """A stateful, overlap-safe processor passes the whole suite."""

    plugin_class = CountPenalty
    requests = [{"logits_processors": [{"name": "count-penalty", "args": {"weight": 0.5}}]},
                {"logits_processors": ["count-penalty"]}]


BATCH = [{"vocab": 64, "seed": s, "float64": False, "slots": [(0, 3, 6, 2), (1, 2, 5, 1)], "spare": 2}
         for s in range(4)]
STEPS = [{"vocab": 64, "seed": s, "request": 0, "prompt_len": 2, "output_len": 4, "steps": [2, 1, 3],
          "fork_at": 1} for s in range(4)]
DRAFTS = [{"vocab": 64, "seed": s, "request": 0, "prompt_len": 2, "output_len": 4, "num_drafts": 3,
           "num_accepted": 1} for s in range(4)]
OVERLAP = [{"vocab": 64, "seed": s, "request": 0, "prompt_len": 2, "output_len": 3,
            "overlapped": [True, True, False, True]} for s in range(4)]


BROKEN = [  # (processor, the property that must fail, cases tried, what its message says)
    (LeaksIntoOtherRows, "test_a_batch_equals_each_row_alone", BATCH, "which it was not handed"),
    (DependsOnTheBatch, "test_a_batch_equals_each_row_alone", BATCH, "is not what it is alone"),
    (BuildsANewTensor, "test_apply_transforms_the_logits_it_is_handed", [{}], "changed no logit"),
    (IgnoresAccept, "test_accepting_step_by_step_equals_adding_the_whole_history", STEPS, "accepted steps"),
    (SharesStateAcrossSamples, "test_accepting_step_by_step_equals_adding_the_whole_history", STEPS,
     "accepted steps"),
    (KeepsDrafts, "test_drafts_leave_no_trace", DRAFTS, "draft"),
    (ForgetsDeviceTokens, "test_overlapped_steps_equal_synchronous_ones", OVERLAP, "overlapped"),
]


@pytest.mark.parametrize("broken, prop, cases, says", [pytest.param(*b, id=b[0].__name__) for b in BROKEN])
def test_the_suite_catches_a_broken_processor(broken, prop, cases, says):
    assert not failure(suite_for(CountPenalty), prop, cases), "the correct processor fails these cases"
    message = failure(suite_for(broken), prop, cases)
    assert says in message, f"{broken.__name__} passed {prop} (or failed it for another reason: {message!r})"


def test_the_check_runs_the_suite_on_a_builtin(capsys):
    assert main(["plugins", "--check", "logits:logit_bias", "--examples", "3"]) == 0
    out = capsys.readouterr().out
    assert "test_drafts_leave_no_trace" in out and "logits plugin 'logit_bias' passes" in out
