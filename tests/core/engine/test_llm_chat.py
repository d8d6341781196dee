"""``LLM.chat``: conversations of OpenAI-style messages, text and image parts, through the
tokenizer's chat template: the same prompt as ``generate(chat=True)`` where they overlap, a
batch of conversations in order, and a clear refusal for what it does not serve."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from tessellm import LLM
from tessellm.core.errors import InvalidRequestError

GREEDY = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(cpu_config, tiny_model):
    return LLM(cpu_config(tiny_model("llama"), max_model_len=256, decoding={"name": "greedy"}))


def test_a_user_message_is_the_prompt_generate_renders_with_chat(llm):
    [chat] = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)
    [plain] = llm.generate("What is the capital of France?", GREEDY, chat=True)
    assert chat.prompt_token_ids == plain.prompt_token_ids and chat.token_ids == plain.token_ids
    assert chat.prompt.endswith(llm.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                                                  add_generation_prompt=True)[-12:])


def test_conversations_in_a_batch_answer_in_order_and_text_parts_join(llm):
    talks = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
             [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour"}]}],
             [{"role": "user", "content": "Name a colour"}]]
    outs = llm.chat(talks, GREEDY)
    alone = [llm.chat(t, GREEDY)[0] for t in talks]
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert outs[1].prompt_token_ids == outs[2].prompt_token_ids  # parts joined as one string
    opened = llm.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}], GREEDY,
                      add_generation_prompt=False)[0]
    assert "Hel" in opened.prompt and not opened.prompt.endswith(outs[0].prompt[-5:])


@pytest.mark.parametrize("messages, words", [
    ([], "non-empty list of messages"),
    ([{"content": "no role"}], "message 0 is not a dict with a 'role'"),
    ([{"role": "user", "content": [{"type": "audio_url", "audio_url": "x"}]}], "part type 'audio_url' is not served"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}],
     "fetches nothing"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}],
     "not valid base64"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                        + base64.b64encode(b"png?").decode()}}]}],
     "text-only model"),
])
def test_what_chat_does_not_serve_is_refused_by_name(llm, messages, words):
    with pytest.raises(InvalidRequestError, match=words):
        llm.chat(messages, GREEDY)
    assert llm.chat([{"role": "user", "content": "still here"}], GREEDY)[0].token_ids  # nothing left behind


def test_image_parts_are_the_images_generate_takes(tmp_path):
    pytest.importorskip("PIL")
    from PIL import Image

    from tessellm.testing.models import build_tiny_qwen2_vl

    vision = LLM({"model": str(build_tiny_qwen2_vl(tmp_path / "qwen2_vl")), "device": "cpu", "dtype": "float32",
                  "decoding": {"name": "greedy"}})
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8))
    png = io.BytesIO()
    picture.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    [chat] = vision.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                       {"type": "text", "text": "t7 t8"}]}], GREEDY)
    [direct] = vision.generate("t7 t8", GREEDY, chat=True, images=[[picture]])
    assert chat.prompt_token_ids == direct.prompt_token_ids and chat.token_ids == direct.token_ids
    [pil] = vision.chat([{"role": "user", "content": [{"type": "image", "image": picture},
                                                      {"type": "text", "text": "t7 t8"}]}], GREEDY)
    assert pil.token_ids == chat.token_ids
