"""Poolers of embedding and scoring pipelines (core/interfaces/pooling.py): ``last``,
``mean`` and ``cls`` embed; ``classify`` (a sequence-classification head: cross-encoders) and
``yes-no`` (a decoder reranker's yes/no token, Qwen3-Reranker's) score (query, document)
pairs. common.py holds what the embedding poolers share."""
