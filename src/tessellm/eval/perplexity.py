"""Perplexity of a text under a pipeline, with a sliding window.

The text is tokenized once and scored in windows of ``window`` tokens whose starts are
``stride`` apart (the ends; the last window ends at the text's end). Each window is one teacher-forced prefill through the whole pipeline
(``Engine.score``: its quantizer, attention backend and cache), and it counts only the
tokens the previous window did not, so every token after the first is predicted once, with
between ``window - stride`` and ``window - 1`` tokens of context (all of them near the
start). Perplexity is exp of the mean negative log-likelihood, summed in float64.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from tessellm.core.engine.llm import LLM
from tessellm.core.errors import ConfigError


@dataclass
class PerplexityResult:
    """What ``perplexity`` measured; ``as_dict`` is the ``--json`` object."""

    perplexity: float
    nll_per_token: float
    tokens_scored: int
    text_tokens: int
    window: int
    stride: int
    text: str
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def window_spans(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) of each window over ``num_tokens`` tokens: the window scores
    ``[begin, end)`` and counts the predictions of tokens ``first_scored .. end - 1``. The
    first window counts tokens 1 to window - 1, each later one the next ``stride`` tokens (at
    most window - 1) with as much context before them as the window holds, so every token
    from 1 on is counted once and each has at least ``window - stride`` tokens before it in
    its window (or all of them, near the start)."""
    step = min(stride, window - 1)
    spans, first = [], 1  # token 0 has nothing before it to be predicted from
    end = min(window, num_tokens)
    while first < num_tokens:
        spans.append((max(0, end - window), end, first))
        first, end = end, min(end + step, num_tokens)
    return spans


def sequence_nll(llm: LLM, token_ids: list[int], first_scored: int) -> tuple[float, int]:
    """(summed negative log-likelihood, count) of tokens ``first_scored ..`` of token_ids, each
    predicted from the tokens before it in one teacher-forced prefill."""
    logits = llm.engine.score(token_ids)
    logprobs = logits[first_scored - 1:-1].double().log_softmax(-1)
    targets = torch.tensor(token_ids[first_scored:], device=logprobs.device)
    return -logprobs.gather(1, targets[:, None]).sum().item(), len(targets)


def perplexity(llm: LLM, text: str, *, window: int | None = None, stride: int | None = None,
               max_tokens: int | None = None, label: str = "", progress: bool = False) -> PerplexityResult:
    """Sliding-window perplexity of ``text``. ``window`` defaults to the pipeline's context
    (max_model_len, at most 1024) and ``stride`` to half the window; ``max_tokens`` scores only
    the text's first tokens."""
    limit = llm.engine.max_model_len
    window = min(limit, 1024) if window is None else window
    stride = max(window // 2, 1) if stride is None else stride
    if not 2 <= window <= limit:
        raise ConfigError(f"--window must be in 2..{limit} (the pipeline's max_model_len), got {window}")
    if not 1 <= stride <= window:
        raise ConfigError(f"--stride must be in 1..{window} (the window), got {stride}")
    ids = llm.tokenizer(text)["input_ids"]
    if max_tokens is not None:
        if max_tokens < 2:
            raise ConfigError(f"--max-tokens must be at least 2, got {max_tokens}")
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ConfigError(f"the text has {len(ids)} token(s); perplexity needs at least 2")
    start = time.perf_counter()
    total, count = 0.0, 0
    for begin, end, first in tqdm(window_spans(len(ids), window, stride), desc="perplexity", unit="window",
                                  disable=not progress, leave=False):
        nll, n = sequence_nll(llm, ids[begin:end], first - begin)
        total, count = total + nll, count + n
    mean = total / count
    return PerplexityResult(math.exp(mean), mean, count, len(ids), window, stride, label,
                            time.perf_counter() - start)
