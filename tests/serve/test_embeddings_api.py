"""The pooling routes as clients meet them: /v1/embeddings through the openai client's
``embeddings.create`` (float and base64, token ids, dimensions, usage), langchain's
OpenAIEmbeddings and litellm's ``embedding()``; /v1/rerank as Jina's and Cohere's clients send
it and /v1/score as vLLM's, equal to sentence-transformers' CrossEncoder; and the refusals:
an input past the model's length without ``truncate_prompt_tokens``, a route of another
task than the pipeline's (each naming what it serves), bad fields."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai")

from tessellm import LLM  # noqa: E402
from tessellm.serve.app import build_app  # noqa: E402
from tessellm.testing.embedding import build_sentence_transformer, build_tiny_encoder  # noqa: E402
from tessellm.testing.models import build_tiny_llama  # noqa: E402
from tessellm.testing.serving import serving  # noqa: E402

TEXTS = ["t5 t6 t7", "t9 " * 40, "t11 t12 t13 t14 t15 t16 t17 t18 t19 t20", "t30"]
DOCS = ["t9 " * 30, "t11 t12 t13 t14 t15", "t30", "t8 t9"]


def config(folder) -> dict:
    return {"model": str(folder), "device": "cpu", "dtype": "float32",
            "cache": {"name": "paged", "options": {"block_size": 4}}}


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """A served BERT embedding model (mean pooling, normalised); yields (url, folder)."""
    root = tmp_path_factory.mktemp("embedder")
    folder = build_sentence_transformer(build_tiny_encoder("bert", root / "base"), root / "st", pooling="mean",
                                        prompts={"query": "t60 t61 "})
    with serving(build_app(LLM(config(folder)), model_name="embedder")) as url:
        yield url, folder


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """A served XLM-RoBERTa cross-encoder; yields (url, folder)."""
    folder = build_tiny_encoder("xlm-roberta", tmp_path_factory.mktemp("reranker"), head=True)
    with serving(build_app(LLM(config(folder)), model_name="reranker")) as url:
        yield url, folder


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    folder = build_tiny_llama(tmp_path_factory.mktemp("llama"))
    with serving(build_app(LLM(config(folder)), model_name="gen")) as url:
        yield url


def reference(folder, texts, **kwargs) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return torch.as_tensor(SentenceTransformer(str(folder), device="cpu").encode(texts, **kwargs))


def cos(a, b) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a, dtype=torch.float32), b, dim=-1)


def error_of(r: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err
    return err


# ---------------------------------------------------------------------------- /v1/embeddings


def test_openai_client_embeddings_equal_encode(embedder):
    url, folder = embedder
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    ref = reference(folder, TEXTS)
    for fmt in ({"encoding_format": "float"}, {}):  # unasked, the client asks for base64 and decodes it
        got = client.embeddings.create(model="embedder", input=TEXTS, **fmt)
        assert [d.index for d in got.data] == [0, 1, 2, 3] and got.model == "embedder"
        assert cos([d.embedding for d in got.data], ref).min() >= 0.9999
    ids = httpx.post(url + "/tokenize", json={"prompt": TEXTS[2]}).json()["tokens"]
    by_ids = client.embeddings.create(model="embedder", input=ids)
    assert cos([by_ids.data[0].embedding], ref[2:3]).min() >= 0.9999
    assert by_ids.usage.prompt_tokens == by_ids.usage.total_tokens == len(ids)
    many = client.embeddings.create(model="embedder", input=[ids, ids[:3]])
    assert len(many.data) == 2 and many.usage.prompt_tokens == len(ids) + 3


def test_base64_is_float32_little_endian_and_dimensions_cut_then_normalise(embedder):
    url, folder = embedder
    body = httpx.post(url + "/v1/embeddings", json={"input": "t5 t6 t7", "encoding_format": "base64",
                                                    "dimensions": 16}).json()
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (16,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    cut = reference(folder, ["t5 t6 t7"], truncate_dim=16, normalize_embeddings=True)
    assert cos([vector.tolist()], cut).min() >= 0.9999
    assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 5}


def test_prompt_name_and_normalize_extras(embedder):
    url, folder = embedder
    body = httpx.post(url + "/v1/embeddings", json={"input": [TEXTS[0]], "prompt_name": "query"}).json()
    assert cos([body["data"][0]["embedding"]], reference(folder, [TEXTS[0]], prompt_name="query")).min() >= 0.9999
    raw = httpx.post(url + "/v1/embeddings", json={"input": TEXTS[0], "normalize": False}).json()["data"][0]
    assert abs(np.linalg.norm(raw["embedding"]) - 1) > 1e-3
    # clients that send every field, unset ones as null: floats, every dimension
    nulls = httpx.post(url + "/v1/embeddings", json={"input": [TEXTS[0]], "encoding_format": None, "dimensions": None,
                                                     "user": None, "model": None}).json()["data"][0]["embedding"]
    assert cos([nulls], reference(folder, [TEXTS[0]])).min() >= 0.9999


def test_langchain_embeds_through_the_server(embedder):
    url, folder = embedder
    from langchain_openai import OpenAIEmbeddings

    ref = reference(folder, TEXTS)
    # check_embedding_ctx_length=False: send texts (langchain otherwise tokenizes with tiktoken's OpenAI encoding)
    lc = OpenAIEmbeddings(model="embedder", base_url=url + "/v1", api_key="none", check_embedding_ctx_length=False,
                          chunk_size=3)  # a batch of 3 texts, then 1, as langchain splits a long list
    assert cos(lc.embed_documents(TEXTS), ref).min() >= 0.9999
    assert cos([lc.embed_query(TEXTS[0])], ref[:1]).min() >= 0.9999


@pytest.mark.extended  # litellm's import alone takes seconds
def test_litellm_embeds_and_reranks_through_the_server(embedder, reranker):
    """litellm's ``embedding()``, and its ``rerank()`` as its Cohere, vLLM and Jina providers send it."""
    url, folder = embedder
    ref = reference(folder, TEXTS)
    import litellm
    from sentence_transformers import CrossEncoder

    got = litellm.embedding(model="openai/embedder", api_base=url + "/v1", api_key="none", input=TEXTS)
    assert cos([d["embedding"] for d in got.data], ref).min() >= 0.9999
    url, folder = reranker
    scores = CrossEncoder(str(folder), device="cpu").predict([("t5 t6 t7", d) for d in DOCS])
    for model, base in (("cohere/reranker", url), ("hosted_vllm/reranker", url + "/v1"), ("jina_ai/reranker", url + "/v1")):
        ranked = litellm.rerank(model=model, api_base=base, api_key="none", query="t5 t6 t7", documents=DOCS, top_n=2)
        assert [r["index"] for r in ranked.results] == list(np.argsort(-scores)[:2]), model
        assert ranked.results[0]["relevance_score"] == pytest.approx(float(scores.max()), abs=1e-5)


def test_an_input_past_the_limit_is_a_400_naming_it_unless_truncated(embedder):
    url, folder = embedder
    long = " ".join(f"t{5 + i % 200}" for i in range(150))
    error_of(httpx.post(url + "/v1/embeddings", json={"input": ["t5", long]}), 400, "input",
             "input[1]: input has 152 tokens, more than this model takes (max_model_len 128)", "truncate_prompt_tokens")
    ok = httpx.post(url + "/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 32}).json()
    assert ok["usage"]["prompt_tokens"] == 32
    error_of(httpx.post(url + "/v1/embeddings", json={"input": "t5", "truncate_prompt_tokens": 0}), 400, "input",
             "truncate_prompt_tokens must be a positive number of tokens or -1")


@pytest.mark.parametrize("body,param,words", [
    ({"input": []}, "input", ["give 1 to 2048 texts or lists of token ids, not 0"]),
    ({"input": ["t5"] * 2049}, "input", ["not 2049"]),
    ({"input": ["t5", 7]}, "input", []),
    ({"input": "t5", "dimensions": 65}, "input", ["dimensions: 65 is more than the embedding's 64 values"]),
    ({"input": "t5", "dimensions": 0}, "dimensions", []),
    ({"input": "t5", "encoding_format": "int8"}, "encoding_format", []),
    ({"input": "t5", "prompt_name": "nope"}, "input", ["prompt_name 'nope'"]),
    ({"input": "t5", "model": "gpt-4"}, "model", ["gpt-4"]),
])
def test_bad_embedding_requests_are_400s_naming_the_field(embedder, body, param, words):
    status = 404 if "model" in body else 400
    error_of(httpx.post(embedder[0] + "/v1/embeddings", json=body), status, param, *words)


def test_each_route_of_another_task_names_what_the_pipeline_serves(embedder, reranker, generator):
    error_of(httpx.post(generator + "/v1/embeddings", json={"input": "t5"}), 400, "model",
             "/v1/embeddings: model 'gen' generates text (it has no pooler); it serves /v1/completions")
    error_of(httpx.post(reranker[0] + "/v1/embeddings", json={"input": "t5"}), 400, "model",
             "scores (query, document) pairs (pooling plugin 'classify'); it serves /v1/rerank or /v1/score")
    error_of(httpx.post(generator + "/v1/rerank", json={"query": "t5", "documents": ["t6"]}), 400, "model",
             "generates text")
    error_of(httpx.post(embedder[0] + "/v1/completions", json={"model": "embedder", "prompt": "t5", "max_tokens": 2}),
             400, "model", "/v1/completions: model 'embedder' embeds texts (pooling plugin 'mean'); it serves "
                           "/v1/embeddings")
    error_of(httpx.post(reranker[0] + "/v1/chat/completions",
                        json={"model": "reranker", "messages": [{"role": "user", "content": "hi"}]}), 400, "model",
             "/v1/chat/completions: model 'reranker' scores (query, document) pairs")
    error_of(httpx.post(embedder[0] + "/v1/responses", json={"model": "embedder", "input": "hi"}), 400, "model",
             "/v1/responses: model 'embedder' embeds texts")


# ---------------------------------------------------------------------------- /v1/rerank and /v1/score


def test_rerank_orders_by_relevance_as_jina_and_cohere_clients_read_it(reranker):
    url, folder = reranker
    from sentence_transformers import CrossEncoder

    ref = CrossEncoder(str(folder), device="cpu").predict([("t5 t6 t7", d) for d in DOCS])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        body = httpx.post(url + path, json={"model": "reranker", "query": "t5 t6 t7", "documents": DOCS,
                                            "top_n": 3}).json()
        results = body["results"]
        assert [r["index"] for r in results] == list(np.argsort(-ref)[:3])
        for r in results:
            assert abs(r["relevance_score"] - ref[r["index"]]) < 1e-5 and r["document"]["text"] == DOCS[r["index"]]
        assert body["model"] == "reranker" and body["usage"]["total_tokens"] > 0
    objects = httpx.post(url + "/v1/rerank", json={"query": "t5 t6 t7", "documents": [{"text": d} for d in DOCS],
                                                   "return_documents": False}).json()["results"]
    assert len(objects) == 4 and "document" not in objects[0]


def test_score_one_against_many_and_pairwise(reranker):
    url, folder = reranker
    from sentence_transformers import CrossEncoder

    pairs = [("t5 t6 t7", d) for d in DOCS]
    ref = CrossEncoder(str(folder), device="cpu").predict(pairs)
    body = httpx.post(url + "/v1/score", json={"model": "reranker", "text_1": "t5 t6 t7", "text_2": DOCS}).json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and body["object"] == "list"
    np.testing.assert_allclose([d["score"] for d in body["data"]], ref, atol=1e-5)
    pairwise = httpx.post(url + "/score", json={"text_1": ["t5 t6 t7"] * 4, "text_2": DOCS}).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]], ref, atol=1e-5)
    error_of(httpx.post(url + "/v1/score", json={"text_1": ["a", "b"], "text_2": DOCS}), 400, "text_2",
             "2 queries for 4 documents")
    for first, second in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2")):  # vLLM's names
        named = httpx.post(url + "/v1/score", json={first: "t5 t6 t7", second: DOCS}).json()
        np.testing.assert_allclose([d["score"] for d in named["data"]], ref, atol=1e-5)
    error_of(httpx.post(url + "/v1/score", json={"query": "t5", "text": DOCS}), 400, "text_1",
             "give text_1 and text_2 (or vLLM's queries and documents")
    # use_activation false: the head's raw logits, as CrossEncoder.predict with an identity activation
    logits = CrossEncoder(str(folder), device="cpu").predict(pairs, activation_fn=torch.nn.Identity())
    raw = httpx.post(url + "/v1/score", json={"text_1": "t5 t6 t7", "text_2": DOCS, "use_activation": False}).json()
    np.testing.assert_allclose([d["score"] for d in raw["data"]], logits, atol=1e-5)
    ranked = httpx.post(url + "/v1/rerank", json={"query": "t5 t6 t7", "documents": DOCS, "use_activation": False})
    assert sorted(r["relevance_score"] for r in ranked.json()["results"]) == pytest.approx(sorted(logits), abs=1e-5)
    error_of(httpx.post(url + "/v1/rerank", json={"query": "", "documents": DOCS}), 400, "query", "non-empty query")


def test_an_embedding_model_scores_by_cosine_similarity(embedder):
    url, folder = embedder
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    ref = st.similarity(st.encode(["t5 t6 t7"], prompt_name="query"), st.encode(DOCS))[0]
    body = httpx.post(url + "/v1/score", json={"text_1": "t5 t6 t7", "text_2": DOCS}).json()
    np.testing.assert_allclose([d["score"] for d in body["data"]], ref.numpy(), atol=1e-5)


def test_a_batch_is_admitted_whole_when_the_queue_has_room(tmp_path_factory):
    """A batch of more inputs than the waiting queue holds is one request: admitted whole when
    the queue has room as it arrives (langchain sends a thousand texts a request)."""
    root = tmp_path_factory.mktemp("small-queue")
    folder = build_sentence_transformer(build_tiny_encoder("bert", root / "base"), root / "st", pooling="cls")
    with serving(build_app(LLM(config(folder)), max_waiting=4)) as url:
        body = httpx.post(url + "/v1/embeddings", json={"input": [f"t{5 + i}" for i in range(12)]}, timeout=120)
        assert body.status_code == 200 and len(body.json()["data"]) == 12


@pytest.mark.extended  # two engine-core processes, each loading torch and its checkpoint
def test_an_engine_core_process_embeds_and_reranks_as_the_thread_does(embedder, reranker):
    """``tessellm serve``'s default: the engine core in its own process. Each input crosses
    as a ``pool`` request (serve/pooling_kind.py) and its output comes back equal."""
    pytest.importorskip("zmq")
    from tessellm.core.model.loader import load_tokenizer
    from tessellm.serve.engine_client import EngineClient
    from tessellm.serve.engine_process import ProcessTransport

    for (thread_url, folder), path, body, read in (
            (embedder, "/v1/embeddings", {"input": TEXTS}, lambda r: [d["embedding"] for d in r["data"]]),
            (reranker, "/v1/rerank", {"query": "t5 t6 t7", "documents": DOCS},
             lambda r: [(x["index"], x["relevance_score"]) for x in r["results"]])):
        transport = ProcessTransport(config(folder))
        transport.start()
        client = EngineClient(transport, load_tokenizer(folder))
        assert client.info.task in ("embed", "score") and client.info.pooler in ("mean", "classify")
        with serving(build_app(client, model_name="m")) as url:
            got = read(httpx.post(url + path, json=body, timeout=120).json())
            want = read(httpx.post(thread_url + path, json=body, timeout=120).json())
            np.testing.assert_allclose(np.asarray(got, dtype=float), np.asarray(want, dtype=float), atol=1e-6)
            if path == "/v1/embeddings":  # token ids cross as they are; ids outside the vocabulary are a 400
                ids = [[5, 6, 7], [9] * 20]
                got = read(httpx.post(url + path, json={"input": ids}, timeout=120).json())
                want = read(httpx.post(thread_url + path, json={"input": ids}, timeout=120).json())
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
                error_of(httpx.post(url + path, json={"input": [[5], [10 ** 6]]}), 400, "input",
                         "input[1]: prompt token id 1000000 is outside the vocabulary")
            error_of(httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "t5"}), 400, "model",
                     "it serves")
