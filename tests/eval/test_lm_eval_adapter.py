"""The ``tessellm`` model of lm-evaluation-harness: each request type against float64
transformers, context cut to max_length, bad model_args in one line, and an offline
``tessellm eval lm-eval`` run on tiny local task files."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from tessellm.cli import main  # noqa: E402
from tessellm.core.errors import ConfigError  # noqa: E402
from tessellm.eval.lm_eval_adapter import TessellmLM  # noqa: E402

TEXT = ("The river runs past the old mill, and the baker opens her shop at dawn while sparrows "
        "gather on the warm roof and the bell in the square rings at noon.")


def request(kind: str, *args) -> Instance:
    return Instance(kind, {}, args, 0)


@pytest.fixture(scope="module")
def lm(tiny_llm):
    return TessellmLM(llm=tiny_llm)


def reference_continuation(reference_logprobs, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    lp = reference_logprobs(context + continuation)[len(context) - 1:-1]
    target = torch.tensor(continuation)
    return lp.gather(1, target[:, None]).sum().item(), bool((lp.argmax(-1) == target).all())


def test_registered_under_its_name():
    assert get_model("tessellm") is TessellmLM
    assert get_model("hf").__name__ == "HFLM"  # lm_eval's own models stay reachable


@pytest.mark.parametrize("context,continuation", [("The river runs", " past the old mill"),
                                                  ("The bell rings at ", "noon."), ("", "Sparrows gather")])
def test_loglikelihood_equals_float64_transformers(lm, reference_logprobs, context, continuation):
    (logprob, greedy), = lm.loglikelihood([request("loglikelihood", context, continuation)], disable_tqdm=True)
    if context:
        ctx, cont = lm._encode_pair(context, continuation)
    else:
        ctx, cont = [lm.prefix_token_id], lm.tok_encode(continuation, add_special_tokens=False)
    expected, expected_greedy = reference_continuation(reference_logprobs, ctx, cont)
    assert logprob == pytest.approx(expected, rel=1e-5, abs=1e-4) and greedy == expected_greedy


@pytest.mark.parametrize("max_length", [None, 16, 7])
def test_loglikelihood_rolling_predicts_every_token_once(tiny_llm, reference_logprobs, max_length):
    lm = TessellmLM(llm=tiny_llm, max_length=max_length)
    (total,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", TEXT)], disable_tqdm=True)
    tokens = lm.tok_encode(TEXT, add_special_tokens=False)
    if max_length is None:  # one window: the prefix token, then every token
        lp = reference_logprobs([lm.prefix_token_id] + tokens[:-1])
        expected = lp.gather(1, torch.tensor(tokens)[:, None]).sum().item()
    else:  # lm_eval's rolling windows: max_length predictions each, the last with a full context
        expected, done = 0.0, 0
        while done < len(tokens):
            stop = min(done + max_length, len(tokens))
            context_start = max(0, stop - max_length)
            window = ([lm.prefix_token_id] + tokens)[context_start:stop]  # predicts tokens[context_start:stop]
            lp = reference_logprobs(window)
            for t in range(done, stop):
                expected += lp[t - context_start, tokens[t]].item()
            done = stop
    assert total == pytest.approx(expected, rel=1e-5)


def test_generate_until_stops_and_cuts_context_from_the_left(lm, tiny_llm):
    prompt = "The river runs past"
    texts = lm.generate_until([request("generate_until", prompt, {"until": ["zzz"], "max_gen_toks": 6}),
                               request("generate_until", prompt, {"until": "zzz", "max_gen_toks": 3,
                                                                  "do_sample": False})], disable_tqdm=True)
    greedy = tiny_llm.generate([prompt], {"max_tokens": 6, "temperature": 0.0})[0]
    assert texts[0] == greedy.text and len(greedy.token_ids) == 6
    assert greedy.text.startswith(texts[1]) and texts[1]
    stop = greedy.text[len(greedy.text) // 2:][:2]  # a stop string inside the greedy answer
    if stop.strip():
        (cut,) = lm.generate_until([request("generate_until", prompt, {"until": [stop], "max_gen_toks": 6})],
                                   disable_tqdm=True)
        assert stop not in cut and greedy.text.startswith(cut)
    short = TessellmLM(llm=tiny_llm, max_length=12)  # a context longer than max_length keeps its end
    (out,) = short.generate_until([request("generate_until", TEXT, {"until": [], "max_gen_toks": 4})],
                                  disable_tqdm=True)
    tail = short.tok_encode(TEXT)[-8:]
    assert out == tiny_llm.generate([tail], {"max_tokens": 4, "temperature": 0.0})[0].text


def test_bad_model_args_are_one_line_config_errors(tiny_llm):
    with pytest.raises(ConfigError, match="take config, set and max_length; unknown: pretrained"):
        TessellmLM(llm=tiny_llm, pretrained="gpt2")
    with pytest.raises(ConfigError, match="max_length must be a whole number of tokens, got 'long'"):
        TessellmLM(llm=tiny_llm, max_length="long")
    with pytest.raises(ConfigError, match="max_length must be in 2.."):
        TessellmLM(llm=tiny_llm, max_length=10 ** 6)
    TessellmLM(llm=tiny_llm, batch_size=8, device="cpu", max_batch_size=None)  # the harness's own: accepted
    with pytest.raises(ConfigError, match="leaves no room for context"):
        TessellmLM(llm=tiny_llm, max_length=4).generate_until(
            [request("generate_until", "hi", {"until": [], "max_gen_toks": 4})], disable_tqdm=True)


TASKS = {
    "mc": """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc""",
    "gen": """output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{choices[answer]}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
metric_list:
  - metric: exact_match""",
    "rolling": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{question}}"
metric_list:
  - metric: word_perplexity""",
}
DOCS = [{"question": "The river runs past the old", "choices": ["mill", "roof", "square"], "answer": 0},
        {"question": "The bell in the square rings at", "choices": ["dawn", "noon"], "answer": 1}]


def test_offline_harness_run_on_local_task_files(tmp_path, tiny_config_file, tiny_llm, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, body in TASKS.items():
        (tasks / f"{name}.yaml").write_text(f"task: tessellm_tiny_{name}\ndataset_path: json\n"
                                            f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
                                            f"test_split: test\n{body}\n")
    out = tmp_path / "out"
    code = main(["eval", "lm-eval", "--model", "tessellm", "--model_args", f"config={tiny_config_file}",
                 "--tasks", *[f"tessellm_tiny_{n}" for n in TASKS], "--include_path", str(tasks),
                 "--output_path", str(out)])
    assert code == 0
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    lm = TessellmLM(llm=tiny_llm)
    picks = []
    for doc in DOCS:  # the harness's accuracy is what the adapter's own scores choose
        scores = lm.loglikelihood([request("loglikelihood", doc["question"], " " + c) for c in doc["choices"]],
                                  disable_tqdm=True)
        picks.append(max(range(len(scores)), key=lambda i: scores[i][0]) == doc["answer"])
    assert results["tessellm_tiny_mc"]["acc,none"] == pytest.approx(sum(picks) / len(picks))
    assert 0 <= results["tessellm_tiny_gen"]["exact_match,none"] <= 1
    assert results["tessellm_tiny_rolling"]["word_perplexity,none"] > 1
    capsys.readouterr()
    assert main(["eval", "lm-eval", "--model", "tessellm", "--model_args", "pretrained=gpt2",
                 "--tasks", "tessellm_tiny_mc", "--include_path", str(tasks)]) == 2
    assert "tessellm: error: tessellm model_args take config, set and max_length; unknown: pretrained" in capsys.readouterr().err
