"""Embedding and reranking pipelines equal the references on tiny random checkpoints made
with transformers' own classes: ``LLM.embed`` equals sentence-transformers' ``encode`` (the
checkpoint saved by sentence-transformers, its modules.json and pooling config read back),
``LLM.score`` equals its CrossEncoder's ``predict``, and the yes/no reranker equals the
transformers computation of Qwen3-Reranker's model card; cosine (embeddings) at least 0.9999
and scores within 1e-5 in float32. Batches mix lengths, prefix caching is on and off, and
small step budgets make the scheduler batch continuously (sequences join and leave between
steps; a decoder's long prompts run in chunks)."""

from __future__ import annotations

import pytest
import torch

from tessellm import LLM
from tessellm.testing.embedding import build_sentence_transformer, build_tiny_decoder_base, build_tiny_encoder
from tessellm.testing.models import build_tiny

TEXTS = ["t5 t6 t7", "t9 " * 40, "t11 t12 t13 t14 t15 t16 t17 t18 t19 t20", "t30", "t8 t9 t10 " * 7,
         "t21 t22 t23 t24 t25"]
"""Mixed lengths: 1 to 40 words (3 to 42 tokens with an encoder's [CLS] and [SEP])."""
PROMPT = "t40 t41 t42 t43 t44 t45 t46 t47 t48 t49 t50 t51 t52 t53 t54 t55 t56 t57 "
"""A shared instruction before decoder queries (18 tokens): a prefix the prefix cache shares."""


def cosines(got: list, ref) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.tensor([o.embedding for o in got]), torch.as_tensor(ref), dim=-1)


def pipeline(folder, *, prefix_caching: bool = True, step_tokens: int = 64, **more) -> LLM:
    return LLM({"model": str(folder), "device": "cpu", "dtype": "float32",
                "cache": {"name": "paged", "options": {"block_size": 4, "prefix_caching": prefix_caching}},
                "scheduler": {"name": "continuous", "options": {"max_num_batched_tokens": step_tokens,
                                                                 "max_num_seqs": 4}}, **more})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Built once per (family, pooling mode) the module asks for."""
    made: dict[tuple, object] = {}

    def get(family: str, mode: str, **wrap):
        key = (family, mode, repr(sorted(wrap.items())))
        if key not in made:
            root = tmp_path_factory.mktemp(f"{family}-{mode}")
            base = (build_tiny_decoder_base(family, root / "base") if family in ("qwen3", "qwen2", "llama")
                    else build_tiny_encoder(family, root / "base"))
            made[key] = build_sentence_transformer(base, root / "st", pooling=mode, **wrap)
        return made[key]

    return get


def reference_embeddings(folder, texts, **kwargs):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, **kwargs)


ENCODER_CASES = [("bert", "mean"), ("xlm-roberta", "cls")]
ENCODER_MATRIX = [(f, m) for f in ("bert", "roberta", "xlm-roberta", "modernbert") for m in ("mean", "cls")
                  if (f, m) not in ENCODER_CASES]


@pytest.mark.parametrize("family,mode", ENCODER_CASES + [pytest.param(*c, marks=pytest.mark.extended)
                                                         for c in ENCODER_MATRIX])
def test_encoder_embeddings_equal_encode(checkpoints, family, mode):
    folder = checkpoints(family, mode)
    ref = reference_embeddings(folder, TEXTS)
    llm = pipeline(folder, step_tokens=48)  # the longest input (42 tokens) fits a step; the batch does not
    assert llm.pipeline.pooler.name == mode and llm.pipeline.spec.bidirectional
    got = llm.embed(TEXTS)
    assert cosines(got, ref).min() >= 0.9999
    assert llm.engine.cache.num_free_blocks == llm.engine.cache.num_blocks or \
        llm.engine.scheduler.num_running == 0  # nothing left holding blocks


@pytest.mark.parametrize("prefix_caching", [True, pytest.param(False, marks=pytest.mark.extended)])
def test_decoder_last_token_embeddings_with_and_without_prefix_caching(checkpoints, prefix_caching):
    """Qwen3-Embedding's shape: a base Qwen3 (no LM head, names without ``model.``),
    last-token pooling, a query prompt shared by every query. A step budget of 16 tokens
    chunks the long prompts; embedding twice lets the second pass hit the prefix cache."""
    folder = checkpoints("qwen3", "lasttoken", prompts={"query": PROMPT, "document": ""})
    ref = reference_embeddings(folder, TEXTS, prompt_name="query")
    llm = pipeline(folder, prefix_caching=prefix_caching, step_tokens=16)
    for _ in range(2):
        assert cosines(llm.embed(TEXTS, prompt_name="query"), ref).min() >= 0.9999
    hits = llm.engine.cache.prefix_cache_stats().hit_tokens
    assert (hits > 0) == prefix_caching


@pytest.mark.extended
@pytest.mark.parametrize("family", ["llama"])  # (transformers 5 gives a Qwen2 folder Qwen2's own tokenizer class)
def test_other_decoder_bases_embed_equal(checkpoints, family):
    folder = checkpoints(family, "lasttoken")
    assert cosines(pipeline(folder, step_tokens=16).embed(TEXTS), reference_embeddings(folder, TEXTS)).min() >= 0.9999


def test_requests_arriving_between_steps_equal_encode(checkpoints):
    """Continuous batching proper: requests join while others are mid-prompt (a decoder's
    chunks) and the finished ones leave, each output equal to its text run alone."""
    from tessellm import PoolingParams

    folder = checkpoints("qwen3", "mean")
    ref = reference_embeddings(folder, TEXTS)
    llm = pipeline(folder, step_tokens=12)
    engine, done = llm.engine, {}
    pending = list(enumerate(TEXTS))
    while pending or engine.has_unfinished():
        if pending:  # one more request every step
            i, text = pending.pop(0)
            engine.add_request(f"r{i}", llm.tokenizer(text)["input_ids"], PoolingParams())
        for state in engine.step():
            done[state.request_id] = engine.pop_finished(state.request_id).pooled
    got = torch.stack([done[f"r{i}"] for i in range(len(TEXTS))])
    assert torch.nn.functional.cosine_similarity(got, torch.as_tensor(ref), dim=-1).min() >= 0.9999


def test_dense_modules_dimensions_and_prompts_equal_encode(checkpoints):
    """A Dense module (tanh) after mean pooling, a prompt excluded from the pooled rows
    (include_prompt false), Matryoshka truncation then normalisation."""
    folder = checkpoints("bert", "mean", dense_features=32, include_prompt=False, prompts={"query": "t60 t61 t62 "},
                         default_prompt_name="query")
    llm = pipeline(folder)
    ref = reference_embeddings(folder, TEXTS)  # the default prompt applies
    assert cosines(llm.embed(TEXTS), ref).min() >= 0.9999
    cut = reference_embeddings(folder, TEXTS, truncate_dim=8, normalize_embeddings=True)
    got = llm.embed(TEXTS, dimensions=8)
    assert len(got[0].embedding) == 8 and cosines(got, cut).min() >= 0.9999
    assert abs(torch.tensor(got[1].embedding).norm().item() - 1) < 1e-5


CROSS_ENCODERS = [("bert", 1), ("modernbert", 1)]
"""The default set's; XLM-RoBERTa's is served in tests/serve/test_embeddings_api.py and in the extended set here."""


@pytest.fixture(scope="module")
def cross_encoders(tmp_path_factory):
    made = {}

    def get(family: str, labels: int, **shapes):
        key = (family, labels, tuple(sorted(shapes.items())))
        if key not in made:
            made[key] = build_tiny_encoder(family, tmp_path_factory.mktemp(f"ce-{family}"), head=True,
                                           num_labels=labels, **shapes)
        return made[key]

    return get


QUERY = "t5 t6 t7"
DOCS = ["t9 " * 30, "t11 t12 t13 t14 t15 t16 t17 t18 t19 t20", "t30", "t8 t9", "t40 t41 t42 t43 " * 4]


@pytest.mark.parametrize("family,labels", CROSS_ENCODERS + [
    pytest.param(*case, marks=pytest.mark.extended) for case in (("xlm-roberta", 1), ("roberta", 1), ("bert", 3))])
def test_cross_encoder_scores_equal_predict(cross_encoders, family, labels):
    from sentence_transformers import CrossEncoder

    folder = cross_encoders(family, labels)
    ref = torch.as_tensor(CrossEncoder(str(folder), device="cpu").predict([(QUERY, d) for d in DOCS])).reshape(len(DOCS), -1)
    llm = pipeline(folder)
    assert llm.pipeline.pooler.name == "classify"
    got = torch.tensor([o.scores for o in llm.score(QUERY, DOCS)])
    torch.testing.assert_close(got, ref.float(), atol=1e-5, rtol=1e-5)


def test_pairs_past_the_limit_are_refused_unless_truncated_as_cross_encoder_truncates(cross_encoders):
    """128 positions: a long pair is refused naming the limit; truncated to 24 tokens it equals
    CrossEncoder.predict at max_length 24 (the tokenizer's longest-first truncation)."""
    from sentence_transformers import CrossEncoder

    from tessellm import InvalidRequestError

    folder = cross_encoders("bert", 1)
    long_docs = [" ".join(f"t{5 + i % 200}" for i in range(140)), "t11 t12 " * 20]
    llm = pipeline(folder)
    with pytest.raises(InvalidRequestError, match="more than this model takes \\(max_model_len 128\\)"):
        llm.score(QUERY, long_docs)
    ref = CrossEncoder(str(folder), device="cpu", max_length=24).predict([(QUERY, d) for d in long_docs])
    got = llm.score(QUERY, long_docs, truncate_prompt_tokens=24)
    assert all(len(o.prompt_token_ids) == 24 for o in got)
    torch.testing.assert_close(torch.tensor([o.score for o in got]), torch.as_tensor(ref).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.extended
def test_modernbert_mean_classifier_pooling_equals_predict(cross_encoders):
    from sentence_transformers import CrossEncoder

    folder = cross_encoders("modernbert", 1, classifier_pooling="mean")
    ref = torch.as_tensor(CrossEncoder(str(folder), device="cpu").predict([(QUERY, d) for d in DOCS]))
    got = torch.tensor([o.score for o in pipeline(folder).score(QUERY, DOCS)])
    torch.testing.assert_close(got, ref.float(), atol=1e-5, rtol=1e-5)


YES_NO = dict(yes_token="t7", no_token="t8", prefix="t3 t4", body="{instruction} t5 {query} t6 {document}",
              suffix="t9", instruction="t10 t11")


@pytest.mark.parametrize("prefix_caching", [True, pytest.param(False, marks=pytest.mark.extended)])
def test_yes_no_reranker_equals_the_model_cards_computation(tmp_path, prefix_caching):
    """Qwen3-Reranker's score, P(yes) from the yes/no logits at the pair's last token, as its
    model card computes it with transformers (each part of the template tokenized alone)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_tiny("qwen3", tmp_path / "reranker")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = []
    for doc in DOCS:
        ids = [t for text in ("t3 t4", f"t10 t11 t5 {QUERY} t6 {doc}", "t9")
               for t in tok(text, add_special_tokens=False)["input_ids"]]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        ref.append(torch.log_softmax(logits[[8, 7]], dim=-1)[1].exp().item())
    llm = pipeline(folder, prefix_caching=prefix_caching, step_tokens=16,
                   pooling={"name": "yes-no", "options": YES_NO})
    for _ in range(2):  # the shared template prefix hits the cache the second time
        torch.testing.assert_close(torch.tensor([o.score for o in llm.score(QUERY, DOCS)]), torch.tensor(ref),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.extended  # the server's test scores by similarity against sentence-transformers in the default set
def test_embedding_pipeline_scores_by_similarity(checkpoints):
    """``score`` on an embedding pipeline: the cosine of the query's and each document's
    embeddings (their "query" and "document" prompts), as sentence-transformers' similarity."""
    from sentence_transformers import SentenceTransformer

    folder = checkpoints("qwen3", "lasttoken", prompts={"query": PROMPT, "document": ""})
    st = SentenceTransformer(str(folder), device="cpu")
    ref = st.similarity(st.encode_query([QUERY]), st.encode_document(DOCS))[0]
    got = torch.tensor([o.score for o in pipeline(folder).score(QUERY, DOCS)])
    torch.testing.assert_close(got, ref.float(), atol=1e-5, rtol=1e-5)
