"""The `paged` cache's per-block key bounds (the "key_bounds" layout extra, for QUEST): the
cache state machine of test_paged.py run again with bounds kept, checking after every
operation (prefix hits, chunked writes, copy-on-write forks, truncation and rollback,
preemption and resets) that each block a live sequence holds in full has exactly the bounds
recomputed from its stored keys, and that a partly filled block's bounds contain every key
a holder wrote; plus the layout request, int8 storage and the budget."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import initialize, invariant

from tessellm.core.interfaces.cache import CacheSpec
from tessellm.core.interfaces.kv import KVLayout
from tessellm.core.plugin import SelectionContext
from tessellm.plugins.cache.paged import PagedCache, PagedOptions
from tessellm.plugins.cache.paged.key_bounds import BoundedDenseKVStorage, BoundedInt8KVStorage


def _paged_machine():
    """test_paged.py's state machine (tests are not a package: load the module by path)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("paged_state_machine", Path(__file__).with_name("test_paged.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PagedMachine


PagedMachine = _paged_machine()

BOUNDS = frozenset({"key_bounds"})


def make_bounded_cache(block_size: int, num_blocks: int, prefix_caching: bool, page: int | None = None) -> PagedCache:
    page = min(page or block_size, block_size)
    opts = PagedOptions(block_size=block_size, num_blocks=num_blocks, prefix_caching=prefix_caching,
                        bounds_page_size=page)
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float64, device=torch.device("cpu"),
                     max_model_len=4096)
    return PagedCache(opts, spec, KVLayout("kv", block_size, torch.float64, BOUNDS, page))


class KeyBoundsMachine(PagedMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4, 16]), slots=st.sampled_from([32, 64, 128]),
                prefix_caching=st.booleans(), page=st.sampled_from([1, 2, 4, 16]))
    def start(self, block_size, slots, prefix_caching, page):
        super().start(block_size, slots, prefix_caching)
        self.cache = make_bounded_cache(block_size, slots // block_size, prefix_caching, page)
        self.page = min(page, block_size)
        assert isinstance(self.cache.layer(0), BoundedDenseKVStorage)

    @invariant()
    def bounds_hold_the_keys(self):
        """Per page of every live table: exact bounds for a full page, bounds holding every
        key this holder wrote for a partly filled one."""
        storage = self.cache.layer(0)
        kmin, kmax = storage.key_bounds()
        keys = storage.k.flatten()
        bs, ps = self.bs, self.page
        for i in self.tabled:
            seq = self.live[i]
            for n, block in enumerate(self.cache.block_table(seq)):
                for j in range(bs // ps):
                    fill = min(ps, seq.num_computed_tokens - n * bs - j * ps)
                    if fill <= 0:
                        continue
                    page = block * (bs // ps) + j
                    mine = keys[page * ps:page * ps + fill]
                    lo, hi = kmin[page].item(), kmax[page].item()
                    if fill == ps:  # a full page: exact
                        assert (lo, hi) == (mine.min().item(), mine.max().item()), (seq, n, page)
                    else:  # a partial one: every key this holder wrote lies inside
                        assert lo <= mine.min().item() and hi >= mine.max().item(), (seq, n, page)


TestKeyBoundsMachine = KeyBoundsMachine.TestCase
TestKeyBoundsMachine.settings = settings(max_examples=150, stateful_step_count=40)


@settings(max_examples=25)
@given(st.integers(2, 40), st.integers(1, 39), st.sampled_from([torch.float32, torch.bfloat16]),
       st.booleans(), st.sampled_from([1, 2, 4]), st.integers(0, 2**16))
def test_bounds_after_rollback_and_rewrite_equal_bounds_from_scratch(length, keep, dtype, int8, ps, seed):
    """Many heads and channels, float or int8 storage, pages of 1 to 4 tokens in blocks of 4:
    write a sequence, roll it back (its last block now partial and its own), rewrite other
    keys; every page's bounds equal the bounds recomputed from what ``gather`` reads back
    (dequantized for int8)."""
    keep = min(keep, length)
    bs, heads, dim = 4, 2, 8
    opts = PagedOptions(block_size=bs, num_blocks=32, kv_dtype="int8" if int8 else "auto", bounds_page_size=ps)
    spec = CacheSpec(num_layers=1, num_kv_heads=heads, head_dim=dim, dtype=dtype, device=torch.device("cpu"),
                     max_model_len=256)
    cache = PagedCache(opts, spec, KVLayout("kv", bs, torch.int8 if int8 else dtype, BOUNDS, ps))
    storage = cache.layer(0)
    assert isinstance(storage, BoundedInt8KVStorage if int8 else BoundedDenseKVStorage)
    from tessellm.core.interfaces.sequence import SamplingParams, Sequence

    g = torch.Generator().manual_seed(seed)
    seq = Sequence("r", list(range(length)), SamplingParams(max_tokens=4))

    def write(start: int, stop: int) -> None:
        cache.reserve(seq, stop)
        table = cache.block_table(seq)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(start, stop)], dtype=torch.long)
        k = (torch.randn(stop - start, heads, dim, generator=g) * 3).to(dtype)
        storage.store(k, k.clone(), slots)
        seq.num_computed_tokens = stop

    write(0, length)
    cache.truncate(seq, keep)
    seq.num_computed_tokens = keep
    write(keep, length)
    kmin, kmax = storage.key_bounds()
    table = cache.block_table(seq)

    def assert_pages_exact(upto: int) -> None:
        for p in range(-(-upto // ps)):
            page = table[p * ps // bs] * (bs // ps) + p % (bs // ps)
            fill = min(ps, upto - p * ps)
            keys = storage.gather(torch.arange(page * ps, page * ps + fill))[0]
            assert torch.equal(kmin[page], keys.amin(0)) and torch.equal(kmax[page], keys.amax(0)), (p, fill)

    assert_pages_exact(length)
    cache.truncate(seq, keep)  # an own partial block: its pages' bounds shrink to what it keeps
    assert_pages_exact(keep)
    if keep % bs:
        block = table[keep // bs]
        for j in range(-(-(keep % bs) // ps), bs // ps):  # pages the truncation emptied
            assert torch.isinf(kmin[block * (bs // ps) + j]).all()


def test_the_layout_has_bounds_only_when_the_backend_asks():
    model = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"),
                      max_model_len=64)

    def layout(extras):
        ctx = SelectionContext(device=torch.device("cpu"), dtype=torch.float32, model=model, options=PagedOptions(),
                               max_model_len=64, kv_extras=extras)
        return PagedCache.kv_layout(PagedOptions(), ctx)

    assert layout(frozenset()).extras == frozenset() and layout(frozenset()).page_size is None
    assert layout(BOUNDS).extras == BOUNDS and layout(BOUNDS).page_size == 4 and layout(BOUNDS).bounds_page == 4
    assert layout(frozenset({"something_else"})).extras == frozenset()  # a cache keeps only what it can


def test_the_memory_budget_pays_for_the_bounds():
    from tessellm.plugins.cache.paged.manager import bytes_per_block

    spec = CacheSpec(num_layers=2, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, device=torch.device("cpu"),
                     max_model_len=64)
    plain = bytes_per_block(spec, 16, torch.bfloat16)
    bounded = bytes_per_block(spec, 16, torch.bfloat16, torch.bfloat16)
    assert bounded - plain == 2 * 2 * 3 * 64 * 2  # per layer a min and a max per channel
    assert bounded / plain == pytest.approx(1 + 1 / 16)  # one block's bounds: 1/block_size of its K/V
    paged = bytes_per_block(spec, 16, torch.bfloat16, torch.bfloat16, page_size=4)
    assert paged / plain == pytest.approx(1 + 1 / 4)  # four pages a block: 1/page_size of its K/V
    options = PagedOptions(num_blocks=None, cpu_memory_bytes=2**24)
    from tessellm.plugins.cache.paged.manager import _budget_blocks

    assert _budget_blocks(options, spec, torch.device("cpu"), torch.bfloat16, BOUNDS) == \
        2**24 // bytes_per_block(spec, 16, torch.bfloat16, torch.bfloat16, page_size=4) - 1


def test_a_page_size_that_is_no_power_of_two_is_refused_naming_it():
    with pytest.raises(ValueError, match="bounds_page_size must be a power of two"):
        PagedOptions(bounds_page_size=3)


def _bounded_storage(dtype: torch.dtype, int8: bool, page: int, slots: int = 256, heads: int = 2, dim: int = 16):
    layout = KVLayout("kv", 16, torch.int8 if int8 else dtype, BOUNDS, page)
    if int8:
        return BoundedInt8KVStorage(layout, slots, heads, dim, torch.device("cpu"), dtype)
    return BoundedDenseKVStorage(layout, slots, heads, dim, torch.device("cpu"))


def _runs(data, page: int) -> list[torch.Tensor]:
    """A few steps' slot mappings as an engine writes them: up to three sequences, each in
    its own 64 slots, append runs of tokens (a prompt chunk, a decode, drafts), sometimes
    after rolling back (rewriting slots written before); a page is always written from its
    first offset on."""
    ends = [0, 0, 0]
    steps = []
    for _ in range(data.draw(st.integers(1, 5))):
        slots = []
        for seq in data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True)):
            ends[seq] = data.draw(st.integers(max(ends[seq] - 3, 0), min(ends[seq], 63)))  # a rollback
            n = data.draw(st.integers(1, min(3 * page + 2, 64 - ends[seq])))
            slots += range(64 * seq + ends[seq], 64 * seq + ends[seq] + n)
            ends[seq] += n
        steps.append(torch.tensor(slots, dtype=torch.long))
    return steps


@settings(max_examples=20)
@given(st.sampled_from([torch.float32, torch.bfloat16]), st.booleans(), st.sampled_from([1, 2, 4, 16]),
       st.integers(0, 2**16), st.data())
def test_the_bounds_kernel_gives_the_torch_paths_bounds(dtype, int8, page, seed, data):
    """The CUDA path's Triton kernel (interpreted here) and the torch path keep the same
    bounds over steps of runs of writes, rewrites included: bit for bit (int8 with bfloat16
    bounds: within one bfloat16 step, as the interpreter truncates where a GPU rounds)."""
    from unittest import mock

    from tessellm.plugins.cache.paged import key_bounds

    torch_path, kernel_path = _bounded_storage(dtype, int8, page), _bounded_storage(dtype, int8, page)
    g = torch.Generator().manual_seed(seed)
    for slots in _runs(data, page):
        k = (torch.randn(len(slots), 2, 16, generator=g) * 3).to(dtype)
        torch_path.store(k, k, slots)
        with mock.patch.object(key_bounds, "bounds_by_kernel", lambda s: True):
            kernel_path.store(k, k, slots)
        for ours, theirs in zip(kernel_path.key_bounds(), torch_path.key_bounds()):
            if int8 and dtype == torch.bfloat16:
                assert torch.allclose(ours.float(), theirs.float(), rtol=2 ** -7, atol=0)
            else:
                assert torch.equal(ours, theirs)


@pytest.mark.parametrize("kernel", [False, True])
def test_the_bounds_upkeep_of_a_store_reads_its_pages_only_whatever_the_context(kernel):
    """A decode's upkeep reads the written token's page (torch path: the keys it gathers;
    Triton: one program per written token and KV head), the same at 32 tokens of context as
    at 4,096, and a prompt's reads its own pages: O(new tokens), never O(context)."""
    from unittest import mock

    from tessellm.plugins.cache.paged import bounds_kernel, key_bounds

    page, read = 4, []
    real_keys, real_kernel = BoundedDenseKVStorage._keys, bounds_kernel._page_bounds_kernel

    class Grid:
        def __getitem__(self, grid):
            read.append(grid[0] * grid[1] * page)  # each program reads at most a page of one head
            return real_kernel[grid]

    def keys(self, slots):
        read.append(slots.numel() * self.k.shape[1])
        return real_keys(self, slots)

    def upkeep(context: int, new: int) -> int:
        storage = _bounded_storage(torch.float32, False, page, slots=8192)
        storage.store(torch.randn(context, 2, 16), torch.randn(context, 2, 16), torch.arange(context))
        read.clear()
        slots = torch.arange(context, context + new)
        with mock.patch.object(key_bounds, "bounds_by_kernel", lambda s: kernel), \
                mock.patch.object(BoundedDenseKVStorage, "_keys", keys), \
                mock.patch.object(bounds_kernel, "_page_bounds_kernel", Grid()):
            storage.store(torch.randn(new, 2, 16), torch.randn(new, 2, 16), slots)
        return sum(read)

    assert upkeep(32, 1) == upkeep(4096, 1) <= 2 * page
    assert upkeep(32, 64) == upkeep(4096, 64) <= 2 * 64 * page
