"""Benchmark workloads: deterministic lists of token-id requests with their output lengths.

A workload is a name (``mixed``, ``shared-prefix``, ``scoring``, ``multi-turn``) or a ``.jsonl`` file, plus parameters
with defaults that ``--workload-set KEY=VALUE`` overrides. ``Workload.requests(seed, ...)``
draws the requests; the same seed always gives the same requests. Every request decodes
greedily with ``ignore_eos`` so it generates exactly ``output_len`` tokens (as vLLM's
benchmark does): throughput then depends on the engine, not on where the model stops. A
JSONL line may set ``"ignore_eos": false`` to stop at the end of the answer instead (real
prompts measured for speculative decoding, where text past the answer would be unnatural).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tessellm.core.errors import ConfigError, InvalidRequestError
from tessellm.core.interfaces.sequence import SamplingParams


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt as token ids and how many tokens it generates (exactly, unless
    ``ignore_eos`` is off: then at most)."""

    request_id: str
    prompt_token_ids: list[int]
    output_len: int
    ignore_eos: bool = True
    lora: str | None = None
    """The LoRA adapter the request runs under (None: the base model)."""
    turn: int = 0
    """Requests run turn by turn: every request of turn t is submitted once all of turn t - 1
    have finished (a multi-turn conversation's next message follows its last answer)."""

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.output_len, temperature=0.0, ignore_eos=self.ignore_eos)


class WorkloadParams(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    ranges: ClassVar[tuple[str, ...]] = ()
    """Prefixes of the ``<prefix>_min`` / ``<prefix>_max`` pairs that bound a drawn length."""

    @model_validator(mode="after")
    def _bounds(self) -> "WorkloadParams":
        for what in self.ranges:
            lo, hi = getattr(self, f"{what}_min"), getattr(self, f"{what}_max")
            if lo > hi:
                raise ValueError(f"{what}_min ({lo}) is above {what}_max ({hi})")
        return self


class MixedParams(WorkloadParams):
    """ShareGPT-like: log-normal prompt and output lengths, a few requests far above the median."""

    prompt_median: int = Field(100, ge=1)
    """Median prompt length in tokens."""
    prompt_sigma: float = Field(1.0, ge=0.0, le=4.0)
    """Spread of log(prompt length); 1.0 puts the 99th percentile about 10x above the median."""
    prompt_min: int = Field(8, ge=1)
    prompt_max: int = Field(1024, ge=1)
    output_median: int = Field(64, ge=1)
    """Median output length in tokens."""
    output_sigma: float = Field(0.8, ge=0.0, le=4.0)
    output_min: int = Field(8, ge=1)
    output_max: int = Field(512, ge=1)

    ranges = ("prompt", "output")


class SharedPrefixParams(WorkloadParams):
    """Requests of ``num_groups`` groups, interleaved; a group's requests share its system prompt."""

    num_groups: int = Field(1, ge=1, le=100_000)
    """Distinct system prompts."""
    prefix_len: int = Field(1024, ge=1)
    """Tokens of each system prompt."""
    question_len: int = Field(32, ge=1)
    """Typical tokens of the unique question after the system prompt."""
    question_spread: int = Field(8, ge=0)
    """Question lengths are uniform in question_len +- question_spread (at least 1)."""
    output_len: int = Field(32, ge=1)
    """Tokens generated per request."""


class ScoringParams(WorkloadParams):
    """Log-likelihood scoring as lm-evaluation-harness sends it: every request is a few-shot
    prompt (the same ``shots`` examples first), then a question and one of its ``choices``
    candidate answers, and asks for one token (max_tokens 1): the prefill is the work."""

    shots: int = Field(5, ge=0)
    """Few-shot examples every prompt starts with."""
    shot_len: int = Field(120, ge=1)
    """Tokens per example."""
    question_len: int = Field(40, ge=1)
    """Tokens of each question (shared by its choices)."""
    choices: int = Field(4, ge=1)
    """Candidate answers per question: consecutive requests, one per choice."""
    choice_len: int = Field(6, ge=1)
    """Tokens of each candidate answer."""


class MultiTurnParams(WorkloadParams):
    """Chat conversations replayed turn by turn: each turn's prompt is the conversation so far
    (its system prompt, then every earlier user message and recorded reply) and a new user
    message, so it starts with the whole previous prompt. Requests are conversations x turns
    (``--num-requests`` over ``turns``, rounded down, at least one conversation)."""

    turns: int = Field(4, ge=1, le=1000)
    """Messages per conversation."""
    system_len: int = Field(512, ge=1)
    """Tokens of each conversation's system prompt (every conversation has its own)."""
    user_len: int = Field(64, ge=1)
    """Tokens of each user message."""
    reply_len: int = Field(128, ge=0)
    """Tokens of each recorded assistant reply in the history."""
    output_len: int = Field(32, ge=1)
    """Tokens generated per turn."""


class JsonlParams(WorkloadParams):
    """Requests read from a file, one JSON object per line."""

    max_tokens: int = Field(128, ge=1)
    """Output length of a line that gives no ``max_tokens``."""


SYNTHETIC: dict[str, type[WorkloadParams]] = {"mixed": MixedParams, "shared-prefix": SharedPrefixParams,
                                              "scoring": ScoringParams, "multi-turn": MultiTurnParams}
DEFAULT_NUM_REQUESTS = 100
JSONL_KEYS = ("prompt", "prompt_token_ids", "max_tokens", "chat", "ignore_eos")


def plain_token_ids(tokenizer: Any, vocab_size: int | None = None) -> np.ndarray:
    """Token ids a random prompt may use: the tokenizer's vocabulary without special or added
    tokens (chat markers, EOS), so random prompts stay ordinary text to the model."""
    size = min(len(tokenizer), vocab_size or len(tokenizer))
    special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    ids = np.setdiff1d(np.arange(size), np.fromiter(special, dtype=np.int64, count=len(special)))
    if ids.size == 0:
        raise ConfigError("the tokenizer has no ordinary tokens to draw random prompts from")
    return ids


def _parse_overrides(items: list[str] | dict[str, Any]) -> dict[str, Any]:
    if isinstance(items, dict):
        return dict(items)
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--workload-set {item!r}: expected KEY=VALUE, e.g. prefix_len=512")
        out[key.strip()] = value.strip()
    return out


@dataclass
class Workload:
    """A workload with validated parameters; ``requests`` draws its requests."""

    name: str
    params: WorkloadParams
    path: Path | None = None

    def describe(self, seed: int, num_requests: int) -> dict[str, Any]:
        return {"name": self.name, "path": None if self.path is None else str(self.path),
                "params": self.params.model_dump(), "seed": seed, "num_requests": num_requests}

    def requests(self, *, seed: int, num_requests: int | None, tokenizer: Any, max_model_len: int,
                 vocab_size: int | None = None,
                 encode: Callable[..., list[int]] | None = None) -> list[BenchRequest]:
        """Draw the requests. Each fits ``max_model_len`` (prompt + output); ``vocab_size`` bounds
        token ids (default: the tokenizer's); ``encode(text, chat=...)`` tokenizes JSONL text
        prompts (default: ``LLM.encode``'s rules on ``tokenizer``). ``num_requests`` None: the
        workload's default (every line of a file)."""
        if num_requests is not None and num_requests < 1:
            raise ConfigError(f"num_requests must be at least 1, got {num_requests}")
        if seed < 0:
            raise ConfigError(f"the workload seed must be 0 or more, got {seed}")
        vocab_size = vocab_size or len(tokenizer)
        if self.path is not None:
            if encode is None:
                from tessellm.core.engine.llm import LLM

                # LLM.encode reads only .tokenizer: reuse its rules (chat template, special tokens)
                encode = lambda text, chat=False: LLM.encode(SimpleNamespace(tokenizer=tokenizer), text, chat=chat)  # noqa: E731
            return _read_jsonl(self.path, self.params, num_requests, encode, vocab_size, max_model_len)
        rng = np.random.default_rng(seed)
        ids = plain_token_ids(tokenizer, vocab_size)
        n = num_requests or DEFAULT_NUM_REQUESTS
        if isinstance(self.params, MixedParams):
            return _mixed(self.params, rng, ids, n, max_model_len)
        if isinstance(self.params, ScoringParams):
            return _scoring(self.params, rng, ids, n, max_model_len)
        if isinstance(self.params, MultiTurnParams):
            return _multi_turn(self.params, rng, ids, n, max_model_len)
        return _shared_prefix(self.params, rng, ids, n, max_model_len)


def get_workload(name_or_path: str | Path, overrides: list[str] | dict[str, Any] = ()) -> Workload:
    """The workload named (``mixed``, ``shared-prefix``) or read from a ``.jsonl`` file, with its
    parameters overridden; raises ConfigError on an unknown name, file or parameter."""
    name = str(name_or_path)
    if name in SYNTHETIC:
        params_cls: type[WorkloadParams] = SYNTHETIC[name]
        path = None
    elif name.endswith(".jsonl"):
        params_cls, path = JsonlParams, Path(name)
        if not path.is_file():
            raise ConfigError(f"workload file {name!r} does not exist")
    else:
        raise ConfigError(f"unknown workload {name!r}; allowed: {', '.join(SYNTHETIC)} or a PATH.jsonl file")
    return Workload(Path(name).name if path else name, workload_params(name, params_cls, overrides), path)


def workload_params(name: str, params_cls: type[WorkloadParams],
                    overrides: list[str] | dict[str, Any] = ()) -> WorkloadParams:
    """``params_cls`` with ``overrides`` (``KEY=VALUE`` strings or a dict) applied; raises
    ConfigError naming workload ``name``'s unknown or invalid parameter."""
    values = _parse_overrides(list(overrides) if not isinstance(overrides, dict) else overrides)
    unknown = sorted(set(values) - set(params_cls.model_fields))
    if unknown:
        raise ConfigError(f"workload {name!r} has no parameter {unknown[0]!r}; allowed: "
                          f"{', '.join(params_cls.model_fields)}")
    try:
        return params_cls.model_validate(values)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in e['loc']) or 'workload'}: {e['msg']}"
                    + (f" (got {e['input']!r})" if e["loc"] else "") for e in exc.errors()]
        raise ConfigError(f"workload {name!r}: " + "; ".join(problems)) from None


def make_workload(name_or_path: str | Path, *, seed: int = 0, num_requests: int | None = None, tokenizer: Any,
                  max_model_len: int, vocab_size: int | None = None,
                  encode: Callable[..., list[int]] | None = None, **overrides: Any) -> list[BenchRequest]:
    """``get_workload(name_or_path, overrides).requests(...)`` in one call."""
    return get_workload(name_or_path, overrides).requests(seed=seed, num_requests=num_requests, tokenizer=tokenizer,
                                                          max_model_len=max_model_len, vocab_size=vocab_size,
                                                          encode=encode)


# ----------------------------------------------------------------------------- the generators


def lognormal_lengths(rng: np.random.Generator, median: int, sigma: float, n: int, lo: int, hi: int) -> np.ndarray:
    """``n`` integer lengths, log-normal about ``median`` (``sigma``: the spread of their log),
    clipped to [lo, hi]."""
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(np.int64)


def _mixed(p: MixedParams, rng: np.random.Generator, ids: np.ndarray, n: int, max_model_len: int) -> list[BenchRequest]:
    if p.prompt_min + p.output_min > max_model_len:
        raise ConfigError(f"mixed: prompt_min ({p.prompt_min}) + output_min ({p.output_min}) exceed "
                          f"max_model_len ({max_model_len}); lower them with --workload-set")
    prompt_lens = lognormal_lengths(rng, p.prompt_median, p.prompt_sigma, n, p.prompt_min,
                                    min(p.prompt_max, max_model_len - p.output_min))
    output_lens = lognormal_lengths(rng, p.output_median, p.output_sigma, n, p.output_min, p.output_max)
    output_lens = np.minimum(output_lens, max_model_len - prompt_lens)  # the context window bounds both
    return [BenchRequest(f"mixed-{i}", ids[rng.integers(0, ids.size, int(plen))].tolist(), int(olen))
            for i, (plen, olen) in enumerate(zip(prompt_lens, output_lens))]


def _shared_prefix(p: SharedPrefixParams, rng: np.random.Generator, ids: np.ndarray, n: int,
                   max_model_len: int) -> list[BenchRequest]:
    q_lo, q_hi = max(1, p.question_len - p.question_spread), p.question_len + p.question_spread
    need = p.prefix_len + q_hi + p.output_len
    if need > max_model_len:
        raise ConfigError(f"shared-prefix: prefix_len ({p.prefix_len}) + question up to {q_hi} + output_len "
                          f"({p.output_len}) = {need} tokens exceed max_model_len ({max_model_len}); lower "
                          f"them with --workload-set, e.g. prefix_len={max(1, max_model_len - q_hi - p.output_len)}")
    if p.num_groups + n > ids.size:
        raise ConfigError(f"shared-prefix: {p.num_groups} groups + {n} requests need more distinct tokens "
                          f"than the vocabulary's {ids.size}")
    # Distinct first tokens: different groups share nothing, and a question never extends the
    # system prompt by chance, so each request shares exactly prefix_len tokens with its group.
    firsts = rng.choice(ids, p.num_groups + n, replace=False)
    prefixes = [[int(firsts[g])] + ids[rng.integers(0, ids.size, p.prefix_len - 1)].tolist()
                for g in range(p.num_groups)]
    out = []
    for i in range(n):
        qlen = int(rng.integers(q_lo, q_hi + 1))
        question = [int(firsts[p.num_groups + i])] + ids[rng.integers(0, ids.size, qlen - 1)].tolist()
        out.append(BenchRequest(f"shared-prefix-{i}", prefixes[i % p.num_groups] + question, p.output_len))
    return out


def _scoring(p: ScoringParams, rng: np.random.Generator, ids: np.ndarray, n: int,
             max_model_len: int) -> list[BenchRequest]:
    need = p.shots * p.shot_len + p.question_len + p.choice_len + 1
    if need > max_model_len:
        raise ConfigError(f"scoring: {p.shots} shots x {p.shot_len} + question_len ({p.question_len}) + choice_len "
                          f"({p.choice_len}) + 1 = {need} tokens exceed max_model_len ({max_model_len}); lower "
                          f"them with --workload-set")
    shots = ids[rng.integers(0, ids.size, p.shots * p.shot_len)].tolist()
    out, question = [], []
    for i in range(n):
        if i % p.choices == 0:
            question = ids[rng.integers(0, ids.size, p.question_len)].tolist()
        choice = ids[rng.integers(0, ids.size, p.choice_len)].tolist()
        out.append(BenchRequest(f"scoring-{i}", shots + question + choice, 1))
    return out


def _multi_turn(p: MultiTurnParams, rng: np.random.Generator, ids: np.ndarray, n: int,
                max_model_len: int) -> list[BenchRequest]:
    need = p.system_len + p.turns * p.user_len + (p.turns - 1) * p.reply_len + p.output_len
    if need > max_model_len:
        raise ConfigError(f"multi-turn: system_len ({p.system_len}) + {p.turns} turns x user_len ({p.user_len}) + "
                          f"{p.turns - 1} x reply_len ({p.reply_len}) + output_len ({p.output_len}) = {need} tokens "
                          f"exceed max_model_len ({max_model_len}); lower them with --workload-set")
    conversations = max(1, n // p.turns)
    if conversations > ids.size:
        raise ConfigError(f"multi-turn: {conversations} conversations need more distinct tokens than the "
                          f"vocabulary's {ids.size}")
    firsts = rng.choice(ids, conversations, replace=False)  # conversations share no prefix
    out = []
    for c in range(conversations):
        history = [int(firsts[c])] + ids[rng.integers(0, ids.size, p.system_len - 1)].tolist()
        for t in range(p.turns):
            history += ids[rng.integers(0, ids.size, p.user_len)].tolist()
            out.append(BenchRequest(f"multi-turn-{c}-{t}", list(history), p.output_len, turn=t))
            history += ids[rng.integers(0, ids.size, p.reply_len)].tolist()
    return out


def _read_jsonl(path: Path, p: JsonlParams, num_requests: int | None, encode: Callable[..., list[int]],
                vocab_size: int, max_model_len: int) -> list[BenchRequest]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read workload file {str(path)!r}: {exc}") from None
    out: list[BenchRequest] = []
    for lineno, line in enumerate(lines, 1):
        if num_requests is not None and len(out) == num_requests:
            break
        if not line.strip():
            continue
        where = f"workload file {str(path)!r} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        try:
            out.append(_jsonl_request(obj, f"{path.name}:{lineno}", p, encode, vocab_size, max_model_len))
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{where}: {exc}") from None
    if not out:
        raise InvalidRequestError(f"workload file {str(path)!r} holds no requests")
    if num_requests is not None and len(out) < num_requests:
        raise InvalidRequestError(f"workload file {str(path)!r} holds {len(out)} requests, fewer than the "
                                  f"{num_requests} asked for; lower --num-requests")
    return out


def _jsonl_request(obj: Any, request_id: str, p: JsonlParams, encode: Callable[..., list[int]], vocab_size: int,
                   max_model_len: int) -> BenchRequest:
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(JSONL_KEYS))
    if unknown:
        raise InvalidRequestError(f"unknown key {unknown[0]!r}; allowed: {', '.join(JSONL_KEYS)}")
    if ("prompt" in obj) == ("prompt_token_ids" in obj):
        raise InvalidRequestError("give exactly one of 'prompt' (text) and 'prompt_token_ids'")
    chat, ignore_eos = obj.get("chat", False), obj.get("ignore_eos", True)
    for key, value in (("chat", chat), ("ignore_eos", ignore_eos)):
        if not isinstance(value, bool):
            raise InvalidRequestError(f"'{key}' must be true or false, got {value!r}")
    max_tokens = obj.get("max_tokens", p.max_tokens)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidRequestError(f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise InvalidRequestError(f"'prompt' must be a non-empty string, got {obj['prompt']!r}")
        tokens = list(encode(obj["prompt"], chat=chat))
    else:
        tokens = obj["prompt_token_ids"]
        if chat:
            raise InvalidRequestError("'chat' applies to a text 'prompt', not to 'prompt_token_ids'")
        if not isinstance(tokens, list) or not tokens:
            raise InvalidRequestError("'prompt_token_ids' must be a non-empty list of token ids")
        bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"'prompt_token_ids' holds {bad[0]!r}, not a token id in [0, {vocab_size})")
    if len(tokens) + max_tokens > max_model_len:
        raise InvalidRequestError(f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceed "
                                  f"max_model_len ({max_model_len})")
    return BenchRequest(request_id, tokens, max_tokens, ignore_eos)
