"""``tessellm eval ppl``: the sliding windows count every token once with the promised context,
the figure equals a float64 transformers computation over the same windows, and bad settings
are one-line errors before (or without) a model load."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessellm.cli import main
from tessellm.core.errors import ConfigError
from tessellm.eval.perplexity import perplexity, window_spans
from tessellm.eval.texts import BUNDLED, load_text


@given(n=st.integers(2, 400), window=st.integers(2, 80), data=st.data())
def test_windows_count_every_token_once_with_enough_context(n, window, data):
    stride = data.draw(st.integers(1, window))
    spans = window_spans(n, window, stride)
    assert [t for _, end, first in spans for t in range(first, end)] == list(range(1, n))
    for begin, end, first in spans:
        assert end - begin <= window and begin < first < end
        assert first - begin >= min(first, window - stride, window - 1)  # the first counted token's context


def test_bundled_texts_load_and_unknown_names_are_refused(tmp_path):
    for name in BUNDLED:
        label, text = load_text(name)
        assert label == name and len(text) > 20_000
    assert load_text(None)[0] == "the-tempest"
    own = tmp_path / "own.txt"
    own.write_text("some words")
    assert load_text(str(own)) == (str(own), "some words")
    with pytest.raises(ConfigError, match="neither a file nor a bundled text; bundled: the-tempest, paradise-lost"):
        load_text("no-such-text")


@pytest.mark.parametrize("window,stride", [(64, 24), (48, 48), (200, 100)])
def test_perplexity_equals_float64_transformers_over_the_same_windows(tiny_llm, reference_logprobs, window, stride):
    text = load_text("paradise-lost")[1]
    result = perplexity(tiny_llm, text, window=window, stride=stride, max_tokens=150)
    ids = tiny_llm.tokenizer(text)["input_ids"][:150]
    nll, count = 0.0, 0
    for begin, end, first in window_spans(len(ids), window, stride):
        lp = reference_logprobs(ids[begin:end])
        for t in range(first, end):
            nll -= lp[t - begin - 1, ids[t]].item()
            count += 1
    assert result.tokens_scored == count == 149 and result.text_tokens == 150
    assert result.perplexity == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_longer_context_does_not_raise_perplexity_much(tiny_llm):
    # a sanity check of the windows, not of the model: the same text, more context per token
    text = load_text("the-tempest")[1]
    short = perplexity(tiny_llm, text, window=16, stride=8, max_tokens=120).perplexity
    full = perplexity(tiny_llm, text, window=120, stride=120, max_tokens=120).perplexity
    assert math.isfinite(short) and math.isfinite(full)


def test_bad_windows_are_config_errors(tiny_llm):
    limit = tiny_llm.engine.max_model_len
    for kwargs, message in [({"window": limit + 1}, f"--window must be in 2..{limit}"),
                            ({"window": 8, "stride": 9}, "--stride must be in 1..8"),
                            ({"window": 0}, f"--window must be in 2..{limit}"),
                            ({"window": 8, "stride": 0}, "--stride must be in 1..8"),
                            ({"max_tokens": 1}, "--max-tokens must be at least 2")]:
        with pytest.raises(ConfigError, match=message):
            perplexity(tiny_llm, "a few words of text", **kwargs)


def test_cli_prints_json_and_one_line_errors(tiny_config_file, capsys):
    args = ["eval", "ppl", "--config", str(tiny_config_file), "--text", "paradise-lost", "--max-tokens", "60",
            "--window", "32", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens_scored"] == 59 and result["text"] == "paradise-lost" and result["perplexity"] > 1
    assert main(["eval", "ppl", "--config", str(tiny_config_file), "--text", "nowhere.txt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tessellm: error: --text 'nowhere.txt' is neither a file nor a bundled text; "
                   "bundled: the-tempest, paradise-lost"]
