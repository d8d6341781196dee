"""Tiers under the engine: greedy outputs with host and disk tiers equal those without (every
request gets the tokens it gets alone), over a device pool small enough that shared prefixes
are evicted and loaded back, in float64 on tiny random models; again after a restart that
reads the prefixes from disk; for plain, int8 and key-bounded K/V (QUEST) and MLA latents."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from tessellm import LLM
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.testing.models import build_tiny_deepseek, build_tiny_llama

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
BASES = [[3 + (7 * i) % 400 for i in range(48)], [11 + (13 * i) % 300 for i in range(48)],
         [5 + (17 * i) % 350 for i in range(48)]]
VARIANTS = {
    "plain": ("llama", {}, {}),
    "int8-kv": ("llama", {}, {"kv_dtype": "int8"}),
    "quest-bounds": ("llama", {"name": "quest", "options": {"token_budget": 16, "dense_layers": 1}}, {}),
    "mla-latent": ("deepseek", {"name": "mla"}, {}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tier-models")
    return {"llama": build_tiny_llama(root / "llama"), "deepseek": build_tiny_deepseek(root / "deepseek", 2)}


def config(model, attention: dict, cache: dict) -> dict:
    out = {"model": str(model), "device": "cpu", "dtype": "float64", "max_model_len": 128,
           "cache": {"name": "paged", "options": {"block_size": 4, "num_blocks": 24, **cache}},
           "scheduler": {"name": "continuous", "options": {"max_num_seqs": 2}}, "decoding": {"name": "greedy"}}
    if attention:
        out["attention"] = attention
    return out


class Alone:
    """Each prompt's greedy tokens when it runs alone without any prefix caching (memoized)."""

    def __init__(self, llm: LLM):
        self.llm, self.memo = llm, {}

    def __call__(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self.memo:
            self.memo[key] = self.llm.generate([prompt], GREEDY)[0].token_ids
        return self.memo[key]


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, models):
    arch, attention, cache = VARIANTS[request.param]
    return request.param, models[arch], attention, cache, Alone(LLM(config(models[arch], attention,
                                                                         {**cache, "prefix_caching": False})))


prompts_strategy = st.lists(st.tuples(st.integers(0, 2), st.integers(6, 44), st.integers(1, 400)),
                            min_size=3, max_size=7)


@settings(max_examples=6)
@given(prompts=prompts_strategy)
def test_outputs_equal_without_tiers_and_after_restart(variant, tmp_path_factory, prompts):
    name, model, attention, cache, alone = variant
    disk = tmp_path_factory.mktemp(f"disk-{name}")
    # the host tier holds 4 to 42 blocks of these models: prefixes also come back from the disk
    tiers = {**cache, "host_tier_bytes": 24 * 2**10, "disk_tier_path": str(disk)}
    batch = [BASES[b][:n] + [tail] for b, n, tail in prompts]
    want = [alone(p) for p in batch]
    llm = LLM(config(model, attention, tiers))
    for _ in range(2):  # the second round finds the prefixes on the device, the host or the disk
        assert [o.token_ids for o in llm.generate(batch, GREEDY)] == want
    llm.close()
    restarted = LLM(config(model, attention, tiers))
    assert [o.token_ids for o in restarted.generate(batch[::-1], GREEDY)] == want[::-1]
    stats = restarted.pipeline.cache.prefix_cache_stats()
    if any(n >= 8 for _, n, _ in prompts):  # a full block of 4 below the last token
        assert stats.tiers["disk"]["hit_tokens"] > 0 and stats.hit_tokens >= stats.tiers["disk"]["hit_tokens"]
    restarted.close()


def test_prefixes_come_back_from_host_and_disk_within_one_process(models, tmp_path):
    batch = [BASES[b][:n] + [t] for b, n, t in [(0, 44, 1), (1, 44, 2), (2, 30, 3), (1, 40, 4), (0, 44, 5), (2, 40, 6)]]
    alone = Alone(LLM(config(models["llama"], {}, {"prefix_caching": False})))
    llm = LLM(config(models["llama"], {}, {"host_tier_bytes": 24 * 2**10, "disk_tier_path": str(tmp_path)}))
    for _ in range(2):
        assert [o.token_ids for o in llm.generate(batch, GREEDY)] == [alone(p) for p in batch]
    tiers = llm.pipeline.cache.prefix_cache_stats().tiers
    assert tiers["host"]["hit_tokens"] > 0 and tiers["disk"]["hit_tokens"] > 0
    assert tiers["host"]["read_bytes"] > 0 and tiers["disk"]["written_bytes"] > 0
    llm.close()


def test_a_sliding_window_model_refuses_tiers_with_the_option_that_keeps_them(tmp_path):
    from tessellm.core.errors import ConfigError
    from tessellm.testing.models import build_tiny

    model = build_tiny("mistral", tmp_path / "mistral")
    with pytest.raises(ConfigError, match="free_out_of_window=false"):
        LLM(config(model, {}, {"host_tier_bytes": 2**20}))
    LLM(config(model, {}, {"host_tier_bytes": 2**20, "free_out_of_window": False})).close()


def test_a_request_whose_prefix_is_being_read_waits_while_others_run(models, tmp_path):
    """After a restart, request A's prefix is on disk and its read is held up: B keeps
    decoding, A is not admitted until the read lands, then it starts from the disk blocks."""
    import threading

    from tessellm.plugins.cache.paged.tiers import DiskTier

    cfg = config(models["llama"], {}, {"disk_tier_path": str(tmp_path)})
    prompt_a, prompt_b = BASES[0][:40] + [1], BASES[1][:9]
    alone = Alone(LLM(config(models["llama"], {}, {"prefix_caching": False})))
    first = LLM(cfg)
    first.generate([prompt_a], GREEDY)
    first.close()
    llm = LLM(cfg)
    engine, disk = llm.engine, llm.pipeline.cache.tiers.disk
    gate, read = threading.Event(), DiskTier.read
    disk.read = lambda key: (gate.wait(30), read(disk, key))[1]
    engine.add_request("b", prompt_b, GREEDY)
    engine.step()
    engine.add_request("a", prompt_a, GREEDY)
    for _ in range(3):
        engine.step()
    a, b = engine.requests["a"].seqs[0], engine.requests["b"].seqs[0]
    assert a.num_computed_tokens == 0 and b.num_output_tokens >= 3  # B ran on, A waited
    gate.set()
    while engine.has_unfinished():
        engine.step()
    assert a.output_token_ids == alone(prompt_a) and b.output_token_ids == alone(prompt_b)
    assert a.num_cached_tokens == 40 and llm.pipeline.cache.prefix_cache_stats().tiers["disk"]["hit_tokens"] == 40
    llm.close()
