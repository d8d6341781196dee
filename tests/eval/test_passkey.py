"""``tessellm eval passkey``: prompts of the asked length hold their key at the asked depth,
accuracy counts answers containing the key, and bad settings are one-line errors."""

from __future__ import annotations

import json

import pytest

from tessellm.cli import main
from tessellm.core.errors import ConfigError
from tessellm.eval.passkey import NEEDLE, passkey, passkey_prompt


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
    result = passkey(tiny_llm, context=128, trials=4, seed=3)
    assert [t.depth for t in result.trials] == [0.0, 1 / 3, 2 / 3, 1.0]
    assert result.accuracy == sum(t.key in t.answer for t in result.trials) / 4
    assert len({t.key for t in result.trials}) == 4 and all(len(t.key) == 5 for t in result.trials)
    assert passkey(tiny_llm, context=128, trials=4, seed=3).trials == result.trials  # seeded and greedy

    def echo_key(prompts, params, **kwargs):  # a model that always finds the key scores 100%
        class Out:
            def __init__(self, ids):
                text = tiny_llm.tokenizer.decode(ids)
                self.text = " " + text.split("The pass key is ")[1].split(".")[0]
        return [Out(p) for p in prompts]

    monkeypatch.setattr(tiny_llm, "generate", echo_key)
    assert passkey(tiny_llm, context=128, trials=3).accuracy == 1.0


def test_bad_settings_are_config_errors(tiny_llm):
    room = tiny_llm.engine.max_model_len - 8
    with pytest.raises(ConfigError, match=f"--context must be in 128..{room}"):
        passkey(tiny_llm, context=room + 1)
    with pytest.raises(ConfigError, match="--trials must be at least 1"):
        passkey(tiny_llm, trials=0)


def test_cli_prints_json(tiny_config_file, capsys):
    assert main(["eval", "passkey", "--config", str(tiny_config_file), "--context", "130", "--trials", "2",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {"accuracy", "context", "prompt_tokens", "trials"} and len(result["trials"]) == 2
    assert main(["eval", "passkey", "--config", str(tiny_config_file), "--context", "10"]) == 2
    assert capsys.readouterr().err.startswith("tessellm: error: --context must be in 128..")
