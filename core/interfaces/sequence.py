"""Requests as the engine tracks them: sampling parameters and sequences."""

from __future__ import annotations

import enum
import itertools
import time
from typing import Any, NamedTuple, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from tessellm.core.interfaces.grammar import GrammarSpec
from tessellm.core.plugin import reject_booleans_for_numbers


class SamplingParams(BaseModel):
    """How one request is decoded. Temperature 0 means greedy."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_tokens: int = Field(16, gt=0, le=1_000_000)
    """Most tokens to generate."""
    min_tokens: int = Field(0, ge=0, le=1_000_000)
    """Fewest tokens to generate before EOS, a stop token id or a stop string may end the
    output (EOS and the stop ids cannot be picked before then)."""
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    """Softmax temperature; 0 picks the most likely token."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Keep the smallest set of tokens whose probability mass reaches top_p."""
    top_k: int = Field(0, ge=0)
    """Keep the top_k most likely tokens; 0 keeps all."""
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    """Keep only tokens at least min_p times as likely as the most likely one (after the
    temperature); 0 keeps all."""
    seed: Optional[int] = Field(None, ge=0)
    """Seed of this request's own generator: the same seed gives the same tokens."""
    n: int = Field(1, ge=1, le=64)
    """Number of samples from one prompt (forked after the prompt)."""
    stop: list[str] = Field(default_factory=list)
    """Strings that end generation; they are not included in the text."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Token ids that end generation, besides the tokenizer's EOS."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    """Record each generated token's log-probability and this many most likely alternatives
    (the model's own distribution, before temperature and filtering); None records nothing."""
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=20)
    """Record each prompt token's log-probability given the tokens before it (the first
    token has none) and this many most likely alternatives, from the forward that prefills
    the prompt; None records nothing. Such a request reads nothing from the prefix cache
    (every prompt position must run through the model), though what it computes is indexed
    for others."""
    structured_output: Optional[GrammarSpec] = None
    """Constrain the output to a grammar (a JSON schema, a regex, a choice, an EBNF grammar):
    the pipeline's grammar backend masks every token the grammar does not allow, for every
    decoder; the output ends when the grammar is complete. None: unconstrained."""
    logit_bias: dict[int, float] = Field(default_factory=dict)
    """Added to the logits of these token ids before the decoder picks (OpenAI's logit_bias:
    -100 bans a token, 100 all but forces it); values in [-100, 100]. Log-probabilities stay
    the model's own."""
    extra_args: dict[str, Any] = Field(default_factory=dict)
    """Settings for the decoding plugin beyond the fields above (a new sampler's own knobs).
    The plugin declares them as its ``RequestArgs`` model, which validates them when the
    request arrives; a decoder that declares none refuses any. Over the OpenAI API they come
    as ``extra_args`` in the request body (the openai library's ``extra_body``)."""
    _request_args: Any = PrivateAttr(default=None)  # extra_args validated by the decoder
    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        return reject_booleans_for_numbers(cls, data)

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float]) -> dict[int, float]:
        bad = [(t, b) for t, b in value.items() if t < 0 or not -100.0 <= b <= 100.0]
        if bad:
            raise ValueError(f"logit_bias maps token ids (0 or more) to values in [-100, 100]; got {bad[0][0]}: "
                             f"{bad[0][1]}")
        return value

    @model_validator(mode="after")
    def _min_within_max(self):
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) is above max_tokens ({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        """Whether the request's tokens are each step's most likely one (temperature 0 or
        top_k 1): a decoder may take the argmax without drawing."""
        return self.temperature == 0.0 or self.top_k == 1


class TokenLogprob(NamedTuple):
    """A generated token's log-probability and the ``top`` most likely tokens' (id, logprob)."""

    logprob: float
    top: list[tuple[int, float]]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_seq_ids = itertools.count()


class Sequence:
    """One stream of tokens: a prompt and what has been generated after it.

    ``num_computed_tokens`` counts the leading tokens whose KV is in the cache; the tokens
    after it are what the next forward must process (a prompt chunk, or the one token
    sampled last). A speculative step may compute more and roll back.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 *, priority: int = 0, arrival_time: float | None = None, sample_index: int = 0,
                 cache_salt: str | None = None):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.sample_index = sample_index
        self.cache_salt = cache_salt
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.generator: torch.Generator | None = None  # set by the engine for sampling
        self.stop_text_len: int | None = None  # where a stop string cut the text
        self.logprobs: list[TokenLogprob] = []  # one per output token when params.logprobs is set
        self.prompt_logprobs: list[TokenLogprob | None] = []
        """One per prompt token when ``params.prompt_logprobs`` is set, filled as the prefill
        runs (None for the first token, which nothing predicts)."""
        self.num_cached_tokens: int | None = None
        """Prompt tokens the prefix cache held when the sequence first ran (set by the engine)."""
        self.num_pending = 0
        """Tokens sampled on the device whose values have not reached the host yet (async
        scheduling): counted in ``num_tokens``, absent from ``token_ids``."""

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        """The sequence's length, tokens still on the device included."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, sample_index: int) -> "Sequence":
        """A copy sharing this sequence's tokens so far (parallel sampling)."""
        child = Sequence(self.request_id, self.token_ids[: self.num_prompt_tokens], self.params,
                         priority=self.priority, arrival_time=self.arrival_time,
                         sample_index=sample_index, cache_salt=self.cache_salt)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")
