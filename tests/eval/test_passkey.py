"""``tessellm eval passkey``: prompts of the asked length hold their key at the asked depth,
accuracy counts answers containing the key, and bad settings are one-line errors."""

from __future__ import annotations

import json

import pytest

from tessellm.cli import main
from tessellm.core.errors import ConfigError
import re

from tessellm.eval.passkey import (FILLERS, KEY_DIGITS, NEEDLE, PHRASINGS, case_prompt, draw_cases, passkey,
                                   passkey_prompt)


@pytest.mark.parametrize("context", [128, 170, 240])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompt_has_the_length_and_the_key_at_the_depth(tiny_llm, context, depth):
    ids = passkey_prompt(tiny_llm, "31415", depth, context)
    assert context - 12 <= len(ids) <= context
    text = tiny_llm.tokenizer.decode(ids)
    assert text.count("31415") == 2 and text.endswith("The pass key is")
    filler = text[text.index("\n\n") + 2:text.rindex("\n\n")]
    where = filler.index(NEEDLE.format(key="31415")) / max(len(filler) - len(NEEDLE.format(key="31415")), 1)
    assert abs(where - depth) < 0.15


def test_accuracy_counts_answers_containing_their_key(tiny_llm, monkeypatch):
    result = passkey(tiny_llm, context=160, trials=8, seed=3)
    assert sorted(int(t.depth * 8) for t in result.trials) == list(range(8))  # one depth in each eighth
    assert [t.filler for t in result.trials] == list(FILLERS) * 2
    assert [t.phrasing for t in result.trials] == [0] * 4 + [1] * 4
    assert all(len(t.key) in KEY_DIGITS for t in result.trials)
    assert result.accuracy == sum(t.key in t.answer for t in result.trials) / 8
    assert sum(n for _, n in result.by_decile) == 8
    assert sum(f for f, _ in result.by_decile) == sum(t.correct for t in result.trials)
    assert passkey(tiny_llm, context=160, trials=8, seed=3).trials == result.trials  # seeded and greedy
    assert result.selection == {}  # sdpa reports no selection

    def echo_key(prompts, params, **kwargs):  # a model that always finds the key scores 100%
        class Out:
            def __init__(self, ids):
                self.text = " " + re.findall(r"\d{4,7}", tiny_llm.tokenizer.decode(ids))[0]
        return [Out(p) for p in prompts]

    monkeypatch.setattr(tiny_llm, "generate", echo_key)
    assert passkey(tiny_llm, context=160, trials=8).accuracy == 1.0


@pytest.mark.parametrize("index", range(8))
def test_every_case_hides_its_key_where_its_key_tokens_say(tiny_llm, index):
    case = draw_cases(8, 5)[index]
    ids, keys = case_prompt(tiny_llm, case, 300)
    assert 300 - 80 <= len(ids) <= 300
    assert tiny_llm.tokenizer.decode([ids[i] for i in keys]).replace(" ", "") == case.key * \
        PHRASINGS[case.phrasing][0].count("{key}")
    assert tiny_llm.tokenizer.decode(ids).endswith(PHRASINGS[case.phrasing][1])


def test_quest_reports_the_share_of_the_key_blocks_each_sparse_layer_selected(tiny_model, cpu_config):
    from tessellm import LLM

    llm = LLM(cpu_config(tiny_model("llama"), decoding={"name": "greedy"},
                         attention={"name": "quest", "options": {"token_budget": 32, "dense_layers": 1}},
                         cache={"name": "paged", "options": {"block_size": 8}}))
    result = passkey(llm, context=200, trials=4, seed=1)
    assert set(result.selection) == {1} and 0 <= result.selection[1] <= 1
    assert all(set(t.selection) == {1} for t in result.trials)
    assert result.selection[1] == pytest.approx(sum(t.selection[1] for t in result.trials) / 4, abs=1e-3)


def test_bad_settings_are_config_errors(tiny_llm):
    room = tiny_llm.engine.max_model_len - 8
    with pytest.raises(ConfigError, match=f"--context must be in 128..{room} \\(max_model_len 256 less 8 answer"):
        passkey(tiny_llm, context=room + 1, max_tokens=8)
    with pytest.raises(ConfigError, match="--trials must be at least 1"):
        passkey(tiny_llm, trials=0)


def test_cli_prints_json(tiny_config_file, capsys):
    assert main(["eval", "passkey", "--config", str(tiny_config_file), "--context", "130", "--trials", "2",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {"accuracy", "context", "prompt_tokens", "trials"} and len(result["trials"]) == 2
    assert main(["eval", "passkey", "--config", str(tiny_config_file), "--context", "10"]) == 2
    assert capsys.readouterr().err.startswith("tessellm: error: --context must be in 128..")
