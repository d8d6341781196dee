"""`paged` with host and disk tiers: the cache state machine of test_paged.py again, with a
device pool small enough that prefixes are evicted, come back from the host or the disk
tier, and (rule ``restart``) from the disk alone in a new cache over the same directory.
Every stored value encodes its token and position, so a block loaded from a tier into the
wrong place, or stale, shows in the machine's invariants. Then the tiers' own contracts:
the packed block format, LRU, and the disk tier's refusal of files it cannot trust."""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import event, given, settings, strategies as st
from hypothesis.stateful import initialize, precondition, rule

from tessellm.core.errors import ConfigError
from tessellm.core.interfaces.cache import CacheSpec
from tessellm.core.interfaces.kv import KVLayout
from tessellm.plugins.cache.paged import PagedCache, PagedOptions
from tessellm.plugins.cache.paged.key_bounds import KEY_BOUNDS, make_layer_storage
from tessellm.plugins.cache.paged.tiers import BlockCodec, DiskTier, HostTier

from .test_paged import PagedMachine, compute, expected, new_seq, read

FINGERPRINT = "0" * 32


def tiered_cache(block_size: int, num_blocks: int, host_blocks: int, disk: Path | None,
                 fingerprint: str = FINGERPRINT) -> PagedCache:
    block_bytes = 2 * max(16, block_size * 8)  # one layer, head and channel: K and V in float64, 16-byte spans
    opts = PagedOptions(block_size=block_size, num_blocks=num_blocks, host_tier_bytes=host_blocks * block_bytes,
                        disk_tier_path=None if disk is None else str(disk), disk_tier_bytes=2**20)
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float64, device=torch.device("cpu"),
                     max_model_len=4096, fingerprint=fingerprint)
    return PagedCache(opts, spec, KVLayout("kv", block_size, torch.float64))


class TieredMachine(PagedMachine):
    """PagedMachine over a tiered cache; the device holds few blocks, so prefixes move."""

    @initialize(block_size=st.sampled_from([1, 2, 4]), slots=st.sampled_from([16, 32]),
                host_blocks=st.sampled_from([0, 1, 4, 64]), disk=st.booleans())
    def start(self, block_size, slots, host_blocks, disk):
        if not host_blocks and not disk:
            disk = True
        self.bs = block_size
        self.dir = Path(tempfile.mkdtemp(prefix="tessellm-tiers-")) if disk else None
        self.make = lambda: tiered_cache(block_size, slots // block_size, host_blocks, self.dir)
        self.cache = self.make()
        self.live, self.tabled, self.committed, self.content = {}, set(), set(), {}

    @rule()
    def restart(self):
        """A new process: every sequence ends, the device and host tiers are gone, and only
        what reached the disk can hit (``committed`` keeps what the disk may hold)."""
        for seq in self.live.values():
            self.cache.free(seq)
        self.live.clear()
        self.tabled.clear()
        self.cache.close()
        if self.dir is None:
            self.committed.clear()
        self.cache = self.make()

    @rule()
    def tier_hits_are_counted(self):
        for name, counters in self.cache.prefix_cache_stats().tiers.items():
            assert counters["hit_tokens"] % self.bs == 0 and counters["read_bytes"] >= 0
            if counters["hit_tokens"]:
                event(f"{name} tier hit")

    def teardown(self):
        super().teardown()
        self.cache.close()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


TestTieredMachine = TieredMachine.TestCase
TestTieredMachine.settings = settings(max_examples=150, stateful_step_count=40)


@settings(max_examples=60)
@given(block_size=st.sampled_from([1, 2, 4]), host_blocks=st.sampled_from([0, 2, 8]), disk=st.booleans(),
       ops=st.lists(st.tuples(st.integers(0, 2), st.integers(2, 24), st.sampled_from([None, "a"]),
                              st.booleans()), min_size=4, max_size=24))
def test_evicted_prompts_come_back_exactly(block_size, host_blocks, disk, ops):
    """Prompts computed and released in turn over a device pool of 24 slots: a prompt seen
    before hits (the device, the host tier or the disk, also after a restart when the disk
    tier is on) and reads back exactly its own tokens at their positions."""
    folder = Path(tempfile.mkdtemp(prefix="tessellm-tiers-")) if disk or not host_blocks else None
    make = lambda: tiered_cache(block_size, 24 // block_size, host_blocks, folder)  # noqa: E731
    cache, seen, hits = make(), set(), 0
    try:
        for base, length, salt, restart in ops:
            if restart:
                cache.close()
                cache = make()
                if folder is None:
                    seen.clear()
            seq = new_seq(BASES_FOR_TIERS[base][:length], salt)
            seq.num_computed_tokens = hit = cache.match_prefix(seq)
            assert hit % block_size == 0 and (not hit or (salt, tuple(seq.token_ids[:hit])) in seen)
            hits += hit
            compute(cache, seq, seq.num_tokens)
            assert read(cache, seq) == expected(seq)
            for i in range(1, seq.num_tokens // block_size + 1):
                seen.add((salt, tuple(seq.token_ids[:i * block_size])))
            cache.free(seq)
            cache.tiers.flush()  # the disk writes of this prompt land before the next lookup
        tiers = cache.prefix_cache_stats().tiers
        if any(t["hit_tokens"] for t in tiers.values()):
            event("tier hit")
    finally:
        cache.close()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


BASES_FOR_TIERS = [[1 + i % 5 for i in range(24)], [7] * 24, [(3 * i) % 11 + 1 for i in range(24)]]


def test_evicted_prefix_comes_back_from_host_then_disk(tmp_path):
    cache = tiered_cache(4, 4, host_blocks=2, disk=tmp_path)
    a = new_seq(list(range(1, 14)))  # 3 full blocks + 1 token: the whole device pool
    compute(cache, a, 13)
    cache.free(a)
    b = new_seq([50 + i for i in range(13)])  # evicts a's blocks: 2 fit the host tier
    compute(cache, b, 13)
    cache.free(b)
    cache.tiers.flush()
    a2 = new_seq(list(range(1, 14)))
    a2.num_computed_tokens = cache.match_prefix(a2)
    assert a2.num_computed_tokens == 12 and read(cache, a2) == expected(a2)
    tiers = cache.prefix_cache_stats().tiers
    assert tiers["host"]["hit_tokens"] + tiers["disk"]["hit_tokens"] == 12
    assert tiers["host"]["hit_tokens"] > 0 and tiers["disk"]["hit_tokens"] > 0
    cache.close()


def test_salted_prefix_never_serves_another_tenant_from_disk(tmp_path):
    cache = tiered_cache(4, 8, host_blocks=4, disk=tmp_path)
    tokens = list(range(1, 10))
    seq = new_seq(tokens, "tenant-a")
    compute(cache, seq, 9)
    cache.free(seq)
    cache.close()
    again = tiered_cache(4, 8, host_blocks=4, disk=tmp_path)
    for salt in (None, "tenant-b"):
        assert again.match_prefix(new_seq(tokens, salt)) == 0
    own = new_seq(tokens, "tenant-a")
    own.num_computed_tokens = again.match_prefix(own)
    assert own.num_computed_tokens == 8 and read(again, own) == expected(own)
    again.close()


def test_another_model_or_layout_reads_nothing(tmp_path):
    cache = tiered_cache(4, 8, host_blocks=0, disk=tmp_path)
    compute(cache, new_seq(list(range(1, 10))), 9)
    cache.close()
    other_model = tiered_cache(4, 8, host_blocks=0, disk=tmp_path, fingerprint="1" * 32)
    assert other_model.match_prefix(new_seq(list(range(1, 10)))) == 0
    other_model.close()
    other_layout = tiered_cache(2, 16, host_blocks=0, disk=tmp_path)
    assert other_layout.match_prefix(new_seq(list(range(1, 10)))) == 0
    other_layout.close()


def test_disk_tier_needs_a_fingerprint(tmp_path):
    with pytest.raises(ConfigError, match="fingerprint"):
        tiered_cache(4, 8, host_blocks=0, disk=tmp_path, fingerprint="")


def test_tiers_need_prefix_caching():
    with pytest.raises(ValueError, match="prefix_caching"):
        PagedOptions(prefix_caching=False, host_tier_bytes=2**20)


def test_reset_clears_every_tier(tmp_path):
    cache = tiered_cache(4, 4, host_blocks=4, disk=tmp_path)
    tokens = list(range(1, 14))
    for prompt in (tokens, [50 + i for i in range(13)]):  # the second evicts the first to the host
        seq = new_seq(prompt)
        compute(cache, seq, 13)
        cache.free(seq)
    assert cache.prefix_cache_stats().tiers["host"]["stored_blocks"] > 0
    cache.reset_prefix_cache()
    assert cache.match_prefix(new_seq(tokens)) == 0
    assert not list(tmp_path.rglob("*.kv"))
    cache.close()


# ---------------------------------------------------------------------- the packed block


@pytest.mark.parametrize("fmt,dtype,extras", [("kv", torch.float32, ()), ("kv", torch.int8, ()),
                                              ("kv", torch.bfloat16, (KEY_BOUNDS,)),
                                              ("kv", torch.int8, (KEY_BOUNDS,)), ("latent", torch.float16, ())])
def test_codec_round_trip_is_exact(fmt, dtype, extras):
    """K, V, int8 scales, latents and key bounds of one block come back bit for bit."""
    bs, heads, dim = 8, 1 if fmt == "latent" else 2, 16
    layout = KVLayout(fmt, bs, dtype, frozenset(extras), 4 if extras else None)
    compute_dtype = torch.float32 if dtype == torch.int8 else dtype
    layers = [make_layer_storage(layout, 4 * bs, heads, dim, torch.device("cpu"), compute_dtype) for _ in range(3)]
    for storage in layers:
        k = torch.randn(bs, heads, dim)
        storage.store(k, None if fmt == "latent" else torch.randn(bs, heads, dim), torch.arange(bs, 2 * bs))
    codec = BlockCodec(layers)
    buffer = codec.pack(1, codec.empty())
    codec.unpack(buffer.clone(), 3)
    for storage in layers:
        for name, tensor in vars(storage).items():
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1:
                per_block = tensor.shape[0] // 4
                assert torch.equal(tensor[per_block:2 * per_block], tensor[3 * per_block:]), name
    names = {"c"} if fmt == "latent" else {"k", "v"} | ({"k_scale", "v_scale"} if dtype == torch.int8 else set())
    assert {s.name for s in codec.spans} == names | ({"kmin", "kmax"} if extras else set())


def test_host_tier_evicts_least_recently_used():
    host = HostTier(2, 8, pin=False)
    host.slot_for(b"a").fill_(1)
    host.slot_for(b"b").fill_(2)
    assert host.get(b"a")[0] == 1  # a is now the most recent
    host.slot_for(b"c").fill_(3)
    assert host.last_evicted == b"b" and b"b" not in host and host.get(b"a")[0] == 1 and len(host) == 2


# ---------------------------------------------------------------------- the disk tier


def _disk(path: Path, capacity_blocks: int = 8, fingerprint: bytes = b"f" * 16) -> DiskTier:
    from tessellm.plugins.cache.paged.tiers.disk import HEADER

    return DiskTier(path, fingerprint, capacity_blocks * (HEADER.size + 64), 64)


def _block(value: int) -> torch.Tensor:
    return torch.full((64,), value, dtype=torch.uint8)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip", "foreign", "empty"])
def test_unreadable_file_is_a_logged_miss(tmp_path, caplog, damage):
    disk = _disk(tmp_path)
    disk.write(_key(1), _block(7))
    disk.flush()
    path = disk.path(_key(1))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-10]
    elif damage == "garbage":
        data = bytearray(b"x" * len(data))
    elif damage == "flip":
        data[-1] ^= 0xFF
    elif damage == "foreign":  # a well-formed file of another fingerprint, copied here
        other = _disk(tmp_path / "other", fingerprint=b"g" * 16)
        other.write(_key(1), _block(7))
        other.flush()
        data = bytearray(other.path(_key(1)).read_bytes())
        other.close()
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert disk.read(_key(1)) is None
    assert len([r for r in caplog.records if "unreadable" in r.getMessage()]) == 1
    assert not path.exists() and _key(1) not in disk
    disk.write(_key(1), _block(7))  # and it can be written again
    disk.flush()
    assert torch.equal(disk.read(_key(1)), _block(7))
    disk.close()


def test_disk_tier_stays_under_its_size_and_keeps_recent_blocks(tmp_path):
    disk = _disk(tmp_path, capacity_blocks=3)
    for i in range(3):
        disk.write(_key(i), _block(i))
        disk.flush()
    assert disk.read(_key(0)) is not None  # 0 is now more recent than 1 and 2
    disk.write(_key(3), _block(3))
    disk.flush()
    assert sorted(k for k in range(4) if _key(k) in disk) == [0, 2, 3]
    assert len(list(disk.dir.rglob("*.kv"))) == 3 and disk.stats["evictions"] == 1
    disk.close()
    again = _disk(tmp_path, capacity_blocks=3)  # a restart reads the index and its order back
    assert again.num_blocks == 3 and torch.equal(again.read(_key(3)), _block(3))
    again.close()


def _write_many(path: str, start: int) -> None:
    disk = _disk(Path(path), capacity_blocks=1000)
    for i in range(start, start + 60):
        disk.write(_key(i % 80), _block(i % 80))
    disk.close()


def test_two_processes_on_one_directory_leave_only_whole_files(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), start)) for start in (0, 40)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    disk = _disk(tmp_path, capacity_blocks=1000)
    for i in range(80):
        assert torch.equal(disk.read(_key(i)), _block(i)), i
    assert disk.stats["unreadable"] == 0 and not list(tmp_path.rglob(".tmp-*"))
    disk.close()


def test_tensor_parallel_refuses_tiers_naming_the_options():
    """The ranks must agree on every prefix hit; per-rank tiers could differ (a dropped write)."""
    from types import SimpleNamespace

    from tessellm.core.engine.pipeline import Pipeline

    cache = tiered_cache(4, 8, host_blocks=4, disk=None)
    pipeline = SimpleNamespace(cache=cache, tp=None)
    choice = SimpleNamespace(entry=SimpleNamespace(name="paged"))
    with pytest.raises(ConfigError, match="host_tier_bytes 0, no disk_tier_path"):
        Pipeline._cache_agreed_across_ranks(pipeline, choice, cache.spec, cache.layout)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the copy-stream path")
def test_tiers_on_cuda_copy_on_a_stream_and_read_back_exactly(tmp_path):
    """On CUDA, write-back and loads run on the copy stream: evicted blocks come back from the
    host tier and the disk bit for bit, with the compute stream ordered after the copies."""
    device = torch.device("cuda")
    opts = PagedOptions(block_size=4, num_blocks=4, host_tier_bytes=2 * 4096, disk_tier_path=str(tmp_path))
    spec = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, device=device,
                     max_model_len=4096, fingerprint=FINGERPRINT)
    cache = PagedCache(opts, spec, KVLayout("kv", 4, torch.bfloat16))
    values = {}
    for base in (0, 100):  # the second prompt evicts the first's blocks (2 to the host, all on disk)
        seq = new_seq([base + i for i in range(13)])
        cache.reserve(seq, 13)
        slots = torch.tensor([b * 4 + j for b in cache.block_table(seq) for j in range(4)][:13], device=device)
        for i in range(2):
            kv = torch.randn(13, 2, 64, device=device, dtype=torch.bfloat16)
            cache.layer(i).store(kv, -kv, slots)
            values[(base, i)] = kv[:12].clone()
        seq.num_computed_tokens = 13
        cache.commit(seq)
        cache.free(seq)
    cache.tiers.flush()
    again = new_seq(list(range(13)))
    assert cache.match_prefix(again) == 12
    for i in range(2):
        k, v = cache.layer(i).read(cache.block_table(again), 12)
        assert torch.equal(k, values[(0, i)]) and torch.equal(v, -values[(0, i)])
    tiers = cache.prefix_cache_stats().tiers
    assert tiers["host"]["hit_tokens"] + tiers["disk"]["hit_tokens"] == 12
    cache.close()


def test_a_file_that_cannot_be_opened_is_a_miss(tmp_path, caplog):
    """An I/O error (here a folder where the block file should be) is a logged miss, not a
    failed step."""
    disk = _disk(tmp_path)
    path = disk.path(_key(5))
    path.mkdir(parents=True)
    disk._files[_key(5)] = None
    with caplog.at_level(logging.WARNING):
        assert disk.read(_key(5)) is None
    assert "cannot be read" in caplog.text and _key(5) not in disk._files
    disk.close()
