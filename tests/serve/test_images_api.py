"""Images over HTTP on a tiny random Qwen2-VL: ``image_url`` parts on /v1/chat/completions and
``input_image`` items on /v1/responses give the offline answer (streamed too, and /tokenize
counts the image's tokens); http(s) image URLs are
fetched from a local server only where the config allows, within its size and time limits;
``--limit-mm-per-prompt`` sets the images a prompt may hold; and every bad image is a 400
naming the problem, the server answering the next request."""

from __future__ import annotations

import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

pytest.importorskip("PIL")
pytest.importorskip("fastapi")
import httpx  # noqa: E402
from PIL import Image  # noqa: E402

from tessellm import LLM  # noqa: E402
from tessellm.serve.app import build_app  # noqa: E402
from tessellm.serve.tools import render_chat  # noqa: E402
from tessellm.testing.models import build_tiny_qwen2_vl  # noqa: E402
from tessellm.testing.serving import serving  # noqa: E402

MODEL = "vl"
MAX_TOKENS = 5
LIMIT = 2  # images per prompt
FETCH_MAX_BYTES = 20_000
FETCH_TIMEOUT_S = 60.0  # the slow case lowers it: a loaded machine must not time out the others
RELEASE = threading.Event()  # /slow.png answers only once the module is done


def picture(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def file_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


IMAGE = picture(70, 90, 9)
PNG = file_bytes(IMAGE)


class Files(BaseHTTPRequestHandler):
    """A local image host: /ok.png, /big.png (over the fetch limit), /slow.png (answers only
    when the module's tests are done), anything else 404."""

    def do_GET(self):  # noqa: N802 (the standard library's name)
        if self.path == "/slow.png":
            RELEASE.wait(120)
        body = {"/ok.png": PNG, "/slow.png": PNG, "/big.png": b"\0" * (FETCH_MAX_BYTES + 1)}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        try:
            self.wfile.write(body or b"")
        except OSError:  # the fetch gave up
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def files():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Files)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    RELEASE.set()
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"))


@pytest.fixture(scope="module")
def vl(folder):
    """The server (its URL), its engine client, and the offline answer to one image and
    "t40 t41" as a chat message (taken before the engine is served)."""
    llm = LLM({"model": str(folder), "device": "cpu", "dtype": "float32", "decoding": {"name": "greedy"},
               "cache": {"name": "paged", "options": {"block_size": 4, "num_blocks": 128}},
               "images": {"max_per_prompt": LIMIT, "fetch_urls": True, "fetch_max_bytes": FETCH_MAX_BYTES,
                          "fetch_timeout_s": FETCH_TIMEOUT_S}})
    marker = llm.pipeline.image_processor.image_marker
    text = render_chat([{"role": "user", "content": marker + "t40 t41"}], llm.tokenizer)
    [expected] = llm.generate(text, {"max_tokens": MAX_TOKENS, "temperature": 0.0}, images=[[IMAGE]])
    app = build_app(llm, model_name=MODEL)
    with serving(app) as url:
        yield url, app.state.engine, expected.text


def chat(url: str, parts: list, **extra) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "messages": [{"role": "user", "content": parts}], **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def respond(url: str, parts: list, **extra) -> httpx.Response:
    body = {"model": MODEL, "max_output_tokens": MAX_TOKENS, "temperature": 0.0,
            "input": [{"role": "user", "content": parts}], **extra}
    return httpx.post(url + "/v1/responses", json=body, timeout=60)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def input_image(url: str) -> dict:
    return {"type": "input_image", "image_url": url}


def refused(r: httpx.Response, *words: str) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert all(w in error["message"] for w in words), error
    return error


def still_serves(url: str, expected: str) -> None:
    """The server answers a good image request (its first token: the offline answer's)."""
    r = chat(url, [image_part(data_url(PNG)), {"type": "text", "text": "t40 t41"}], max_tokens=1)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected.split()[0], r.text


def test_openai_clients_image_parts_on_chat_and_responses_give_the_offline_answer(vl):
    openai = pytest.importorskip("openai")
    url, _, expected = vl
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, max_tokens=MAX_TOKENS, temperature=0.0, messages=[
        {"role": "user", "content": [image_part(data_url(PNG)), {"type": "text", "text": "t40 t41"}]}])
    assert reply.choices[0].message.content == expected
    stream = client.chat.completions.create(model=MODEL, max_tokens=MAX_TOKENS, temperature=0.0, stream=True, messages=[
        {"role": "user", "content": [image_part(data_url(PNG)), {"type": "text", "text": "t40 t41"}]}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    counted = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": [
        {"role": "user", "content": [image_part(data_url(PNG)), {"type": "text", "text": "t40 t41"}]}]}).json()
    assert counted["count"] == reply.usage.prompt_tokens, counted  # the image's placeholders expanded
    response = client.responses.create(model=MODEL, max_output_tokens=MAX_TOKENS, temperature=0.0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(PNG), "detail": "auto"},
                                     {"type": "input_text", "text": "t40 t41"}]}])
    assert response.output_text == expected and response.usage.input_tokens == reply.usage.prompt_tokens
    follow = client.responses.create(model=MODEL, max_output_tokens=2, temperature=0.0, input="t42",
                                     previous_response_id=response.id)  # the image is part of the history
    assert follow.usage.input_tokens > response.usage.input_tokens


def test_http_image_urls_are_fetched_within_limits_and_only_when_allowed(vl, files, monkeypatch):
    url, engine, expected = vl
    r = chat(url, [image_part(files + "/ok.png"), {"type": "text", "text": "t40 t41"}])
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected, r.text
    r = respond(url, [input_image(files + "/ok.png"), {"type": "input_text", "text": "t40 t41"}])
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == expected, r.text
    error = refused(chat(url, [image_part(files + "/big.png")]), f"larger than this server's {FETCH_MAX_BYTES} bytes",
                    "--image-fetch-max-bytes")
    assert error["param"] == "messages[0].content[0].image_url"
    refused(chat(url, [image_part(files + "/gone.png")]), "answered HTTP 404")
    monkeypatch.setattr(engine, "images", engine.images.model_copy(update={"fetch_timeout_s": 0.3}))
    refused(respond(url, [input_image(files + "/slow.png")]), "longer than this server's 0.3 s",
            "--image-fetch-timeout")
    monkeypatch.setattr(engine, "images", engine.images.model_copy(update={"fetch_urls": False}))
    refused(chat(url, [image_part(files + "/ok.png")]), "fetching image URLs is off", "--allow-image-urls")
    refused(respond(url, [input_image(files + "/ok.png")]), "fetching image URLs is off")
    still_serves(url, expected)


TIFF = file_bytes(picture(60, 60, 1), "TIFF")


@pytest.mark.parametrize("parts, words, param", [
    ([image_part("data:image/png;base64,!!!")], ["not valid base64"], "messages[0].content[0].image_url"),
    ([image_part(data_url(b"hello, not a picture"))], ["could not be read", "PNG, JPEG"],
     "messages[0].content[0].image_url"),
    ([image_part(data_url(TIFF, "image/tiff"))], ["format TIFF", "not supported", "PNG, JPEG"],
     "messages[0].content[0].image_url"),
    pytest.param([image_part("ftp://host/a.png")], ["not a data: or http(s) URL"], "messages[0].content[0].image_url",
                 marks=pytest.mark.extended),
    ([image_part(data_url(PNG))] * (LIMIT + 1), [f"{LIMIT + 1} images", f"at most {LIMIT}",
                                                 "--limit-mm-per-prompt"], "messages"),
])
def test_bad_images_on_chat_are_a_400_naming_the_problem(vl, parts, words, param):
    url, _, expected = vl
    assert refused(chat(url, parts), *words)["param"] == param
    still_serves(url, expected)


@pytest.mark.parametrize("part, words, param", [
    ({"type": "input_image", "file_id": "file-abc"}, ["files are not stored"], "input[0].content[0].file_id"),
    pytest.param({"type": "input_image"}, ["image_url must be a string"], "input[0].content[0].image_url",
                 marks=pytest.mark.extended),
    pytest.param(input_image(data_url(TIFF, "image/tiff")), ["format TIFF"], "input[0].content[0].image_url",
                 marks=pytest.mark.extended),
    (input_image(data_url(b"GIF89a broken")), ["could not be read"], "input[0].content[0].image_url"),
    ({"type": "input_file", "file_id": "file-abc"}, ["'input_file' is not supported"], "input[0].content[1].type"),
])
def test_bad_input_images_on_responses_are_a_400_naming_the_problem(vl, part, words, param):
    url, _, expected = vl
    parts = [input_image(data_url(PNG)), part] if part["type"] == "input_file" else [part]
    assert refused(respond(url, parts), *words)["param"] == param
    error = refused(respond(url, [input_image(data_url(PNG))] * (LIMIT + 1)), f"at most {LIMIT}")
    assert error["param"] == "input"
    still_serves(url, expected)


def test_limit_mm_per_prompt_and_image_flags_set_the_images_section(capsys):
    from tessellm.cli import build_parser
    from tessellm.serve.cli import serve_config
    from tessellm.serve.router.cli import replica_serve_args

    def parse(*argv: str):
        return build_parser().parse_args(["serve", *argv])

    args = parse("--limit-mm-per-prompt", "image=3", "--allow-image-urls", "--image-fetch-timeout", "2.5",
                 "--image-fetch-max-bytes", "1000")
    images = serve_config(args).images
    assert (images.max_per_prompt, images.fetch_urls, images.fetch_timeout_s, images.fetch_max_bytes) == \
        (3, True, 2.5, 1000)
    assert serve_config(parse("--limit-mm-per-prompt", '{"image": 0}')).images.max_per_prompt == 0
    assert not serve_config(parse()).images.fetch_urls and serve_config(parse()).images.max_per_prompt == 8
    replica = replica_serve_args(args)
    assert "--allow-image-urls" in replica and replica[replica.index("--limit-mm-per-prompt") + 1] == "image=3"
    for bad, words in [("video=2", "modality 'video' is not served"), ("image=x", "not a whole number"),
                       ("image=-1", "0 or more"), ("{not json", "not valid JSON")]:
        with pytest.raises(SystemExit):
            parse("--limit-mm-per-prompt", bad)
        assert words in capsys.readouterr().err


@pytest.mark.extended  # a tessellm serve process and its engine core process
def test_tessellm_serve_takes_the_image_flags_to_its_engine_core_process(folder, files, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from tessellm.serve.router.launcher import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "tessellm", "serve", "--set", f"model={folder}", "--set",
                             "device=cpu", "--set", "dtype=float32", "--port", str(port), "--served-model-name", MODEL,
                             "--no-restart", "--limit-mm-per-prompt", "image=1", "--image-fetch-max-bytes", "100"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None and time.time() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                    break
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.3)
        refused(chat(url, [image_part(data_url(PNG))] * 2), "2 images in one prompt", "at most 1")
        refused(respond(url, [input_image(files + "/ok.png")]), "fetching image URLs is off", "--allow-image-urls")
        r = chat(url, [image_part(data_url(PNG)), {"type": "text", "text": "t40 t41"}])
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
