"""Cache `paged`: the manager (manager.py) over a block pool with reference counts and LRU
eviction (block_pool.py) and a content index of full blocks for prefix sharing
(prefix_cache.py)."""

import tessellm
from tessellm.plugins.cache.paged.block_pool import BlockPool
from tessellm.plugins.cache.paged.manager import PagedCache, PagedOptions, bytes_per_block
from tessellm.plugins.cache.paged.prefix_cache import PrefixCache, block_key

__all__ = ["BlockPool", "PagedCache", "PagedOptions", "PrefixCache", "block_key", "bytes_per_block"]


@tessellm.hookimpl
def register_cache(register):
    register(PagedCache)
