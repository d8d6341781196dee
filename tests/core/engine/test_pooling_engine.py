"""The pooling engine's rules: what a pipeline serves and refuses (a generation request to an
embedding pipeline, an embedding to a generating one, each naming what the pipeline
serves), inputs past the model's length refused unless truncation is asked for (then equal
to sentence-transformers' own truncation), an encoder's prompt longer than a step refused,
bad pooling parameters named, every block given back (aborts, preemption and recompute)."""

from __future__ import annotations

import pytest
import torch

from tessellm import LLM, InvalidRequestError, PoolingParams, SamplingParams
from tessellm.testing.embedding import build_sentence_transformer, build_tiny_decoder_base, build_tiny_encoder
from tessellm.testing.models import build_tiny_llama

TEXTS = ["t5 t6 t7", "t9 " * 40, "t11 t12 t13 t14 t15 t16 t17 t18 t19 t20", "t30"]


def pipeline(folder, **more) -> LLM:
    config = {"model": str(folder), "device": "cpu", "dtype": "float32",
              "cache": {"name": "paged", "options": {"block_size": 4}}}
    config.update(more)
    return LLM(config)


@pytest.fixture(scope="module")
def bert_st(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    return build_sentence_transformer(build_tiny_encoder("bert", root / "base"), root / "st", pooling="mean",
                                      max_seq_length=16)


@pytest.fixture(scope="module")
def bert_llm(bert_st):
    return pipeline(bert_st)


def test_a_generation_request_to_an_embedding_pipeline_names_what_it_serves(bert_llm):
    with pytest.raises(InvalidRequestError, match=r"this pipeline embeds texts \(pooling plugin 'mean'\); it does "
                                                  r"not generate text"):
        bert_llm.generate("t5 t6", SamplingParams(max_tokens=2))
    assert bert_llm.engine.scheduler.num_waiting == 0


def test_an_embedding_request_to_a_generating_pipeline_names_what_it_serves(tmp_path):
    llm = pipeline(build_tiny_llama(tmp_path / "llama"))
    assert llm.pipeline.task == "generate" and llm.pipeline.pooler is None
    with pytest.raises(InvalidRequestError, match=r"this pipeline generates text .*pooling.name=last"):
        llm.embed(["t5 t6"])
    with pytest.raises(InvalidRequestError, match=r"generates text .*pooling.name=yes-no"):
        llm.score("t5", ["t6"])


def test_input_past_the_limit_is_refused_unless_truncation_is_asked(bert_llm, bert_st):
    """128 positions: a 150-word text is refused naming the limit; truncated to 16 tokens it
    equals sentence-transformers' encode at max_seq_length 16 (its own truncation)."""
    from sentence_transformers import SentenceTransformer

    long = " ".join(f"t{5 + i % 200}" for i in range(150))
    with pytest.raises(InvalidRequestError, match=r"input has 152 tokens, more than this model takes \(max_model_len "
                                                  r"128\); shorten it or ask for truncation \(truncate_prompt_tokens\)"):
        bert_llm.embed([long])
    ref = SentenceTransformer(str(bert_st), device="cpu").encode([long, TEXTS[1]])
    got = bert_llm.embed([long, TEXTS[1]], truncate_prompt_tokens=16)
    assert len(got[0].prompt_token_ids) == 16 and got[0].prompt_token_ids[-1] == 3  # [SEP] kept
    cos = torch.nn.functional.cosine_similarity(torch.tensor([o.embedding for o in got]), torch.tensor(ref), dim=-1)
    assert cos.min() >= 0.9999
    assert len(bert_llm.embed([long], truncate_prompt_tokens=-1)[0].prompt_token_ids) == 128
    for bad in (0, -2, 129, True):
        with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
            bert_llm.embed(["t5"], truncate_prompt_tokens=bad)


def test_token_id_inputs_truncate_to_their_last_tokens(bert_llm):
    ids = [2] + list(range(5, 205)) + [3]
    out = bert_llm.embed([ids], truncate_prompt_tokens=10)[0]
    assert out.prompt_token_ids == ids[-10:]


def test_an_encoder_prompt_longer_than_a_step_is_refused_naming_the_budget(bert_st):
    llm = pipeline(bert_st, scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 8}})
    assert llm.engine.scheduler.max_step_tokens == 8  # a budget the config sets is kept
    with pytest.raises(InvalidRequestError, match=r"attends both ways, so a prompt runs in one step of at most 8 "
                                                  r"tokens \(the scheduler's max_num_batched_tokens\)"):
        llm.embed([TEXTS[2]])
    assert len(llm.embed(["t5 t6 t7 t8"])[0].embedding) == 64  # 6 tokens fit


def test_default_step_budgets_grow_for_prefills_only_and_to_hold_an_encoders_longest_prompt(tmp_path):
    root = tmp_path
    folder = build_sentence_transformer(build_tiny_encoder("modernbert", root / "base",
                                                           max_position_embeddings=10000), root / "st", pooling="cls")
    llm = pipeline(folder)
    assert llm.engine.scheduler.max_step_tokens == 10000 and llm.engine.scheduler.max_step_seqs == 256
    small = pipeline(folder, max_model_len=512)
    assert small.engine.scheduler.max_step_tokens == 8192  # the continuous scheduler's default is 1024


def test_bad_pooling_parameters_are_named(bert_llm):
    with pytest.raises(InvalidRequestError, match="dimensions: 65 is more than the embedding's 64 values"):
        bert_llm.embed(["t5"], dimensions=65)
    with pytest.raises(InvalidRequestError, match="dimensions"):
        bert_llm.embed(["t5"], dimensions=0)
    with pytest.raises(InvalidRequestError, match="use_activation applies to scores"):
        bert_llm.engine.add_request("x", [2, 5, 3], PoolingParams(use_activation=True))
    with pytest.raises(InvalidRequestError, match="prompt_name 'nope' is not one of the checkpoint's prompts"):
        bert_llm.embed(["t5"], prompt_name="nope")
    with pytest.raises(InvalidRequestError, match="input\\[1\\] must be a non-empty string"):
        bert_llm.embed(["t5", ""])
    assert not bert_llm.engine.requests


def test_normalize_and_dimensions_per_request(bert_llm):
    raw = torch.tensor(bert_llm.embed(["t5 t6"], normalize=False)[0].embedding)
    unit = torch.tensor(bert_llm.embed(["t5 t6"])[0].embedding)
    assert abs(unit.norm().item() - 1) < 1e-5 and abs(raw.norm().item() - 1) > 1e-3
    torch.testing.assert_close(unit, raw / raw.norm())
    cut = torch.tensor(bert_llm.embed(["t5 t6"], dimensions=16, normalize=False)[0].embedding)
    torch.testing.assert_close(cut, raw[:16])


def test_aborts_and_failures_give_every_block_back(bert_llm):
    engine = bert_llm.engine
    for i, text in enumerate(TEXTS):
        engine.add_request(f"a{i}", bert_llm.tokenizer(text)["input_ids"], PoolingParams())
    engine.abort("a1")
    engine.step()
    for request_id in list(engine.requests):
        engine.abort(request_id)
    assert not engine.has_unfinished() and engine.cache.num_allocated_slots() == 0
    assert not engine._pooled  # nothing kept for the requests gone


@pytest.mark.extended
def test_a_preempted_sequence_recomputes_to_the_same_embedding(tmp_path):
    """A decoder's mean pooling reads every row, gathered across chunks: a sequence preempted
    mid-prompt (its cache freed, as a scheduler short of blocks does) is recomputed from its
    start, and the rows gathered before are replaced, not pooled twice."""
    from sentence_transformers import SentenceTransformer

    from tessellm.core.interfaces.batch import SchedulerOutput

    base = build_tiny_decoder_base("qwen3", tmp_path / "base")
    folder = build_sentence_transformer(base, tmp_path / "st", pooling="mean")
    texts = ["t9 " * 40, "t11 t12 t13 " * 10]
    ref = SentenceTransformer(str(folder), device="cpu").encode(texts)
    llm = pipeline(folder, scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 12}})
    engine, done, preempted = llm.engine, {}, False
    for i, text in enumerate(texts):
        engine.add_request(f"r{i}", llm.tokenizer(text)["input_ids"], PoolingParams())
    while engine.has_unfinished():
        for state in engine.step():
            done[state.request_id] = engine.pop_finished(state.request_id).pooled
        seq = engine.requests["r0"].seqs[0] if "r0" in engine.requests else None
        if not preempted and seq is not None and 12 < seq.num_computed_tokens < seq.num_prompt_tokens:
            engine.scheduler._preempt_one(seq, {}, SchedulerOutput())
            preempted = True
    assert preempted
    got = torch.stack([done["r0"], done["r1"]])
    assert torch.nn.functional.cosine_similarity(got, torch.tensor(ref), dim=-1).min() >= 0.9999
    assert engine.cache.num_allocated_slots() == 0


def test_a_checkpoint_whose_pooling_no_pooler_implements_is_refused(tmp_path):
    """sentence-transformers' "max" pooling: no built-in implements it; the pipeline refuses
    rather than serve the embedding model as a generator, and a named pooler overrides."""
    from tessellm import ConfigError

    base = build_tiny_decoder_base("qwen3", tmp_path / "base")
    folder = build_sentence_transformer(base, tmp_path / "st", pooling="max")
    with pytest.raises(ConfigError, match=r"the checkpoint pools with 'max' \(1_Pooling/config.json\), which no "
                                          r"installed pooler implements.*mean \(mean\)"):
        pipeline(folder)
    assert pipeline(folder, pooling={"name": "mean"}).pipeline.task == "embed"
