"""Tiers below `paged`'s device blocks: host memory (host.py) and a disk directory
(disk.py), moved by stack.py, a block packed as bytes by codec.py."""

from __future__ import annotations

import hashlib

import torch

from tessellm.core.errors import ConfigError
from tessellm.core.interfaces.cache import CacheSpec
from tessellm.core.interfaces.kv import KVLayout, KVStorage
from tessellm.plugins.cache.paged.block_pool import BlockPool
from tessellm.plugins.cache.paged.tiers.codec import BlockCodec
from tessellm.plugins.cache.paged.tiers.disk import DiskTier
from tessellm.plugins.cache.paged.tiers.host import HostTier
from tessellm.plugins.cache.paged.tiers.stack import TierStack

FORMAT = "tessellm-kv-tier-1"  # bump when what a block file means changes

__all__ = ["BlockCodec", "DiskTier", "HostTier", "TierStack", "build_tiers", "tier_fingerprint"]


def tier_fingerprint(spec: CacheSpec, layout: KVLayout, codec: BlockCodec) -> bytes:
    """16 bytes naming what a stored block means: the model side (``spec.fingerprint``), the
    layout and every span of the packed block."""
    text = "\x1f".join([FORMAT, spec.fingerprint, repr(layout), codec.schema])
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def build_tiers(options, spec: CacheSpec, layout: KVLayout, pool: BlockPool, layers: list[KVStorage]) -> TierStack:
    """The tiers ``options`` (PagedOptions) ask for, over ``pool`` and its layer storages."""
    codec = BlockCodec(layers)
    host = None
    if options.host_tier_bytes:
        capacity = options.host_tier_bytes // codec.block_bytes
        if capacity < 1:
            raise ConfigError(f"cache.options.host_tier_bytes: {options.host_tier_bytes} bytes hold no block of "
                              f"this model ({codec.block_bytes} bytes each); raise it or set 0")
        try:
            host = HostTier(capacity, codec.block_bytes, pin=spec.device.type == "cuda" and torch.cuda.is_available())
        except RuntimeError as exc:  # pinned memory the OS would not give
            raise ConfigError(f"cache.options.host_tier_bytes: {capacity * codec.block_bytes} bytes of host memory "
                              f"could not be allocated ({exc}); lower it") from exc
    disk = None
    if options.disk_tier_path is not None:
        if not spec.fingerprint:
            raise ConfigError("cache.options.disk_tier_path: this cache was built without a model fingerprint "
                              "(CacheSpec.fingerprint), so blocks on disk could not be told apart from another "
                              "model's; build it through a pipeline, or leave the disk tier off")
        fingerprint = tier_fingerprint(spec, layout, codec)
        try:
            disk = DiskTier(options.disk_tier_path, fingerprint, options.disk_tier_bytes, codec.block_bytes)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cache.options.disk_tier_path: {exc}") from exc
    return TierStack(pool, codec, layout.block_size, host, disk)
