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


class LogitsProcessorRequest(BaseModel):
    """One logits-processor plugin a request turns on: its name and its arguments (validated
    by the plugin's ``Args``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data


class SamplingParams(BaseModel):
    """How one request is decoded. Temperature 0 means greedy.

    A sampler applies the filters in this order (the conformance suite's target distribution
    and the ``sample`` decoder follow it): temperature scales the logits; ``top_k`` keeps the
    k most likely tokens; ``top_p``, on the distribution top-k left (renormalised), keeps the
    most likely tokens until their mass reaches top_p; ``min_p`` keeps, of those, the tokens
    at least min_p times as likely as the most likely token after temperature. The token is
    drawn from what is left, in proportion to its probability after temperature.
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_tokens: int = Field(16, gt=0, le=1_000_000)
    """Most tokens to generate."""
    min_tokens: int = Field(0, ge=0, le=1_000_000)
    """Fewest tokens to generate before EOS, a stop token id or a stop string may end the
    output (EOS and the stop ids cannot be picked before then)."""
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    """Softmax temperature, applied first: the logits are divided by it before any filter;
    0 picks the most likely token."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Applied after top_k, on the distribution top_k left (renormalised): keep the smallest
    set of most likely tokens whose probability mass reaches top_p (the token that reaches
    it stays; the most likely token always stays); 1 keeps all."""
    top_k: int = Field(0, ge=0)
    """Applied after temperature, before top_p: keep the top_k most likely tokens; 0 keeps
    all, 1 is greedy."""
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    """Applied last, to what top_k and top_p kept: keep only tokens at least min_p times as
    likely as the most likely one (probabilities after temperature, before any filter; the
    most likely token always stays); 0 keeps all."""
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
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """OpenAI's: subtracted from the logit of every token the output holds so far (positive
    values steer away from repeating a token at all); 0 leaves the logits alone."""
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """OpenAI's: subtracted from a token's logit once per time the output holds it so far
    (positive values steer away from repeating a token often); 0 leaves the logits alone."""
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    """transformers' and vLLM's: every token of the prompt or the output so far has its logit
    divided by this where positive and multiplied by it where negative (above 1 steers away
    from repeating); 1 leaves the logits alone."""
    bad_words: list[str] = Field(default_factory=list)
    """vLLM's: words the output may not contain. Each is tokenized as it stands and with a
    leading space; a token that would complete one of those token sequences is banned
    (a one-token word is never picked)."""
    bad_words_ids: list[list[int]] = Field(default_factory=list)
    """transformers' form of ``bad_words``: token-id sequences the output may not complete."""
    allowed_token_ids: Optional[list[int]] = None
    """vLLM's: the only token ids the output may hold (None: any)."""
    no_repeat_ngram_size: int = Field(0, ge=0, le=1024)
    """transformers': no n-gram of this size may occur twice in the prompt and output (a
    token that would complete one is banned); 0 turns it off."""
    logits_processors: list[LogitsProcessorRequest] = Field(default_factory=list)
    """Logits-processor plugins beyond the fields above, each by name with its arguments
    (``{"name": "my-processor", "args": {...}}``, or the bare name for one without
    arguments), applied in the order the plugins declare. The plugin validates its arguments
    when the request arrives; an unknown name is refused, naming the installed ones."""
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

    @field_validator("bad_words_ids")
    @classmethod
    def _words_not_empty(cls, value: list[list[int]]) -> list[list[int]]:
        bad = [w for w in value if not w or min(w) < 0]
        if bad:
            raise ValueError(f"bad_words_ids holds token-id sequences, each non-empty, ids 0 or more; got {bad[0]}")
        return value

    @field_validator("allowed_token_ids")
    @classmethod
    def _some_allowed(cls, value: Optional[list[int]]) -> Optional[list[int]]:
        if value is not None and (not value or min(value) < 0):
            raise ValueError("allowed_token_ids lists token ids (0 or more), at least one; leave it out (None) "
                             "to allow every token")
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

    Every plugin may read every attribute. The engine owns them all but two, which a
    scheduler writes: ``status`` and ``num_computed_tokens``; a decoder draws from
    ``generator``. Each attribute's docstring says who writes it; nothing else may.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 *, priority: int = 0, arrival_time: float | None = None, sample_index: int = 0,
                 cache_salt: str | None = None):
        self.seq_id = next(_seq_ids)
        """Read only. Unique in the process; caches and decoders key their per-sequence state
        by it (samples of one request have different ids)."""
        self.request_id = request_id
        """Read only. The request's id, shared by its ``n`` samples."""
        self.token_ids = list(prompt_token_ids)
        """Read only. The prompt's token ids, then the generated ones that have reached the host
        (the engine appends each accepted token)."""
        self.num_prompt_tokens = len(prompt_token_ids)
        """Read only. How many of ``token_ids`` are the prompt."""
        self.params = params
        """Read only. The request's ``SamplingParams``."""
        self.priority = priority
        """Read only. The request's priority (lower runs first under a priority scheduler; 0 by
        default)."""
        self.sample_index = sample_index
        """Read only. Which of the request's ``n`` samples this is (0 for the first)."""
        self.cache_salt = cache_salt
        """Read only. A prefix cache may share blocks only between sequences with the same salt
        (None is a salt of its own)."""
        self.num_computed_tokens = 0
        """The scheduler writes it: the result of ``cache.match_prefix`` for a sequence with
        nothing computed, and 0 when it preempts the sequence or cannot start it after a
        match; the engine advances it after each step. The leading tokens whose K/V are in
        the cache."""
        self.status = SequenceStatus.WAITING
        """The scheduler writes it: RUNNING when it starts the sequence, WAITING when it puts
        it back in the queue; the engine sets FINISHED."""
        self.finish_reason: FinishReason | None = None
        """Read only. Why the engine finished the sequence (None while it runs)."""
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        """Read only. When the request arrived (``time.perf_counter()``)."""
        self.first_token_time: float | None = None
        """Read only. When the engine produced the first output token (None before)."""
        self.finish_time: float | None = None
        """Read only. When the engine finished the sequence (None before)."""
        self.generator: torch.Generator | None = None
        """A decoder draws from it (which advances it) and never replaces it; the engine sets
        it. The sequence's own random generator, seeded from ``params.seed`` (or the config's
        seed and a counter): drawing from it keeps a seeded request's tokens independent of
        the rest of the batch."""
        self.stop_text_len: int | None = None
        """Read only. Where a stop string cut the output text (None: no cut)."""
        self.logprobs: list[TokenLogprob] = []
        """Read only. One ``TokenLogprob`` per output token when ``params.logprobs`` is set,
        filled by the engine."""
        self.prompt_logprobs: list[TokenLogprob | None] = []
        """Read only. One per prompt token when ``params.prompt_logprobs`` is set, filled as the
        prefill runs (None for the first token, which nothing predicts)."""
        self.num_cached_tokens: int | None = None
        """Read only. Prompt tokens the prefix cache held when the sequence first ran (set by
        the engine)."""
        self.num_pending = 0
        """Read only. Tokens sampled on the device whose values have not reached the host yet
        (async scheduling): counted in ``num_tokens``, absent from ``token_ids``."""
        self.lora: str | None = None
        """Read only. The LoRA adapter the request runs under (None: the base model); the
        engine sets it and folds the adapter into ``cache_salt``, so a prefix cache never
        shares K/V computed under one adapter with another."""
        self.lora_slot = -1
        """Read only. The device slot holding ``lora``'s weights while the sequence lives (-1:
        none); the engine sets it at admission."""
        self.group_size = 1
        """Read only. How many sequences its request runs as once the prompt is done: ``n``, or
        a beam search's ``num_beams`` (plugin API 1.12): the seats a scheduler counts for it."""
        self.joint = False
        """Read only. Its request's sequences step together (beam search, plugin API 1.12): a
        scheduler preempts them as one (the engine runs their sampling step only when all of
        them reach it)."""
        self.score: float | None = None
        """Read only. For a beam-search result: its score (the sum of its tokens' log-
        probabilities over its length to the power ``length_penalty``); None otherwise."""
        self.multimodal: Any = None
        """Read only. The prompt's images (a ``MultimodalPrompt``, plugin API 1.19; None for a
        text prompt); the engine sets it at admission and attaches the images' embeddings to
        it while a step needs them. A prefix cache folds ``images_key(seq.images, start,
        end)`` into the key of each block the images overlap; a scheduler cuts prefill chunks
        with ``cut_chunk``."""

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens that have reached the host: ``token_ids`` after the prompt."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        """The sequence's length, tokens still on the device included."""
        return len(self.token_ids) + self.num_pending

    @property
    def images(self) -> tuple:
        """The prompt's images in prompt order (``ImageInput``s; empty for a text prompt)."""
        return self.multimodal.images if self.multimodal is not None else ()

    @property
    def num_output_tokens(self) -> int:
        """How many generated tokens have reached the host."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        """Whether ``status`` is FINISHED."""
        return self.status is SequenceStatus.FINISHED

    def fork(self, sample_index: int) -> "Sequence":
        """A copy sharing this sequence's tokens so far (parallel sampling)."""
        child = Sequence(self.request_id, self.token_ids[: self.num_prompt_tokens], self.params,
                         priority=self.priority, arrival_time=self.arrival_time,
                         sample_index=sample_index, cache_salt=self.cache_salt)
        child.token_ids = list(self.token_ids)
        child.lora, child.lora_slot = self.lora, self.lora_slot
        child.multimodal = self.multimodal
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")


def cut_chunk(seq: Any, start: int, num_tokens: int) -> int:
    """How many of ``num_tokens`` query tokens from position ``start`` a prefill chunk of
    ``seq`` may take (plugin API 1.19): all of them, unless the chunk would end inside an
    image whose tokens must be computed together (a model whose images attend within
    themselves in both directions, Gemma 3's); then up to that image's start, or 0 when the
    chunk starts at (or inside) such an image and cannot reach its end. A scheduler that
    splits prompts asks this for every chunk shorter than what is left to compute."""
    mm = getattr(seq, "multimodal", None)
    if mm is None or not mm.whole_images:
        return num_tokens
    end = start + num_tokens
    for image in mm.images:
        if image.offset < end < image.end:  # the chunk would end inside this image
            return image.offset - start if image.offset > start else 0
    return num_tokens
