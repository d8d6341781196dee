"""Passkey retrieval: can the pipeline find a number hidden in a long, dull context?

Each trial hides a random key of digits in filler text and asks for it at the end; the trial
passes when the greedy answer contains the key. The prompts come from a family wide enough
to show position and phrasing effects, drawn from a seed:

- the key's depth (0: start of the filler, 1: its end) is uniform over the context,
  stratified so that every tenth of it is drawn about as often (accuracy is reported by
  depth decile);
- the filler is one of several texts (``FILLERS``: short repeated sentences of three kinds,
  and verse from the bundled *Paradise Lost*, which does not repeat);
- the key's phrasing and the question that asks for it are one of ``PHRASINGS``;
- the key has 4 to 7 digits (``KEY_DIGITS``).

The filler says nothing about the key, so a model that cannot attend to the key's position
has to guess. Long context at a fixed token budget is what sparse attention (QUEST) must
survive: where the pipeline's attention backend reports the blocks it selects
(``observe_selection``, as `quest` does), the result also holds, per layer, the share of the
key's cache blocks that its sparse decode steps selected.
"""

from __future__ import annotations

import functools
import random
import re
import time
from dataclasses import asdict, dataclass, field

from tessellm.core.engine.llm import LLM
from tessellm.core.errors import ConfigError

FILLERS: dict[str, tuple[str, ...]] = {
    "town": ("The river runs past the old mill.", "The baker opens her shop at dawn.",
             "Sparrows gather on the warm roof.", "The bell in the square rings at noon.",
             "The market closes at six."),
    "grass": ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
              "There and back again."),
    "lab": ("The samples were kept in the cold room overnight.", "A technician labelled every tray by hand.",
            "The centrifuge hummed through the afternoon.", "Each result was copied into the ledger.",
            "Nobody used the spare microscope that week.", "The windows were opened to let the heat out."),
    "verse": (),  # sentences of the bundled Paradise Lost, from a random point on (see _verse)
}
"""Filler texts: sentences repeated in turn (``verse``: a run of the poem's own sentences)."""

PHRASINGS: tuple[tuple[str, str], ...] = (
    ("The pass key is {key}. Remember it: {key} is the pass key.", "What is the pass key? The pass key is"),
    ("Remember this number, it is the pass key: {key}.", "Which number is the pass key? The pass key is"),
    ("The secret code you will be asked for is {key}. Keep it in mind.",
     "What is the secret code? The secret code is"),
    ("Note for later: the vault opens with the code {key}.", "Which code opens the vault? The vault opens with the code"),
)
"""(the sentence hiding the key, the question that ends the prompt) pairs."""

INTRO = "There is an important number hidden in the following text. Find it and remember it.\n\n"
KEY_DIGITS = (4, 5, 6, 7)
NEEDLE, QUESTION = PHRASINGS[0]  # the first phrasing, as earlier versions had only


@dataclass
class PasskeyTrial:
    """One trial: where the key sat (0: start of the filler, 1: its end), how it was hidden,
    and what came back; ``selection``: per layer, the share of the key's blocks its sparse
    decode steps selected (empty where the backend reports no selection)."""

    depth: float
    key: str
    answer: str
    correct: bool
    filler: str = "town"
    phrasing: int = 0
    key_tokens: list[int] = field(default_factory=list)
    selection: dict[int, float] = field(default_factory=dict)


@dataclass
class PasskeyResult:
    """What ``passkey`` measured; ``as_dict`` is the ``--json`` object."""

    accuracy: float
    context: int
    prompt_tokens: int
    trials: list[PasskeyTrial] = field(default_factory=list)
    seconds: float = 0.0
    by_decile: list[list[int]] = field(default_factory=list)
    """Per tenth of depth: [keys found, trials]."""
    selection: dict[int, float] = field(default_factory=dict)
    """Per layer attending sparsely: the mean share of the key's blocks selected."""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PasskeyCase:
    """How one trial hides its key."""

    key: str
    depth: float
    filler: str = "town"
    phrasing: int = 0
    offset: int = 0  # where ``verse`` starts in the poem


@functools.lru_cache(maxsize=1)
def _verse() -> tuple[str, ...]:
    from tessellm.eval.texts import load_text

    text = " ".join(load_text("paradise-lost")[1].split())
    sentences = re.split(r"(?<=[.;!?])\s+", text[text.find("Of Mans First Disobedience"):])
    return tuple(s for s in sentences if s and not any(c.isdigit() for c in s))


def filler_sentences(case: PasskeyCase, count: int) -> list[str]:
    if case.filler == "verse":
        verse = _verse()
        return [verse[(case.offset + i) % len(verse)] for i in range(count)]
    pool = FILLERS[case.filler]
    return [pool[i % len(pool)] for i in range(count)]


def _prompt_text(case: PasskeyCase, count: int) -> tuple[str, list[tuple[int, int]]]:
    """The prompt with ``count`` filler sentences, and the character spans of the key."""
    needle, question = PHRASINGS[case.phrasing]
    body = filler_sentences(case, count)
    before = round(count * case.depth)
    head = INTRO + " ".join(body[:before] + [""])
    text = head + needle.format(key=case.key) + " ".join([""] + body[before:]) + "\n\n" + question
    start = len(head)
    spans = [(start + m.start(), start + m.end()) for m in re.finditer(re.escape(case.key), needle.format(key=case.key))]
    return text, spans


def case_prompt(llm: LLM, case: PasskeyCase, context: int) -> tuple[list[int], list[int]]:
    """Token ids of a prompt of at most ``context`` tokens (and close to it) hiding the key as
    ``case`` says, and the positions of the key's tokens in it."""
    def build(count: int) -> tuple[list[int], list[int]]:
        text, spans = _prompt_text(case, count)
        enc = llm.tokenizer(text, return_offsets_mapping=True)
        keys = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if any(a < e and b > s for s, e in spans)]
        return enc["input_ids"], keys

    sample = filler_sentences(case, 20)
    per_sentence = len(llm.tokenizer(" ".join(sample))["input_ids"]) / len(sample)
    count = max(int((context - len(build(0)[0])) / per_sentence), 1)
    ids, keys = build(count)
    while len(ids) > context and count > 1:
        count = max(count - max(int((len(ids) - context) / per_sentence), 1), 1)
        ids, keys = build(count)
    return ids, keys


def passkey_prompt(llm: LLM, key: str, depth: float, context: int) -> list[int]:
    """The first phrasing in the ``town`` filler: a prompt of about ``context`` tokens with
    ``key`` after ``depth`` of its filler."""
    return case_prompt(llm, PasskeyCase(key, depth), context)[0]


def draw_cases(trials: int, seed: int) -> list[PasskeyCase]:
    """``trials`` cases: depths stratified over [0, 1), fillers and phrasings in turn (so
    each pairing appears), key lengths and keys drawn."""
    rng = random.Random(seed)
    strata = list(range(trials))
    rng.shuffle(strata)
    fillers = list(FILLERS)
    verse_len = len(_verse())
    cases = []
    for i in range(trials):
        digits = rng.choice(KEY_DIGITS)
        key = str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
        cases.append(PasskeyCase(key, (strata[i] + rng.random()) / trials, fillers[i % len(fillers)],
                                 (i // len(fillers)) % len(PHRASINGS), rng.randrange(verse_len)))
    return cases


def passkey(llm: LLM, *, context: int = 1024, trials: int = 30, seed: int = 0, max_tokens: int | None = None,
            cases: list[PasskeyCase] | None = None) -> PasskeyResult:
    """Accuracy over ``trials`` prompts of about ``context`` tokens (``cases``: these instead
    of the seeded draw), all run as one batch."""
    cases = cases if cases is not None else draw_cases(_at_least_one(trials), seed)
    max_tokens = max_tokens or max(len(c.key) for c in cases) + 4  # a digit a token, and room around it
    room = llm.engine.max_model_len - max_tokens
    if not 128 <= context <= room:
        raise ConfigError(f"--context must be in 128..{room} (max_model_len {llm.engine.max_model_len} less "
                          f"{max_tokens} answer tokens), got {context}")
    built = [case_prompt(llm, c, context) for c in cases]
    prompts = [ids for ids, _ in built]
    recorder = SelectionRecorder.attach(llm, prompts, [keys for _, keys in built])
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, {"max_tokens": max_tokens, "temperature": 0.0})
    finally:
        if recorder is not None:
            recorder.detach()
    seconds = time.perf_counter() - start
    rows = [PasskeyTrial(c.depth, c.key, o.text, c.key in o.text, c.filler, c.phrasing, keys,
                         recorder.shares(i) if recorder else {})
            for i, (c, o, (_, keys)) in enumerate(zip(cases, outputs, built))]
    deciles = [[0, 0] for _ in range(10)]
    for r in rows:
        d = deciles[min(int(r.depth * 10), 9)]
        d[0] += r.correct
        d[1] += 1
    return PasskeyResult(sum(r.correct for r in rows) / len(rows), context, max(map(len, prompts)), rows, seconds,
                         deciles, recorder.mean_shares() if recorder else {})


def _at_least_one(trials: int) -> int:
    if trials < 1:
        raise ConfigError(f"--trials must be at least 1, got {trials}")
    return trials


class SelectionRecorder:
    """Collects, from an attention backend that reports its sparse selections, the share of
    each trial's key blocks selected, per layer (averaged over KV heads and decode steps)."""

    def __init__(self, backend, prompts: list[list[int]], key_tokens: list[list[int]], block_size: int):
        self.backend = backend
        self.block_size = block_size
        self._trial_of_prompt = {tuple(p): i for i, p in enumerate(prompts)}
        self._trial_of_seq: dict[str, int] = {}
        self._key_blocks = [frozenset(t // block_size for t in keys) for keys in key_tokens]  # QUEST's pages
        self._prompt_lens = [len(p) for p in prompts]
        self._sums: dict[tuple[int, int], list[float]] = {}  # (trial, layer) -> [sum of shares, count]
        self._runner = self._graphs = None  # the runner whose CUDA graphs rest while attached

    @classmethod
    def attach(cls, llm: LLM, prompts: list[list[int]], key_tokens: list[list[int]]) -> SelectionRecorder | None:
        backend = llm.pipeline.attention
        if not hasattr(backend, "observe_selection"):
            return None
        recorder = cls(backend, prompts, key_tokens, llm.pipeline.cache.layout.bounds_page)
        backend.observe_selection(recorder)
        # a decode step replayed from a CUDA graph runs no Python: the selection is observed
        # in eager steps only, so the graphs rest while the recorder listens
        recorder._runner, recorder._graphs = llm.pipeline.runner, llm.pipeline.runner.graphs
        recorder._runner.graphs = None
        return recorder

    def detach(self) -> None:
        self.backend.observe_selection(None)
        if self._runner is not None:
            self._runner.graphs = self._graphs

    def _trial(self, seq) -> int | None:
        trial = self._trial_of_seq.get(seq.request_id)
        if trial is None:
            trial = self._trial_of_prompt.get(tuple(seq.token_ids[:seq.num_prompt_tokens]))
            if trial is not None:
                self._trial_of_seq[seq.request_id] = trial
        return trial

    def __call__(self, layer: int, seqs: list, blocks: list[list[list[int]]]) -> None:
        """``blocks[b][h]``: the logical blocks (position // block_size) that KV head h of
        sequence ``seqs[b]`` attends in ``layer``."""
        for seq, heads in zip(seqs, blocks):
            trial = self._trial(seq)
            if trial is None or not self._key_blocks[trial]:
                continue
            want = self._key_blocks[trial]
            share = sum(len(want.intersection(h)) for h in heads) / (len(want) * len(heads))
            acc = self._sums.setdefault((trial, layer), [0.0, 0])
            acc[0] += share
            acc[1] += 1

    def shares(self, trial: int) -> dict[int, float]:
        return {layer: round(s / n, 4) for (t, layer), (s, n) in sorted(self._sums.items()) if t == trial}

    def mean_shares(self) -> dict[int, float]:
        per_layer: dict[int, list[float]] = {}
        for (_, layer), (s, n) in self._sums.items():
            per_layer.setdefault(layer, []).append(s / n)
        return {layer: round(sum(v) / len(v), 4) for layer, v in sorted(per_layer.items())}
