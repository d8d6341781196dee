"""Passkey retrieval: can the pipeline find a number hidden in a long, dull context?

Each trial hides a random five-digit key in filler text at a depth from the start (spread
evenly over the trials from 0 to 1), pads the prompt to about ``context`` tokens and asks for
the key at the end; the trial passes when the greedy answer contains the key. The filler says
nothing about the key, so a model that cannot attend to the key's position has to guess. Long
context at a fixed token budget is what sparse attention (QUEST) must survive.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field

from tessellm.core.engine.llm import LLM
from tessellm.core.errors import ConfigError

FILLER = ("The river runs past the old mill.", "The baker opens her shop at dawn.",
          "Sparrows gather on the warm roof.", "The bell in the square rings at noon.",
          "The market closes at six.")
INTRO = "There is a pass key hidden in the following text. Find it and remember it.\n\n"
NEEDLE = "The pass key is {key}. Remember it: {key} is the pass key."
QUESTION = "\n\nWhat is the pass key? The pass key is"


@dataclass
class PasskeyTrial:
    """One trial: where the key sat (0: start of the filler, 1: its end) and what came back."""

    depth: float
    key: str
    answer: str
    correct: bool


@dataclass
class PasskeyResult:
    """What ``passkey`` measured; ``as_dict`` is the ``--json`` object."""

    accuracy: float
    context: int
    prompt_tokens: int
    trials: list[PasskeyTrial] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def passkey_prompt(llm: LLM, key: str, depth: float, context: int) -> list[int]:
    """Token ids of a prompt of at most ``context`` tokens (and close to it) with ``key`` after
    ``depth`` of its filler sentences."""
    def build(count: int) -> list[int]:
        body = [FILLER[i % len(FILLER)] for i in range(count)]
        before = round(count * depth)
        text = INTRO + " ".join(body[:before] + [NEEDLE.format(key=key)] + body[before:]) + QUESTION
        return llm.tokenizer(text)["input_ids"]

    per_sentence = len(llm.tokenizer(" ".join(FILLER))["input_ids"]) / len(FILLER)
    count = max(int((context - len(build(0))) / per_sentence), 1)
    ids = build(count)
    while len(ids) > context and count > 1:
        count -= 1
        ids = build(count)
    return ids


def passkey(llm: LLM, *, context: int = 1024, trials: int = 10, seed: int = 0, max_tokens: int = 8) -> PasskeyResult:
    """Accuracy over ``trials`` prompts of about ``context`` tokens, all run as one batch."""
    if trials < 1:
        raise ConfigError(f"--trials must be at least 1, got {trials}")
    room = llm.engine.max_model_len - max_tokens
    if not 128 <= context <= room:
        raise ConfigError(f"--context must be in 128..{room} (max_model_len {llm.engine.max_model_len} less "
                          f"{max_tokens} answer tokens), got {context}")
    rng = random.Random(seed)
    keys = [str(rng.randint(10000, 99999)) for _ in range(trials)]
    depths = [i / max(trials - 1, 1) for i in range(trials)]
    prompts = [passkey_prompt(llm, k, d, context) for k, d in zip(keys, depths)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, {"max_tokens": max_tokens, "temperature": 0.0})
    rows = [PasskeyTrial(d, k, o.text, k in o.text) for d, k, o in zip(depths, keys, outputs)]
    return PasskeyResult(sum(r.correct for r in rows) / trials, context, max(map(len, prompts)), rows,
                         time.perf_counter() - start)
