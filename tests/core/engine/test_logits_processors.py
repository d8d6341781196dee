"""Logits processors through the engine: a request turns processors on, each step hands each
processor the rows that use it, and the result does not depend on how the engine got there:
speculative decoding (greedy speculative equals plain greedy with the same processors), n > 1,
the prefix cache, preemption and recompute, overlapped steps. Float64 tiny model, so batch
composition cannot change a token; nothing leaked afterwards."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tessellm
from tessellm import LLM
from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.logits import LogitsProcessor, ProcessorRows
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.core.plugin import PluginOptions
from tessellm.core.version import PLUGIN_API_VERSION
from tessellm.testing.engine import run_arrivals


class BanSeenArgs(PluginOptions):
    after: int = 0
    """Output tokens before the ban starts."""


class BanSeen(LogitsProcessor):
    """A third party's stateful processor: bans every token the output holds (host state, so
    not overlap-safe), once ``after`` tokens are out."""

    name = "ban-seen"
    api_version = PLUGIN_API_VERSION
    Args = BanSeenArgs

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.seen: dict[int, set[int]] = {}

    def add(self, seq: Sequence, args: BanSeenArgs) -> None:
        self.seen[seq.seq_id] = set(seq.output_token_ids)

    def accept(self, updates) -> None:
        for seq, tokens in updates:
            self.seen[seq.seq_id].update(tokens)

    def remove(self, seq: Sequence) -> None:
        del self.seen[seq.seq_id]

    def apply(self, logits: torch.Tensor, rows: ProcessorRows) -> None:
        for row, seq, args, drafts, out in zip(rows.rows, rows.seqs, rows.args, rows.drafts, rows.num_output):
            if out >= args.after:
                banned = sorted(self.seen[seq.seq_id] | set(drafts))
                logits[row, banned] = float("-inf")


@tessellm.hookimpl
def register_logits(register):
    register(BanSeen)


@pytest.fixture(scope="module")
def folder(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def registry():
    from tessellm.core.registry import PluginRegistry
    import sys

    registry = PluginRegistry()
    registry.add_module(sys.modules[__name__], package="authors-package")
    return registry


def build(cpu_config, folder, registry, *, decoding="sample", async_scheduling=False, blocks=96, budget=48,
          max_seqs=6, **decoding_options) -> LLM:
    from tessellm.core.engine.pipeline import Pipeline

    config = cpu_config(folder, dtype="float64", async_scheduling=async_scheduling,
                        decoding={"name": decoding, "options": decoding_options},
                        cache={"name": "paged", "options": {"block_size": 4, "num_blocks": blocks}},
                        scheduler={"name": "continuous", "options": {"max_num_seqs": max_seqs,
                                                                     "max_num_batched_tokens": budget}})
    return LLM(pipeline=Pipeline.from_config(config, registry=registry))


_llms: dict[tuple, LLM] = {}


def llm_for(cpu_config, folder, registry, key: str) -> LLM:
    """One pipeline per setup for the module: plain, speculative (two proposers), async."""
    setups = {"plain": {}, "async": {"async_scheduling": True},
              "ngram": {"decoding": "speculative", "proposer": "ngram", "k": 3, "adaptive_k": False},
              "layer-skip": {"decoding": "speculative", "proposer": "layer-skip", "k": 2, "draft_layers": [0, 1],
                             "adaptive_k": False},
              "tight": {"blocks": 14, "budget": 16, "max_seqs": 4}}
    if key not in _llms:
        _llms[key] = build(cpu_config, folder, registry, **setups[key])
    return _llms[key]


def assert_clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.processors.bound and not engine.requests
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    for proc in engine.processors.processors:
        for value in vars(proc).values():  # per-sequence state: dicts keyed by seq_id
            if isinstance(value, dict) and value and all(isinstance(k, int) for k in value):
                raise AssertionError(f"logits processor {proc.name!r} kept state after every request ended")


PROCESSED = [
    {"logits_processors": [{"name": "ban-seen", "args": {"after": 2}}]},
    {"min_tokens": 6, "stop_token_ids": [16775, 2820, 12776], "logit_bias": {7: 6.0, 490: -3.0, 12776: -3.0}},
    {"presence_penalty": 1.5, "frequency_penalty": 0.7},
    {"repetition_penalty": 1.8},
    {"no_repeat_ngram_size": 2},
    {"bad_words_ids": [[7], [11, 12]], "allowed_token_ids": list(range(3, 40))},
]
"""Requests' processor settings. The tiny model's logits spread about 1.2 around a top of about
6, it repeats itself readily and picks 490, 12776, 16775 and 2820 often: each setting bites."""

ALPHABET = [5, 9, 17, 23, 31]


def requests_from(draw_sizes: list[tuple[int, int, int]], seed: int) -> list[tuple[int, list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    work = []
    for i, (arrival, prompt_len, max_tokens) in enumerate(draw_sizes):
        prompt = [ALPHABET[int(j)] for j in torch.randint(0, 5, (prompt_len,), generator=g)]
        fields = dict(PROCESSED[i % len(PROCESSED)])
        if "min_tokens" in fields:
            fields["min_tokens"] = min(fields["min_tokens"], max_tokens)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **fields)
        work.append((arrival, prompt, params))
    return work


sizes_st = st.lists(st.tuples(st.integers(0, 6), st.integers(1, 12), st.integers(1, 14)), min_size=1, max_size=6)


@settings(max_examples=10)
@given(sizes=sizes_st, seed=st.integers(0, 2**16), setup=st.sampled_from(["ngram", "layer-skip", "async", "tight"]))
def test_every_path_gives_plain_greedys_tokens(cpu_config, folder, registry, sizes, seed, setup):
    """Greedy speculative decoding (two proposers), async scheduling and a cache tight enough
    to preempt give, request by request, what plain greedy decoding with the same processors
    gives each request alone."""
    work = requests_from(sizes, seed)
    plain = llm_for(cpu_config, folder, registry, "plain")
    other = llm_for(cpu_config, folder, registry, setup)
    alone = {f"r{i}": run_arrivals(plain.engine, [(0, prompt, params)])["r0"] for i, (_, prompt, params)
             in enumerate(work)}
    assert run_arrivals(other.engine, work) == alone
    assert_clean(other)
    assert_clean(plain)


def test_processors_change_tokens_and_speculation_drafts(cpu_config, folder, registry):
    """Each setting changes the greedy output of a repetitive prompt (else the test above
    proves nothing), and the speculative pipelines did draft and accept under them."""
    plain = llm_for(cpu_config, folder, registry, "plain")
    prompts = [ALPHABET * 3, ALPHABET * 2]
    bare = [o.token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    for settings_ in PROCESSED:
        outs = plain.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, **settings_))
        assert [o.token_ids for o in outs] != bare, settings_
    prompt = prompts[0]
    for key in ("ngram", "layer-skip"):
        llm = llm_for(cpu_config, folder, registry, key)
        llm.engine.stats = type(llm.engine.stats)()
        llm.generate([prompt] * 3, [SamplingParams(max_tokens=16, ignore_eos=True, **s) for s in PROCESSED[:3]])
        assert llm.engine.stats.accepted_draft_tokens > 0, key


def test_parallel_samples_each_keep_their_own_state(cpu_config, folder, registry):
    """n > 1: greedy samples all equal the n = 1 output (forked state); sampled ones each obey
    the ban on their own output, and differ from one another."""
    plain = llm_for(cpu_config, folder, registry, "plain")
    prompt = ALPHABET * 2
    ban = {"logits_processors": ["ban-seen"]}
    one = plain.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, **ban))[0].token_ids
    many = plain.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, n=3, **ban))[0]
    assert [o.token_ids for o in many.outputs] == [one] * 3
    sampled = plain.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, n=4, temperature=1.0,
                                                      seed=3, **ban))[0]
    outs = [o.token_ids for o in sampled.outputs]
    assert all(len(set(o)) == len(o) for o in outs) and len({tuple(o) for o in outs}) > 1
    assert_clean(plain)


def test_prefix_cache_hits_change_nothing(cpu_config, folder, registry):
    plain = llm_for(cpu_config, folder, registry, "plain")
    prompt = ALPHABET * 4
    params = SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=1.0, repetition_penalty=1.3)
    first = plain.generate([prompt], params)[0]
    again = plain.generate([prompt], params)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids


def test_overlapped_steps_run_overlap_safe_processors_only(cpu_config, folder, registry):
    """Requests whose processors are all overlap-safe take the overlapped step; one using a
    processor that is not sends the steps it is in through the synchronous step."""
    llm = llm_for(cpu_config, folder, registry, "async")
    prompt = ALPHABET * 2
    for settings_, overlaps in (({"min_tokens": 4, "logit_bias": {7: 2.0}}, True),
                                ({"presence_penalty": 1.0, "repetition_penalty": 1.5}, True),
                                ({"logits_processors": ["ban-seen"]}, False)):
        llm.engine.stats = type(llm.engine.stats)()
        llm.generate([prompt] * 2, SamplingParams(max_tokens=12, ignore_eos=True, **settings_))
        assert (llm.engine.stats.overlapped_steps > 0) is overlaps, settings_
    assert_clean(llm)


def test_bad_requests_are_refused_on_arrival_naming_the_problem(cpu_config, folder, registry):
    llm = llm_for(cpu_config, folder, registry, "plain")
    engine = llm.engine
    cases = [({"logits_processors": ["no-such"]}, "'no-such'.*installed: .*ban-seen"),
             ({"logits_processors": [{"name": "ban-seen", "args": {"after": -1, "x": 1}}]},
              "'ban-seen' refuses its args"),
             ({"logits_processors": ["ban-seen", "ban-seen"]}, "named 2 times"),
             ({"logits_processors": ["logit_bias"]}, "SamplingParams.logit_bias"),
             ({"logit_bias": {10**6: 1.0}}, "outside the vocabulary")]
    for fields, match in cases:
        with pytest.raises(InvalidRequestError, match=match):
            engine.add_request("bad", [5, 9], SamplingParams(**fields))
    assert not engine.requests and not engine.processors.bound


def test_a_field_no_installed_processor_reads_is_refused(cpu_config, folder, monkeypatch):
    """With the penalties' plugin disabled, a request asking for a penalty is refused, not
    served without it."""
    from tessellm.core.engine.pipeline import Pipeline
    from tessellm.core.registry import PluginRegistry

    monkeypatch.setenv("TESSELLM_DISABLE_PLUGINS", "logits.penalties")
    llm = LLM(pipeline=Pipeline.from_config(cpu_config(folder), registry=PluginRegistry()))
    with pytest.raises(InvalidRequestError, match="presence_penalty is set, but no installed logits processor"):
        llm.generate([[5, 9]], SamplingParams(presence_penalty=0.5))
    assert llm.generate([[5, 9]], SamplingParams(max_tokens=2))[0].token_ids


def test_abort_forgets_processor_state(cpu_config, folder, registry):
    llm = llm_for(cpu_config, folder, registry, "plain")
    engine = llm.engine
    engine.add_request("a", ALPHABET, SamplingParams(max_tokens=30, logits_processors=["ban-seen"],
                                                     presence_penalty=0.5, no_repeat_ngram_size=3))
    engine.step()
    engine.step()
    assert engine.processors.bound
    engine.abort("a")
    assert_clean(llm)


def test_preempted_requests_keep_their_processors_state(cpu_config, folder, registry):
    """A cache too small for four long requests preempts some (recomputed later); each still
    gets the tokens it gets alone."""
    plain = llm_for(cpu_config, folder, registry, "plain")
    tight = llm_for(cpu_config, folder, registry, "tight")
    work = [(0, ALPHABET * 2, SamplingParams(max_tokens=14, ignore_eos=True, **fields)) for fields in PROCESSED[:4]]
    tight.engine.stats = type(tight.engine.stats)()
    outs = run_arrivals(tight.engine, work)
    assert tight.engine.stats.preemptions > 0
    assert outs == {f"r{i}": run_arrivals(plain.engine, [w])["r0"] for i, w in enumerate(work)}
    assert_clean(tight)
