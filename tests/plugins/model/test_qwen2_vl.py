"""Qwen2-VL / Qwen2.5-VL (the qwen2-vl model plugin): images in prompts equal transformers'
generate on tiny random checkpoints built with transformers' own classes, through chunked
prefill, prefix caching and the encoder cache; bad image input is refused by name."""

from __future__ import annotations

import io

import pytest

from tessellm import LLM
from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.testing.models import build_tiny_qwen2_vl
from tessellm.testing.vision import assert_same_greedy, picture, transformers_greedy

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

MAX_TOKENS = 6


@pytest.fixture(scope="module", params=["qwen2_vl", pytest.param("qwen2_5_vl", marks=pytest.mark.extended)])
def folder(request, tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp(request.param), model_type=request.param)


def make_llm(folder, **extra) -> LLM:
    """float32 on the CPU, paged cache with prefix caching, chunks of 8 tokens: every image
    below is split across prefill chunks."""
    config = {"model": str(folder), "device": "cpu", "dtype": "float32", "decoding": {"name": "greedy"},
              "cache": {"name": "paged", "options": {"block_size": 4, "num_blocks": 128}},
              "scheduler": {"name": "continuous", "options": {"max_num_batched_tokens": 8}}}
    config.update(extra)
    return LLM(config)


@pytest.fixture(scope="module")
def llm(folder):
    return make_llm(folder)


def reference(llm: LLM, text: str, images: list) -> list[int]:
    """transformers' greedy tokens for ``text`` and ``images`` through the checkpoint's processor."""
    return transformers_greedy(llm, text, images, MAX_TOKENS)


def test_greedy_equals_transformers_for_several_one_and_no_images(llm):
    marker = llm.pipeline.image_processor.image_marker
    cases = [  # two images of different sizes, one image, text only, in one batch
        (f"t7 t8 {marker} t9 t10 {marker} t11", [picture(64, 80, 0), picture(100, 60, 1)]),
        (f"t12 {marker} t13 t14", [picture(120, 120, 2)]),
        ("t15 t16 t17 t18 t19", None),
    ]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = llm.generate([text for text, _ in cases], params, images=[imgs for _, imgs in cases])
    for (text, imgs), out in zip(cases, outs):
        assert_same_greedy(llm, text, imgs or [], out.outputs[0].token_ids, out.outputs[0].logprobs[0].top)
    assert llm.engine.stats.images_encoded == 3


@pytest.mark.extended  # under a minute on a loaded machine, and the default set's budget is tight
def test_a_repeated_image_shares_blocks_and_is_encoded_once_a_different_one_does_not(llm):
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = "t20 t21 t22 t23 t24 t25 t26 t27 t28 t29 t30"  # images first, then 11 words
    first, second = picture(90, 70, 5), picture(90, 70, 6)  # the same size: the same placeholder ids
    stats = llm.engine.stats
    encoded, hits = stats.images_encoded, stats.encoder_cache_hits
    [a] = llm.generate(prompt, params, images=[[first]])
    [b] = llm.generate(prompt, params, images=[[io_bytes(first)]])  # the same image, as PNG bytes
    assert b.num_cached_tokens > len(b.prompt_token_ids) // 2  # its blocks, image included, are shared
    assert b.outputs[0].token_ids == a.outputs[0].token_ids
    [_] = llm.generate("t31 " + llm.pipeline.image_processor.image_marker + prompt, params, images=[[first]])
    assert (stats.images_encoded, stats.encoder_cache_hits) == (encoded + 1, hits + 1)  # after other text: cached
    [c] = llm.generate(prompt, params, images=[[second]])
    assert c.prompt_token_ids == a.prompt_token_ids  # equal ids, a different image
    assert c.num_cached_tokens == 0  # the image starts the prompt: no block is shared
    assert stats.images_encoded == encoded + 2


def io_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_bad_images_are_refused_by_name(llm, tmp_path):
    params = SamplingParams(max_tokens=1)
    marker = llm.pipeline.image_processor.image_marker
    with pytest.raises(InvalidRequestError, match="could not be read"):
        llm.generate("t5", params, images=[[b"not an image"]])
    with pytest.raises(InvalidRequestError, match="no such file"):
        llm.generate("t5", params, images=[[str(tmp_path / "missing.png")]])
    with pytest.raises(InvalidRequestError, match="placeholder"):
        llm.generate(f"t5 {marker} {marker}", params, images=[[picture(60, 60, 0)]])
    with pytest.raises(InvalidRequestError, match="at most 8"):
        llm.generate("t5", params, images=[[picture(56, 56, i) for i in range(9)]])
    [ok] = llm.generate("t5", params, images=[[picture(60, 60, 0)]])  # the engine still serves
    assert len(ok.outputs[0].token_ids) == 1
    assert not llm.engine.has_unfinished()


def test_an_image_prompt_past_max_model_len_names_its_image_tokens(folder):
    llm = make_llm(folder, max_model_len=12)
    with pytest.raises(InvalidRequestError, match="of them for its 1 images"):
        llm.generate("t5 t6", SamplingParams(max_tokens=1), images=[[picture(112, 112, 0)]])


def data_url(image: Image.Image) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(io_bytes(image)).decode()


@pytest.mark.extended  # a server round trip: the default set keeps the cheaper cases
def test_the_openai_client_sends_image_url_parts_to_chat_completions(llm):
    openai = pytest.importorskip("openai")
    import httpx

    from tessellm.serve.app import build_app
    from tessellm.serve.tools import render_chat
    from tessellm.testing.serving import serving

    image = picture(70, 90, 9)
    marker = llm.pipeline.image_processor.image_marker
    text = render_chat([{"role": "user", "content": marker + "t40 t41"}], llm.tokenizer)
    expected = llm.tokenizer.decode(reference(llm, text, [image]), skip_special_tokens=True)
    with serving(build_app(llm, model_name="vl")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="vl", max_tokens=MAX_TOKENS, temperature=0.0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                         {"type": "text", "text": "t40 t41"}]}])
        assert reply.choices[0].message.content == expected
        assert reply.usage.prompt_tokens == len(llm.pipeline.image_processor.process(text, [image]).token_ids)
        for url_given, words in [("https://example.com/a.png", "fetching image URLs is off"),
                                 ("data:image/png;base64,!!!", "not valid base64"),
                                 ("data:image/png;base64,aGVsbG8=", "could not be read")]:
            r = httpx.post(url + "/v1/chat/completions", json={"model": "vl", "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url_given}}]}]})
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        r = httpx.post(url + "/v1/chat/completions", json={"model": "vl", "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}}] * 9}]})
        assert r.status_code == 400 and "at most 8" in r.json()["error"]["message"], r.text
        r = httpx.post(url + "/v1/chat/completions", json={"model": "vl", "max_tokens": 1, "temperature": 0,
                                                            "messages": [{"role": "user", "content": "t40"}]})
        assert r.status_code == 200, r.text  # still serving
