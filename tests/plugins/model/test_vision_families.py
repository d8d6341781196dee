"""Gemma 3 (the gemma model plugin's multimodal checkpoints) and Idefics3 / SmolVLM (the
idefics3 plugin): images in prompts equal transformers' generate with the checkpoint's own
processor, on tiny random checkpoints built with transformers' classes, in float32 on the
CPU: several images of different sizes, one image and a text-only prompt in one batch,
through prefill chunks smaller than the prompts (Gemma 3's images, attended both ways, are
never split), with prefix caching keyed by image content."""

from __future__ import annotations

import pytest

from tessellm import LLM
from tessellm.core.errors import InvalidRequestError, RequestRejectedError
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.testing.models import build_tiny_gemma3_vision, build_tiny_idefics3
from tessellm.testing.vision import assert_same_greedy, picture

pytest.importorskip("PIL")

MAX_TOKENS = 5
BUILDERS = {"gemma3": build_tiny_gemma3_vision,
            "idefics3": lambda target: build_tiny_idefics3(target),
            "smolvlm": lambda target: build_tiny_idefics3(target, model_type="smolvlm")}


@pytest.fixture(scope="module", params=["gemma3", "idefics3", pytest.param("smolvlm", marks=pytest.mark.extended)])
def family(request):
    if request.param == "smolvlm":
        pytest.importorskip("num2words")  # transformers' SmolVLM processor imports it
    return request.param


@pytest.fixture(scope="module")
def folder(family, tmp_path_factory):
    return BUILDERS[family](tmp_path_factory.mktemp(family))


def make_llm(folder, step_tokens: int = 16, **extra) -> LLM:
    """float32 on the CPU, paged cache with prefix caching, steps of ``step_tokens`` tokens:
    every prompt with an image below is computed in several chunks."""
    config = {"model": str(folder), "device": "cpu", "dtype": "float32", "decoding": {"name": "greedy"},
              "cache": {"name": "paged", "options": {"block_size": 4, "num_blocks": 256}},
              "scheduler": {"name": "continuous", "options": {"max_num_batched_tokens": step_tokens}}}
    config.update(extra)
    return LLM(config)


@pytest.fixture(scope="module")
def llm(folder):
    return make_llm(folder)


def test_greedy_equals_transformers_for_several_one_and_no_images(llm):
    marker = llm.pipeline.image_processor.image_marker
    cases = [  # two images of different sizes and aspects, one image, text only, in one batch
        (f"t7 t8 {marker} t9 t10 {marker} t11", [picture(64, 80, 0), picture(100, 60, 1)]),
        (f"t12 {marker} t13 t14", [picture(40, 30, 2)]),
        ("t15 t16 t17 t18 t19", None),
    ]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = llm.generate([text for text, _ in cases], params, images=[imgs for _, imgs in cases])
    for (text, imgs), out in zip(cases, outs):
        assert out.prompt_token_ids == llm.pipeline.image_processor.process(text, imgs or [],
                                                                            add_special_tokens=True).token_ids
        assert_same_greedy(llm, text, imgs or [], out.outputs[0].token_ids, out.outputs[0].logprobs[0].top)
    assert llm.engine.stats.images_encoded == 3


@pytest.mark.extended  # the default set keeps one case per family
def test_a_repeated_image_shares_blocks_and_is_encoded_once_a_different_one_does_not(llm):
    marker = llm.pipeline.image_processor.image_marker
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompt = f"t20 t21 {marker} t22 t23 t24 t25 t26 t27 t28 t29"
    first, second = picture(48, 48, 5), picture(48, 48, 6)  # the same size: the same prompt ids
    stats = llm.engine.stats
    encoded = stats.images_encoded
    [a] = llm.generate(prompt, params, images=[[first]])
    [b] = llm.generate(prompt, params, images=[[first.copy()]])
    assert b.num_cached_tokens > len(b.prompt_token_ids) // 2  # its blocks, image included, are shared
    assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert_same_greedy(llm, prompt, [first], a.outputs[0].token_ids)
    [c] = llm.generate(prompt, params, images=[[second]])
    assert c.prompt_token_ids == a.prompt_token_ids  # equal ids, a different image
    assert c.num_cached_tokens <= 4  # only the block before the image is shared
    assert_same_greedy(llm, prompt, [second], c.outputs[0].token_ids)
    assert stats.images_encoded == encoded + 2  # b needed no encoding: its image's blocks were cached


@pytest.mark.extended
def test_one_prompt_at_a_time_through_chunks_as_small_as_an_image(folder, family):
    """Each prompt alone (no batch neighbours); for Gemma 3, steps of exactly one image's
    placeholders, so each image must start a chunk."""
    llm = make_llm(folder, step_tokens=16 if family == "gemma3" else 8)
    marker = llm.pipeline.image_processor.image_marker
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for text, imgs in [(f"t30 {marker} {marker} t31", [picture(90, 50, 7), picture(33, 70, 8)]),
                       (f"{marker} t32", [picture(200, 200, 9)])]:
        [out] = llm.generate(text, params, images=[imgs])
        assert_same_greedy(llm, text, imgs, out.outputs[0].token_ids)


def test_an_image_that_must_run_whole_and_is_longer_than_a_step_is_refused_by_name(folder, family):
    """A Gemma 3 image (16 placeholders here) attends within itself both ways, so it must run in
    one step: a budget of 8 tokens cannot hold it, which the request is told. (Idefics3's
    images are causal: chunks may split them, as the other tests do.)"""
    if family != "gemma3":
        pytest.skip("images attend within themselves both ways in Gemma 3 only")
    llm = make_llm(folder, step_tokens=8)
    marker = llm.pipeline.image_processor.image_marker
    with pytest.raises(RequestRejectedError, match="must run in one step"):
        llm.generate(f"t5 {marker}", SamplingParams(max_tokens=1), images=[[picture(64, 64, 0)]])
    [ok] = llm.generate("t5 t6", SamplingParams(max_tokens=1))  # text still runs
    assert len(ok.outputs[0].token_ids) == 1


@pytest.mark.extended
def test_preempted_prompts_with_images_are_recomputed_to_the_same_tokens(folder, llm):
    """A cache with room for the longest sequence but not for all three: sequences are
    preempted and their prompts, images and all, computed again; every output still equals
    transformers'."""
    marker = llm.pipeline.image_processor.image_marker
    cases = [(f"t40 {marker} t41 t42", [picture(50, 90, 10)]), (f"{marker} t43", [picture(70, 40, 11)]),
             (f"t44 t45 {marker} t46", [picture(64, 64, 12)])]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    longest = max(len(llm.pipeline.image_processor.process(text, imgs).token_ids) for text, imgs in cases)
    blocks = -(-(longest + params.max_tokens) // 4)
    tight = make_llm(folder, cache={"name": "paged", "options": {"block_size": 4, "num_blocks": blocks,
                                                                 "free_out_of_window": False}})
    outs = tight.generate([text for text, _ in cases], params, images=[imgs for _, imgs in cases])
    assert tight.engine.stats.preemptions > 0, "the cache was meant to be too small"
    for (text, imgs), out in zip(cases, outs):
        assert_same_greedy(tight, text, imgs, out.outputs[0].token_ids)


@pytest.mark.extended
def test_gemma3_with_vision_off_serves_text_and_refuses_images_by_name(folder, family, llm):
    """Option ``vision: false``: the language model alone, text equal to the multimodal
    model's; an image is refused naming the text-only model."""
    if family != "gemma3":
        pytest.skip("the gemma plugin's option")
    text_only = make_llm(folder, architecture={"name": "gemma", "options": {"vision": False}})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    [out] = text_only.generate("t15 t16 t17 t18 t19", params)
    assert_same_greedy(llm, "t15 t16 t17 t18 t19", [], out.outputs[0].token_ids)
    with pytest.raises(InvalidRequestError, match="text-only"):
        text_only.generate("t5", params, images=[[picture(64, 64, 0)]])


@pytest.mark.extended
def test_idefics3_images_without_splitting_are_one_global_view_each(folder, family):
    """A processor with ``do_image_splitting`` off (as some SmolVLM checkpoints ship): each image
    is one ``<global-img>`` run, padded to the tile size, still equal to transformers'."""
    if family == "gemma3":
        pytest.skip("Idefics3 / SmolVLM tiling")
    llm = make_llm(folder, step_tokens=8)
    llm.pipeline.image_processor.processor.image_processor.do_image_splitting = False
    marker = llm.pipeline.image_processor.image_marker
    text, imgs = f"t3 {marker} t4 {marker}", [picture(40, 70, 1), picture(90, 20, 2)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    [out] = llm.generate(text, params, images=[imgs])
    assert len(out.prompt_token_ids) == 2 * (4 + 4)  # per image: fake, global, 4 placeholders, fake; t3, t4
    assert_same_greedy(llm, text, imgs, out.outputs[0].token_ids, out.outputs[0].logprobs[0].top)


@pytest.mark.extended  # a server round trip
def test_the_openai_client_sends_an_image_url_part_to_chat_completions(llm):
    """The chat template writes the family's image marker for the part; the reply is
    transformers' greedy text for the rendered prompt and the image."""
    openai = pytest.importorskip("openai")
    import base64
    import io

    from tessellm.serve.app import build_app
    from tessellm.serve.tools import render_chat
    from tessellm.testing.serving import serving
    from tessellm.testing.vision import transformers_greedy

    image = picture(70, 90, 9)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    marker = llm.pipeline.image_processor.image_marker
    text = render_chat([{"role": "user", "content": marker + " t40 t41"}], llm.tokenizer)
    expected = llm.tokenizer.decode(transformers_greedy(llm, text, [image], MAX_TOKENS), skip_special_tokens=True)
    with serving(build_app(llm, model_name="vl")) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="vl", max_tokens=MAX_TOKENS, temperature=0.0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "t40 t41"}]}])
    assert reply.choices[0].message.content == expected
