"""``LLM.embed`` and ``LLM.score``: the Python API of an embedding or scoring pipeline (one
whose config chose a pooler), and how texts and (query, document) pairs become pooling
requests, which the server's routes share.

Texts are tokenized as sentence-transformers tokenizes them, so that outputs equal its
``encode`` and its CrossEncoder's ``predict``: a named prompt (the checkpoint's
``config_sentence_transformers.json``; its ``default_prompt_name`` when none is asked for) is
put before the text, lower-cased where the checkpoint says ``do_lower_case``, and a prompt
the pooling excludes (``include_prompt`` false) is skipped when pooling. A text longer than
the model takes is an error unless ``truncate_prompt_tokens`` asks for truncation: the
tokenizer's own, to that many tokens with its special tokens kept (-1: to the model's
limit); token-id inputs keep their last ones, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence as Seq

import torch

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.pooling import PoolingParams

@dataclass
class EmbeddingOutput:
    """One text's embedding (``LLM.embed``)."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]


@dataclass
class ScoreOutput:
    """One (query, document) pair's score (``LLM.score``): ``score`` the first label's (the
    only one of a reranker), ``scores`` one per label."""

    request_id: str
    prompt_token_ids: list[int]
    score: float
    scores: list[float]


@dataclass(frozen=True)
class PooledInput:
    """One pooling request's input: its token ids, their type ids (an encoder's segments; None:
    all 0) and how many leading tokens (a prompt) pooling leaves out."""

    token_ids: list[int]
    token_type_ids: list[int] | None = None
    skip: int = 0


SIMILARITIES = ("cosine", "dot", "euclidean", "manhattan")
"""sentence-transformers' similarity functions (``similarity_fn_name``); the distances are
negated, so that higher is more similar."""

DOCUMENT_PROMPTS = ("document", "passage", "corpus")
"""The prompt names sentence-transformers' ``encode_document`` tries, in order."""


def similarity_prompts(said: Any) -> tuple[str | None, str | None]:
    """The prompt names a query and its documents are embedded under when an embedding
    pipeline scores pairs (sentence-transformers' encode_query and encode_document)."""
    return ("query" if "query" in said.prompts else None,
            next((n for n in DOCUMENT_PROMPTS if n in said.prompts), None))


def similarity(name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``name`` similarity of a [D] against each row of b [N, D] (float32) -> [N]."""
    a, b = a.float(), b.float()
    if name == "cosine":
        return torch.nn.functional.cosine_similarity(a[None, :], b, dim=-1)
    if name == "dot":
        return b @ a
    if name == "euclidean":
        return -torch.linalg.vector_norm(b - a, dim=-1)
    if name == "manhattan":
        return -(b - a).abs().sum(dim=-1)
    raise InvalidRequestError(f"similarity {name!r} is unknown; known: {', '.join(SIMILARITIES)}")


class EmbedAndScore:
    """The pooling half of ``LLM`` (its pipeline's ``pooler`` set): ``embed`` and ``score``."""

    pipeline: Any
    tokenizer: Any
    engine: Any

    # ------------------------------------------------------------------ public

    def embed(self, texts: str | Seq[str] | Seq[list[int]], *, prompt_name: str | None = None,
              prompt: str | None = None, dimensions: int | None = None, normalize: bool | None = None,
              truncate_prompt_tokens: int | None = None, progress: bool | None = None) -> list[Any]:
        """Each text's (or token-id list's) embedding, in order (``EmbeddingOutput``).
        ``prompt_name``/``prompt``: a prompt before each text (default: the checkpoint's
        default prompt); ``dimensions``: keep the first values (Matryoshka); ``normalize``:
        unit length (None: as the checkpoint says)."""

        self._require("embed")
        texts = [texts] if isinstance(texts, str) or _is_ids(texts) else list(texts)
        inputs = self.embedding_inputs(texts, prompt_name=prompt_name, prompt=prompt,
                                       truncate_prompt_tokens=truncate_prompt_tokens)
        params = self._pooling_params(dimensions=dimensions, normalize=normalize)
        return [EmbeddingOutput(rid, item.token_ids, out.tolist())
                for rid, item, out in self._pool(inputs, params, progress)]

    def score(self, query: str | Seq[str], documents: str | Seq[str], *, truncate_prompt_tokens: int | None = None,
              use_activation: bool | None = None, progress: bool | None = None) -> list[Any]:
        """Each document's score against ``query`` (a list of queries: one per document), in
        order (``ScoreOutput``): a reranker's relevance (``classify``, ``yes-no``), or for an
        embedding pipeline the similarity of the two embeddings (the checkpoint's similarity
        function, cosine by default; the query under its "query" prompt, documents under
        their "document" one, as sentence-transformers' encode_query/encode_document)."""

        queries, docs = pairs_of(query, documents)
        if self.pipeline.task == "embed":
            return self._similarities(queries, docs, truncate_prompt_tokens, progress)
        self._require("score")
        inputs = self.score_inputs(queries, docs, truncate_prompt_tokens=truncate_prompt_tokens)
        params = self._pooling_params(use_activation=use_activation)
        return [ScoreOutput(rid, item.token_ids, float(out[0]), out.tolist())
                for rid, item, out in self._pool(inputs, params, progress)]

    # ------------------------------------------------------------------ inputs (the server's too)

    def embedding_inputs(self, texts: list[Any], *, prompt_name: str | None = None, prompt: str | None = None,
                         truncate_prompt_tokens: int | None = None) -> list[Any]:
        """Each text (a string or token ids) as a ``PooledInput``, tokenized as
        sentence-transformers does (see the module docstring); InvalidRequestError for an
        empty input, an unknown prompt name or a bad truncation."""

        said = self.pipeline.checkpoint_pooling
        text_prompt = self._prompt(prompt_name, prompt)
        limit = self._truncation(truncate_prompt_tokens)
        skip = self._prompt_length(text_prompt) if text_prompt and not said.include_prompt else 0
        inputs = []
        for i, text in enumerate(texts):
            where = f"input[{i}]" if len(texts) > 1 else "input"
            if _is_ids(text):
                ids = list(text)
                inputs.append(PooledInput(ids[-limit:] if limit is not None else ids))
                continue
            if not isinstance(text, str) or not text:
                raise InvalidRequestError(f"{where} must be a non-empty string or a list of token ids, "
                                          f"not {text!r}"[:200], field="input")
            full = (text_prompt or "") + text
            full = full.lower() if said.do_lower_case else full
            encoded = self.tokenizer(full, **({"truncation": True, "max_length": limit} if limit else {}))
            inputs.append(PooledInput(list(encoded["input_ids"]), skip=skip))
        return inputs

    def score_inputs(self, queries: list[str], documents: list[str], *,
                     truncate_prompt_tokens: int | None = None) -> list[Any]:
        """Each (query, document) pair as one ``PooledInput``, as the pooler pairs them
        (``Pooler.encode_pair``: a cross-encoder's pair encoding, a decoder reranker's
        template), truncated as the pooler truncates where asked."""

        limit = self._truncation(truncate_prompt_tokens)
        pair = self.pipeline.pooler.encode_pair
        return [PooledInput(*pair(self.tokenizer, query, doc, max_length=limit)) for query, doc in zip(queries, documents)]

    # ------------------------------------------------------------------ internals

    def _require(self, task: str) -> None:
        have = self.pipeline.task
        if have == task:
            return
        if have == "generate":
            raise InvalidRequestError(f"this pipeline generates text (no pooler: the checkpoint's pooling is "
                                      f"{self.pipeline.checkpoint_pooling.source}); to {task}, serve an embedding or "
                                      f"reranking model, or name a pooler (pooling.name={'last' if task == 'embed' else 'yes-no'})")
        raise InvalidRequestError(f"this pipeline {'embeds texts' if have == 'embed' else 'scores (query, document) pairs'} "
                                  f"(pooling plugin {self.pipeline.pooler.name!r}); it does not {task}"
                                  f"{': use LLM.score' if have == 'score' else ''}")

    def _pooling_params(self, **fields: Any) -> PoolingParams:
        from pydantic import ValidationError

        from tessellm.core.errors import validation_problems

        try:
            return PoolingParams(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            raise InvalidRequestError(validation_problems(exc)) from None

    def _prompt(self, name: str | None, prompt: str | None) -> str | None:
        said = self.pipeline.checkpoint_pooling
        if prompt is not None and name is not None:
            raise InvalidRequestError("give prompt or prompt_name, not both")
        if prompt is not None:
            return prompt
        name = name if name is not None else said.default_prompt_name
        if name is None:
            return None
        if name not in said.prompts:
            raise InvalidRequestError(f"prompt_name {name!r} is not one of the checkpoint's prompts "
                                      f"({', '.join(map(repr, said.prompts)) or 'it has none'})")
        return said.prompts[name]

    def _prompt_length(self, prompt: str) -> int:
        """The prompt's tokens before a text, as sentence-transformers counts them: its own
        tokenization less a trailing special token."""
        ids = self.tokenizer(prompt)["input_ids"]
        if ids and ids[-1] in set(getattr(self.tokenizer, "all_special_ids", ())):
            return len(ids) - 1
        return len(ids)

    def _truncation(self, value: int | None) -> int | None:
        """How many tokens an input keeps (None: no truncation; -1: the model's limit)."""
        limit = self.pipeline.resolved.max_model_len
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -1:
            raise InvalidRequestError(f"truncate_prompt_tokens must be a positive number of tokens or -1 (the "
                                      f"model's limit, {limit}), not {value!r}")
        if value > limit:
            raise InvalidRequestError(f"truncate_prompt_tokens {value} is more than this model takes "
                                      f"(max_model_len {limit})")
        return limit if value == -1 else value

    def _pool(self, inputs: list[Any], params: PoolingParams, progress: bool | None) -> list[tuple[str, Any, Any]]:
        """Run every input as one pooling request; (request id, input, output tensor) in order."""
        if not inputs:
            raise InvalidRequestError("no inputs given")
        requests = [lambda rid, item=item: self.engine.add_request(rid, item.token_ids, params,
                                                                   token_type_ids=item.token_type_ids, skip=item.skip)
                    for item in inputs]
        ids, done = self._run_requests(requests, None, progress)
        return [(rid, item, done[rid].pooled.cpu()) for rid, item in zip(ids, inputs)]

    def _similarities(self, queries: list[str], docs: list[str], truncate: int | None,
                      progress: bool | None) -> list[Any]:

        said = self.pipeline.checkpoint_pooling
        query_prompt, doc_prompt = similarity_prompts(said)
        unique = list(dict.fromkeys(queries))
        q = self.embed(unique, prompt_name=query_prompt, truncate_prompt_tokens=truncate, progress=progress)
        d = self.embed(docs, prompt_name=doc_prompt, truncate_prompt_tokens=truncate, progress=progress)
        by_query = {text: torch.tensor(out.embedding) for text, out in zip(unique, q)}
        outs = []
        for query, doc in zip(queries, d):
            value = float(similarity(said.similarity, by_query[query], torch.tensor(doc.embedding)[None])[0])
            outs.append(ScoreOutput(doc.request_id, doc.prompt_token_ids, value, [value]))
        return outs


def _is_ids(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def pairs_of(query: str | Seq[str], documents: str | Seq[str]) -> tuple[list[str], list[str]]:
    """(queries, documents) of equal length: one query for every document, or one per document."""
    docs = [documents] if isinstance(documents, str) else list(documents)
    queries = [query] if isinstance(query, str) else list(query)
    if not docs:
        raise InvalidRequestError("no documents to score")
    if len(queries) == 1:
        queries = queries * len(docs)
    if len(queries) != len(docs):
        raise InvalidRequestError(f"{len(queries)} queries for {len(docs)} documents: give one query, or one per "
                                  f"document")
    bad = next((t for t in queries + docs if not isinstance(t, str) or not t), None)
    if bad is not None:
        raise InvalidRequestError(f"queries and documents must be non-empty strings, not {bad!r}"[:200])
    return queries, docs

