"""The families whose layers differ (Gemma 2 and 3, GPT-OSS, Phi-3, OLMo 2, Granite, SmolLM3)
through the apps by config alone, on tiny random checkpoints made with transformers' own
classes (``tessellm.testing.models.TINY_SHAPES``: windows shorter than the prompts, softcaps
and sinks that bind): `tessellm generate --set model=FOLDER` gives transformers' greedy
tokens with the architecture chosen by model_type; both int8 quantizers run each family; each
family's chat template (its tokenizer config's) shapes `--chat` and the server's chat
prompts; and Gemma 2 runs `tessellm bench`, `tessellm ab` and `tessellm eval ppl` and answers
the openai client with the offline tokens."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from tessellm import LLM
from tessellm.cli import main
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.serve.app import build_app
from tessellm.testing.models import build_tiny
from tessellm.testing.serving import serving

FAMILIES = {"gemma2": "gemma", "gemma3_text": "gemma", "gpt_oss": "gpt-oss", "phi3": "phi3", "olmo2": "olmo2",
            "granite": "granite", "smollm3": "smollm3"}
"""model_type -> the built-in model plugin `auto` must choose for it."""

CHAT_TEMPLATES = {
    # the turn markers each family's own template writes, reduced to one user turn
    "gemma2": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
              "else m['role'] }} {{ m['content'] }} <end_of_turn> {% endfor %}{% if add_generation_prompt %}"
              "<start_of_turn>model {% endif %}",
    "gemma3_text": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }} {{ m['content'] }} "
                   "<end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn>model {% endif %}",
    "gpt_oss": "{% for m in messages %}<|start|>{{ m['role'] }}<|message|> {{ m['content'] }} <|end|> {% endfor %}"
               "{% if add_generation_prompt %}<|start|>assistant {% endif %}",
    "phi3": "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}",
    "olmo2": "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
             "{% if add_generation_prompt %}<|assistant|> {% endif %}",
    "granite": "{% for m in messages %}<|start_of_role|>{{ m['role'] }}<|end_of_role|> {{ m['content'] }} "
               "<|end_of_text|> {% endfor %}{% if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|> "
               "{% endif %}",
    "smollm3": "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}",
}

PROMPTS = [" ".join(f"t{(7 * i + 3 * j) % 509 + 3}" for j in range(n)) for i, n in enumerate([21, 9, 30])]
"""Prompts longer than the checkpoints' 8-token windows."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One tiny checkpoint per family, with its family's chat template."""
    root = tmp_path_factory.mktemp("layer-feature-families")
    made = {}
    for model_type, template in CHAT_TEMPLATES.items():
        folder = build_tiny(model_type, root / model_type, vocab_size=512)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = template
        config_path.write_text(json.dumps(config))
        made[model_type] = folder
    return made


def pipeline(folder, **extra) -> dict:
    return {"model": str(folder), "device": "cpu", "dtype": "float32", "max_model_len": 256,
            "cache": {"name": "paged", "options": {"block_size": 8}}, "scheduler": {"name": "continuous"}, **extra}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_generate_by_model_folder_gives_transformers_greedy_tokens(model_type, folders, capsys):
    """The embedded config with the folder as its model: `auto` picks the family's plugin
    and an attention backend that serves its layers; the tokens are transformers' own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = folders[model_type]
    assert main(["generate", "--set", f"model={folder}", "--set", "device=cpu", "--set", "dtype=float32",
                 "--max-tokens", "8", "--ignore-eos", "--json", *PROMPTS]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for prompt, record in zip(PROMPTS, records):
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            for _ in range(8):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert record["token_ids"] == ids[-8:], (model_type, prompt)
    llm = LLM(pipeline(folder))
    assert llm.pipeline.spec.architecture == FAMILIES[model_type]


@pytest.mark.parametrize("quant", ["int8-weight", "w8a8"])
def test_int8_quantizers_run_every_family(quant, folders):
    """Each family loads under both int8 quantizers and generates; its teacher-forced
    logits stay near the float model's (a tiny random model's int8 error, not a quality
    figure: docs/benchmarks.md has those for SmolLM2)."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for model_type, folder in folders.items():
        llm = LLM(pipeline(folder, quant={"name": quant}))
        outs = llm.generate(PROMPTS[:2], params)
        assert [len(o.token_ids) for o in outs] == [6, 6], model_type
        ids = llm.tokenizer(PROMPTS[0])["input_ids"]
        quantized = llm.engine.score(ids).double()
        exact = LLM(pipeline(folder)).engine.score(ids).double()
        assert torch.isfinite(quantized).all(), model_type
        error = (quantized - exact).abs().max().item() / exact.abs().max().item()
        assert error < 0.25, f"{model_type} under {quant}: logits {error:.3f} of their range away from float"


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_chat_uses_the_familys_template(model_type, folders):
    """`--chat` (LLM.encode) and the server render the family's own template: the prompt
    holds its turn markers' tokens around the message."""
    llm = LLM(pipeline(folders[model_type]))
    ids = llm.encode("t5 t6", chat=True)
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "t5 t6"}], tokenize=False,
                                             add_generation_prompt=True)
    assert ids == llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 2 and llm.tokenizer.convert_tokens_to_ids(["t5", "t6"]) == [5, 6]
    from openai import OpenAI

    with serving(build_app(llm, model_name=model_type, api_key=None, max_request_bytes=64 * 1024)) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model=model_type, messages=[{"role": "user", "content": "t5 t6"}],
                                             max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == len(ids)
    offline = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert out.choices[0].message.content == offline.outputs[0].text


# ---------------------------------------------------------------- Gemma 2 through every app


@pytest.fixture(scope="module")
def gemma_config(folders, tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma2-apps") / "pipeline.json"
    path.write_text(json.dumps(pipeline(folders["gemma2"], attention={"name": "sdpa"})))
    return path


def test_gemma2_bench_ab_and_perplexity(gemma_config, capsys, tmp_path):
    """`tessellm bench` on a mixed workload, `tessellm ab` of sdpa against cascade (greedy
    outputs identical), `tessellm eval ppl` equal to the engine's own scores."""
    small = ["--workload-set", "prompt_median=12", "--workload-set", "prompt_max=40", "--workload-set",
             "output_median=6", "--workload-set", "output_min=2", "--workload-set", "output_max=10"]
    assert main(["bench", "--config", str(gemma_config), "--num-requests", "4", *small, "--json",
                 "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pipeline"]["architecture"] == "gemma" and report["total_output_tokens"] > 0
    assert main(["ab", "--config", str(gemma_config), "--a", "attention.name=sdpa", "--b", "attention.name=cascade",
                 "--workload", "shared-prefix", "--workload-set", "prefix_len=24", "--workload-set", "question_len=4",
                 "--workload-set", "output_len=4", "--num-requests", "3", "--rounds", "2",
                 "--num-agreement-prompts", "3", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["exact_match_rate"] == 1.0
    rng = random.Random(0)
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"t{rng.randrange(3, 512)}" for _ in range(100)))
    assert main(["eval", "ppl", "--config", str(gemma_config), "--text", str(text), "--window", "128",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    llm = LLM(json.loads(gemma_config.read_text()))
    ids = llm.tokenizer(text.read_text())["input_ids"]
    logprobs = llm.engine.score(ids)[:-1].double().log_softmax(-1)
    nll = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    assert result["perplexity"] == pytest.approx(math.exp(nll), rel=1e-5)


def test_gemma2_serves_the_openai_client_the_offline_tokens(gemma_config):
    from openai import OpenAI

    llm = LLM(json.loads(gemma_config.read_text()))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    with serving(build_app(llm, model_name="tiny-gemma2", api_key=None, max_request_bytes=64 * 1024)) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for prompt, text in zip(PROMPTS, texts):
            out = client.completions.create(model="tiny-gemma2", prompt=prompt, max_tokens=8, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == text


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_out_of_window_release_keeps_the_tokens_of_every_storage(kv_dtype, folders):
    """Gemma 3 (five sliding layers to one global) through the paged cache with release on
    and off, float32 and int8 K/V (values and scales both live in the shared arena): the same
    tokens, with blocks released."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (30, 45, 7, 60)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outputs = {}
    for free in (True, False):
        options = {"block_size": 4, "num_blocks": 60, "kv_dtype": kv_dtype, "free_out_of_window": free}
        llm = LLM(pipeline(folders["gemma3_text"], cache={"name": "paged", "options": options}))
        outputs[free] = [o.token_ids for o in llm.generate(prompts, params)]
        assert (getattr(llm.pipeline.cache, "released_blocks", 0) > 0) == free
    assert outputs[True] == outputs[False]
