"""LoRA adapters over HTTP, driven by the openai client: a request's ``model`` names an
adapter (on completions, chat and responses, streamed or not) and its greedy tokens equal
transformers + PEFT's under that adapter; adapters and the base model answer concurrent
requests; /v1/models lists each adapter with its folder and parent; with runtime updates on,
POST /v1/load_lora_adapter and /v1/unload_lora_adapter change what is served (a bad folder, a
taken name, an unknown name refused in OpenAI's error body); off, those routes say how to
turn them on; ``tessellm serve``'s LoRA flags become the config's ``lora`` section."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

from tessellm import LLM  # noqa: E402
from tessellm.cli import build_parser  # noqa: E402
from tessellm.serve.app import build_app  # noqa: E402
from tessellm.serve.cli import serve_config  # noqa: E402
from tessellm.testing.lora import build_tiny_lora, peft_greedy, peft_model  # noqa: E402
from tessellm.testing.models import build_tiny  # noqa: E402
from tessellm.testing.serving import serving  # noqa: E402

MODEL = "tiny-base"
PROMPTS = [[1, 5, 9, 33, 7], [1, 44, 12, 90]]
MAX_TOKENS = 8
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a template that joins the messages' words: a chat prompt of "t5 t9" is token ids [5, 9]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """A tiny Llama (with a chat template) and three PEFT adapters for it: ``sql`` and
    ``poem`` are served from the start, ``late`` is loaded at run time."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("lora-serving")
    base = build_tiny("llama", root / "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(base)
    adapters = {"sql": build_tiny_lora(base, root / "sql", rank=8, target_modules=ALL_MODULES, seed=1),
                "poem": build_tiny_lora(base, root / "poem", rank=4, alpha=8, seed=2, use_rslora=True),
                "late": build_tiny_lora(base, root / "late", rank=8, seed=3,
                                        target_modules=("q_proj", "o_proj", "down_proj"))}
    return base, adapters


@pytest.fixture(scope="module")
def expected(folders) -> dict[str | None, list[list[int]]]:
    """transformers + PEFT's greedy tokens of each prompt under each adapter (None: the base)."""
    base, adapters = folders
    out: dict[str | None, list[list[int]]] = {}
    for name, folder in [(None, None), *adapters.items()]:
        model = peft_model(base, folder)
        out[name] = [peft_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    assert len({json.dumps(v) for v in out.values()}) == len(out), "every adapter must change the output"
    return out


@pytest.fixture(scope="module")
def server(folders):
    """A server of the base model with ``sql`` and ``poem``, two device slots and runtime
    updates on; yields (url, llm)."""
    base, adapters = folders
    llm = LLM({"model": str(base), "device": "cpu", "dtype": "float32", "max_model_len": 128,
               "cache": {"name": "paged", "options": {"block_size": 8, "num_blocks": 256}},
               "scheduler": {"name": "continuous", "options": {"max_num_seqs": 16}},
               "lora": {"adapters": {"sql": str(adapters["sql"]), "poem": str(adapters["poem"])}, "max_loras": 2,
                        "runtime_updates": True}})
    with serving(build_app(llm, model_name=MODEL)) as url:
        yield url, llm


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def token_ids(pieces: list[str]) -> list[int]:
    """The ids of the word tokenizer's pieces (``t17`` is id 17)."""
    return [int(p[1:]) for p in pieces]


def complete_ids(client, model: str, prompt: list[int]) -> list[int]:
    """The greedy tokens /v1/completions gives ``prompt`` under ``model`` (read from logprobs)."""
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return token_ids(out.choices[0].logprobs.tokens)


def words(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


# ---------------------------------------------------------------------------- requests under adapters


@pytest.mark.parametrize("model", [MODEL, "sql", "poem"])
def test_completions_under_each_adapter_equal_peft(client, expected, model):
    name = None if model == MODEL else model
    assert [complete_ids(client, model, p) for p in PROMPTS] == expected[name]


def test_chat_under_an_adapter_equals_peft(client, expected):
    """The chat template renders the words ``t1 t5 ...``: the prompt is the same token ids."""
    answer = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": words(PROMPTS[0])}],
                                            max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=0,
                                            extra_body={"ignore_eos": True})
    assert answer.model == "sql"
    assert token_ids([c.token for c in answer.choices[0].logprobs.content]) == expected["sql"][0]


def test_responses_under_an_adapter_answer_as_chat_does(client, expected):
    messages = [{"role": "user", "content": words(PROMPTS[1])}]
    chat = client.chat.completions.create(model="poem", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    response = client.responses.create(model="poem", input=messages, max_output_tokens=MAX_TOKENS, temperature=0)
    assert response.model == "poem" and response.output_text == chat.choices[0].message.content
    base = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert base.choices[0].message.content != chat.choices[0].message.content


def test_streaming_under_an_adapter(client, expected, server):
    tokenizer = server[1].tokenizer
    chunks = list(client.completions.create(model="poem", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert {c.model for c in chunks} == {"poem"}
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == tokenizer.decode(expected["poem"][1], skip_special_tokens=True)


def test_adapters_and_the_base_run_concurrently(server, expected, monkeypatch):
    """Twelve requests at once, over two adapters and the base model (two device slots):
    each answer is its own model's, and steps batch the base and both adapters together."""
    runner, batches = server[1].pipeline.runner, []
    forward = runner.forward

    def recording(batch, *args, **kwargs):
        batches.append(set(batch.lora_slots_cpu or [-1]))
        return forward(batch, *args, **kwargs)

    monkeypatch.setattr(runner, "forward", recording)
    jobs = [(model, p) for _ in range(2) for model in (MODEL, "sql", "poem") for p in range(len(PROMPTS))]

    async def run() -> list[list[int]]:
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0) as aclient:
            outs = await asyncio.gather(*(aclient.completions.create(
                model=model, prompt=PROMPTS[p], max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True}) for model, p in jobs))
        return [token_ids(o.choices[0].logprobs.tokens) for o in outs]

    got = asyncio.run(run())
    assert got == [expected[None if m == MODEL else m][p] for m, p in jobs]
    assert any(len(slots) == 3 for slots in batches), batches  # the base (-1) and two adapters in one step


def test_an_unknown_model_is_openai_not_found(client, server):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt=PROMPTS[0], max_tokens=2)
    assert caught.value.code == "model_not_found" and "'nope'" in caught.value.message
    assert "'sql'" in caught.value.message  # the message lists what is served
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "t5"}], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="t5", max_output_tokens=2)


# ---------------------------------------------------------------------------- the model list


def test_models_lists_the_base_and_each_adapter_with_its_parent(client, folders):
    base, adapters = folders
    listed = {m.id: m for m in client.models.list().data}
    assert list(listed)[0] == MODEL and {"sql", "poem"} <= set(listed)
    assert listed[MODEL].root == str(base) and listed[MODEL].parent is None
    for name in ("sql", "poem"):
        assert listed[name].parent == MODEL and listed[name].root == str(adapters[name])
        assert listed[name].max_model_len == 128 and listed[name].owned_by == "tessellm"
    one = client.models.retrieve("sql")
    assert one.id == "sql" and one.parent == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_metrics_count_the_adapters(server):
    metrics = httpx.get(server[0] + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
              if line.startswith("tessellm_lora_")}
    assert values["tessellm_lora_adapters"] >= 2 and values["tessellm_lora_adapters_resident"] <= 2
    assert "tessellm_lora_slot_loads_total" in values


# ---------------------------------------------------------------------------- runtime updates


def post(url: str, route: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json=body, timeout=60)


def test_load_use_unload_then_not_found(client, server, folders, expected):
    url, _ = server
    path = str(folders[1]["late"])
    r = post(url, "load_lora_adapter", lora_name="late", lora_path=path)
    assert r.status_code == 200 and "late" in r.text
    card = client.models.retrieve("late")
    assert card.parent == MODEL and card.root == path
    assert [complete_ids(client, "late", p) for p in PROMPTS] == expected["late"]
    r = post(url, "unload_lora_adapter", lora_name="late")
    assert r.status_code == 200 and "late" in r.text
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="late", prompt=PROMPTS[0], max_tokens=2)
    assert caught.value.code == "model_not_found"
    assert "late" not in {m.id for m in client.models.list().data}
    assert post(url, "load_lora_adapter", lora_name="late", lora_path=path).status_code == 200  # the name is free again
    assert complete_ids(client, "late", PROMPTS[1]) == expected["late"][1]
    assert post(url, "unload_lora_adapter", lora_name="late").status_code == 200


def test_unloading_lets_running_requests_finish_under_the_adapter(client, server, folders):
    """A stream under ``late`` that is running when ``late`` is unloaded ends with the
    adapter's tokens, all of them; then the adapter's slot is free."""
    url, llm = server
    base, adapters = folders
    want = peft_greedy(peft_model(base, adapters["late"]), PROMPTS[0], 40)
    assert post(url, "load_lora_adapter", lora_name="late", lora_path=str(adapters["late"])).status_code == 200
    stream = client.completions.create(model="late", prompt=PROMPTS[0], max_tokens=40, temperature=0, logprobs=0,
                                       stream=True, extra_body={"ignore_eos": True})
    pieces = list(next(stream).choices[0].logprobs.tokens)  # running now
    assert post(url, "unload_lora_adapter", lora_name="late").status_code == 200
    pieces += [t for chunk in stream if chunk.choices for t in chunk.choices[0].logprobs.tokens]
    assert token_ids(pieces) == want
    assert "late" not in llm.lora_adapters and "late" not in llm.engine.lora.resident()


def assert_error(r: httpx.Response, status: int, param: str | None, *words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
    assert err["param"] == param and all(w in err["message"] for w in words), err


def test_bad_loads_and_unloads_name_the_problem(server, folders, tmp_path):
    url, llm = server
    assert_error(post(url, "load_lora_adapter", lora_name="x", lora_path=str(tmp_path)), 400, "lora_path",
                 "adapter_config.json", str(tmp_path))
    assert_error(post(url, "load_lora_adapter", lora_name="x", lora_path=str(tmp_path / "missing")), 400,
                 "lora_path", "adapter_config.json")
    (tmp_path / "adapter_config.json").write_text("{not json")
    assert_error(post(url, "load_lora_adapter", lora_name="x", lora_path=str(tmp_path)), 400, "lora_path", "JSON")
    assert_error(post(url, "load_lora_adapter", lora_name="sql", lora_path=str(folders[1]["late"])), 400,
                 "lora_name", "'sql'", "already loaded")
    assert_error(post(url, "load_lora_adapter", lora_name=MODEL, lora_path=str(folders[1]["late"])), 400,
                 "lora_name", "base model")
    assert_error(post(url, "load_lora_adapter", lora_name="x"), 400, "lora_path", "Missing")
    assert_error(post(url, "unload_lora_adapter", lora_name="nope"), 404, "lora_name", "'nope'", "not loaded")
    assert "x" not in llm.lora_adapters


def test_without_runtime_updates_the_routes_say_how_to_enable_them(folders, tmp_path):
    base, adapters = folders
    llm = LLM({"model": str(base), "device": "cpu", "dtype": "float32", "max_model_len": 64,
               "lora": {"adapters": {"sql": str(adapters["sql"])}}})
    with serving(build_app(llm, model_name=MODEL)) as url:
        for route, body in (("load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])}),
                            ("unload_lora_adapter", {"lora_name": "sql"})):
            assert_error(post(url, route, **body), 404, None, "--allow-runtime-lora-updating",
                         "lora.runtime_updates")
        assert llm.lora_adapters == ["sql"]


# ---------------------------------------------------------------------------- the command line


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_lora_flags_set_the_lora_section(tmp_path):
    config = serve_config(parse("--lora", "a=/x/a", "b=/x/b", "--lora", '{"name": "c", "path": "/x/c"}',
                                "--max-loras", "3", "--max-lora-rank", "32", "--allow-runtime-lora-updating"))
    assert config.lora.adapters == {"a": "/x/a", "b": "/x/b", "c": "/x/c"}
    assert (config.lora.max_loras, config.lora.max_rank, config.lora.runtime_updates) == (3, 32, True)
    assert serve_config(parse()).lora.adapters == {} and not serve_config(parse()).lora.active
    file = tmp_path / "pipeline.json"
    file.write_text(json.dumps({"lora": {"adapters": {"a": "/file/a", "d": "/file/d"}, "max_loras": 2}}))
    merged = serve_config(parse("--config", str(file), "--lora", "a=/flag/a"))
    assert merged.lora.adapters == {"a": "/flag/a", "d": "/file/d"} and merged.lora.max_loras == 2


@pytest.mark.parametrize("argv, words", [
    (["--lora", "just-a-name"], ["NAME=PATH", "'just-a-name'"]),
    (["--lora", "=/x"], ["NAME=PATH"]),
    (["--lora", '{"name": "a"}'], ["name and path", "NAME=PATH"]),
])
def test_bad_lora_flags_name_the_expected_form(argv, words, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    err = capsys.readouterr().err
    assert "--lora" in err and all(w in err for w in words), err


def test_lora_flags_that_fail_the_config_name_the_field():
    from tessellm.core.errors import ConfigError

    with pytest.raises(ConfigError, match="more than once"):
        serve_config(parse("--lora", "a=/x", "a=/y"))
    with pytest.raises(ConfigError, match="max_loras"):
        serve_config(parse("--max-loras", "0"))
