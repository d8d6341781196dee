"""lm-evaluation-harness as a client of ``tessellm serve``: its ``local-completions`` model
(loglikelihood, loglikelihood_rolling, generate_until) and ``local-chat-completions``
(generate_until) against the server in-process, on tiny local task files, offline.

Scores through the server equal lm_eval's own ``hf`` model on the same folder per sample
(multiple choice with and without a context, rolling windows), the choices it picks are the
same, and generations are the engine's own greedy text cut at the task's stop strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
for _client in ("aiohttp", "requests", "tenacity"):  # lm_eval's API models need its [api] extra
    pytest.importorskip(_client, reason="lm_eval's API models need lm_eval[api]")

from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.evaluator import simple_evaluate  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from tessellm import LLM  # noqa: E402
from tessellm.serve.app import build_app  # noqa: E402
from tessellm.testing.serving import serving  # noqa: E402

MAX_LENGTH = 16
"""The hf model's max_length: rolling windows of this many tokens, so each text spans several."""
API_MAX_LENGTH = MAX_LENGTH + 2
"""The same windows for the API models, which keep one slot for the token a scoring request
generates and one more for the rolling window's context."""
GEN_TOKENS = 6

QUESTIONS = [{"question": "The river runs past the old", "choices": ["mill", "roof", "square"], "answer": 0},
             {"question": "The bell in the square rings at", "choices": ["dawn", "noon"], "answer": 1},
             {"question": "Sparrows gather on the warm", "choices": ["roof", "bread", "river", "bell"], "answer": 0},
             {"question": "The baker opens her shop at", "choices": ["dawn", "night"], "answer": 0}]
TEXTS = [{"text": "The river runs past the old mill, and the baker opens her shop at dawn while sparrows "
                  "gather on the warm roof."},
         {"text": "At noon the bell in the square rings twice; the miller stops his wheel, and children "
                  "run home along the river for bread."}]

TASKS = {
    "mc": """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc""",
    # no context: each choice is scored after the prefix token alone
    "mc_bare": """output_type: multiple_choice
doc_to_text: ""
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc""",
    "rolling": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity""",
    "gen": """output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{choices[answer]}}"
generation_kwargs:
  until: UNTIL
  max_gen_toks: %d
  do_sample: false
metric_list:
  - metric: exact_match""" % GEN_TOKENS,
}
SCORING_TASKS = ["tl_mc", "tl_mc_bare", "tl_rolling", "tl_gen"]


def cut(text: str, stops: list[str]) -> str:
    """``text`` up to the first of ``stops``."""
    for stop in stops:
        text = text.split(stop)[0]
    return text


def a_stop_inside(text: str) -> str:
    """Two characters from the second half of ``text`` that hold something other than space."""
    half = len(text) // 2
    for i in range(half, len(text) - 1):
        if text[i:i + 2].strip():
            return text[i:i + 2]
    raise AssertionError(f"no stop string in {text!r}")


def write_tasks(folder: Path, questions: list[dict], until: list[str]) -> Path:
    """The task YAMLs (absolute data paths) in ``folder``/tasks; returns that folder."""
    data = {"questions": questions, "texts": TEXTS}
    for name, docs in data.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = folder / "tasks"
    tasks.mkdir()
    for name, body in TASKS.items():
        source = folder / ("texts.jsonl" if name == "rolling" else "questions.jsonl")
        (tasks / f"tl_{name}.yaml").write_text(
            f"task: tl_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {source}\n"
            f"test_split: test\n{body.replace('UNTIL', json.dumps(until))}\n")
    return tasks


def evaluate(model, tasks: list[str], manager: TaskManager, **kwargs) -> dict:
    return simple_evaluate(model=model, tasks=tasks, task_manager=manager, log_samples=True, bootstrap_iters=0,
                           cache_requests=False, **kwargs)


def by_doc(out: dict, task: str) -> list[dict]:
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


class Recorder:
    """Wraps a model's ``_create_payload`` and keeps every request body it builds."""

    def __init__(self, lm):
        self.payloads: list[dict] = []
        inner = lm._create_payload

        def create(*args, **kwargs):
            payload = inner(*args, **kwargs)
            self.payloads.append(json.loads(json.dumps(payload)))
            return payload

        lm._create_payload = create


@pytest.fixture(scope="module")
def runs(tiny_model, cpu_config, tmp_path_factory):
    """One harness run per model over the same tasks: lm_eval's hf model, local-completions
    and local-chat-completions against the server (generation only), plus the engine's own
    greedy answers and the server's batch peak."""
    folder = tiny_model("llama")
    llm = LLM(cpu_config(folder, max_model_len=256, decoding={"name": "greedy"}, scheduler={"name": "continuous"},
                         cache={"name": "paged", "options": {"block_size": 8, "num_blocks": 256}}))
    params = {"max_tokens": GEN_TOKENS, "temperature": 0.0}
    # one prompt per call, so any batch the engine reaches later came through the server
    outs = [llm.generate([llm.tokenizer(d["question"], add_special_tokens=False)["input_ids"]], params)[0]
            for d in QUESTIONS]
    chat = [llm.generate([d["question"]], params, chat=True)[0].text for d in QUESTIONS]
    # the first question again, its first choice the model's own next word: is_greedy holds for it
    docs = QUESTIONS + [{"question": QUESTIONS[0]["question"], "answer": 0,
                         "choices": [llm.tokenizer.decode(outs[0].token_ids[:1]).lstrip(), "mill"]}]
    plain = [o.text for o in outs] + [outs[0].text]
    chat.append(chat[0])
    until = [a_stop_inside(plain[0]), a_stop_inside(chat[0])]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        manager = TaskManager(include_path=str(write_tasks(tmp_path_factory.mktemp("lm-eval"), docs, until)),
                              include_defaults=False)
        reference = HFLM(pretrained=str(folder), dtype="float32", device="cpu", batch_size=4, max_length=MAX_LENGTH)
        hf_prefix = reference.prefix_token_id
        hf = evaluate(reference, SCORING_TASKS, manager)
        with serving(build_app(llm, model_name="tiny", api_key=None)) as url:
            completions = get_model("local-completions").create_from_arg_string(
                f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={folder},"
                f"tokenized_requests=True,num_concurrent=1,max_retries=1,batch_size=4,max_length={API_MAX_LENGTH}")
            sent = Recorder(completions)
            api = evaluate(completions, SCORING_TASKS, manager)
            peak = llm.engine.stats.peak_running
            # several batches in flight at once (the harness's asyncio client)
            concurrent = evaluate(get_model("local-completions").create_from_arg_string(
                f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={folder},"
                f"num_concurrent=3,max_retries=1,batch_size=2,max_length={API_MAX_LENGTH}"),
                ["tl_mc", "tl_rolling"], manager)
            chat_lm = get_model("local-chat-completions").create_from_arg_string(
                f"model=tiny,base_url={url}/v1/chat/completions,num_concurrent=1,max_retries=1")
            chat_sent = Recorder(chat_lm)
            chat_run = evaluate(chat_lm, ["tl_gen"], manager, apply_chat_template=True)
    return {"hf": hf, "api": api, "concurrent": concurrent, "chat": chat_run, "docs": docs,
            "prefix": (hf_prefix, completions.prefix_token_id), "plain": plain, "chat_text": chat, "until": until,
            "sent": sent.payloads, "chat_sent": chat_sent.payloads, "peak": peak}


@pytest.mark.parametrize("task", ["tl_mc", "tl_mc_bare"])
def test_choice_loglikelihoods_equal_the_hf_model(runs, task):
    hf, api = by_doc(runs["hf"], task), by_doc(runs["api"], task)
    assert len(hf) == len(api) == len(runs["docs"])
    for ours, theirs in zip(api, hf):
        assert [a for a, _ in ours["filtered_resps"]] == pytest.approx([a for a, _ in theirs["filtered_resps"]],
                                                                       abs=1e-3), ours["doc_id"]
        assert [g for _, g in ours["filtered_resps"]] == [g for _, g in theirs["filtered_resps"]]
        pick = max(range(len(ours["filtered_resps"])), key=lambda i: ours["filtered_resps"][i][0])
        assert pick == max(range(len(theirs["filtered_resps"])), key=lambda i: theirs["filtered_resps"][i][0])
        assert ours["acc"] == theirs["acc"]
    assert runs["api"]["results"][task]["acc,none"] == runs["hf"]["results"][task]["acc,none"]
    if task == "tl_mc":  # the last question's first choice is the greedy next word
        assert api[-1]["filtered_resps"][0][1] is True


def test_rolling_loglikelihoods_over_several_windows_equal_the_hf_model(runs):
    hf, api = by_doc(runs["hf"], "tl_rolling"), by_doc(runs["api"], "tl_rolling")
    assert len(hf) == len(api) == len(TEXTS)
    for ours, theirs in zip(api, hf):
        assert ours["filtered_resps"] == pytest.approx(theirs["filtered_resps"], abs=1e-3)
    # every full window is MAX_LENGTH + 1 tokens: its context, then the tokens it scores
    windows = [ids for p in runs["sent"] if p.get("echo") for ids in p["prompt"] if len(ids) == MAX_LENGTH + 1]
    assert len(windows) >= 2 * len(TEXTS), "the texts should span several windows each"
    assert runs["api"]["results"]["tl_rolling"]["word_perplexity,none"] == pytest.approx(
        runs["hf"]["results"]["tl_rolling"]["word_perplexity,none"], rel=1e-3)


def test_concurrent_batches_score_the_same(runs):
    for ours, theirs in zip(by_doc(runs["concurrent"], "tl_mc"), by_doc(runs["hf"], "tl_mc")):
        assert [a for a, _ in ours["filtered_resps"]] == pytest.approx([a for a, _ in theirs["filtered_resps"]],
                                                                       abs=1e-3)
    for ours, theirs in zip(by_doc(runs["concurrent"], "tl_rolling"), by_doc(runs["hf"], "tl_rolling")):
        assert ours["filtered_resps"] == pytest.approx(theirs["filtered_resps"], abs=1e-3)
    assert runs["concurrent"]["results"]["tl_mc"]["acc,none"] == runs["hf"]["results"]["tl_mc"]["acc,none"]


def test_scoring_requests_are_batches_of_token_lists(runs):
    scoring = [p for p in runs["sent"] if p.get("echo")]
    assert scoring and all(p["max_tokens"] == 1 and p["logprobs"] == 1 for p in scoring)
    assert all(isinstance(ids, list) and all(isinstance(t, int) for t in ids) for p in scoring for ids in p["prompt"])
    hf_prefix, api_prefix = runs["prefix"]
    assert hf_prefix == api_prefix  # an empty context is this one token in both models
    bare = [ids for p in scoring for ids in p["prompt"] if len(ids) == 2]  # tl_mc_bare's one-token choices
    assert bare and all(ids[0] == api_prefix for ids in bare)
    assert max(len(p["prompt"]) for p in scoring) == 4
    assert runs["peak"] >= 2  # a batch's prompts ran together in the engine


def test_completions_generate_the_engines_greedy_text_up_to_the_stop(runs):
    until = runs["until"]
    expected = [cut(text, until) for text in runs["plain"]]
    api = [s["filtered_resps"][0] for s in by_doc(runs["api"], "tl_gen")]
    assert api == expected and api[0] != runs["plain"][0]  # the first one stopped early
    assert api == [s["filtered_resps"][0] for s in by_doc(runs["hf"], "tl_gen")]
    gens = [p for p in runs["sent"] if not p.get("echo")]
    assert sorted(len(p["prompt"]) for p in gens) == [1, 4]  # five prompts in batches of four
    assert all(p["stop"] == until + ["<|im_end|>"] and p["max_tokens"] == GEN_TOKENS for p in gens)


def test_chat_completions_generate_the_engines_greedy_chat_text_up_to_the_stop(runs):
    chat = [s["filtered_resps"][0] for s in by_doc(runs["chat"], "tl_gen")]
    assert chat == [cut(text, runs["until"]) for text in runs["chat_text"]]
    assert chat[0] != runs["chat_text"][0]
    assert len(runs["chat_sent"]) == len(runs["docs"])
    assert runs["chat_sent"][0]["messages"][-1]["role"] == "user"
