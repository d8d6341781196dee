"""A deliberately broken cache for the conformance suite's own tests: the paged cache with
copy-on-write left out, so a fork's child writes through to the blocks it shares with its
parent. ``tessellm plugins --check cache:broken-fork`` must fail it, naming the fork property."""

from __future__ import annotations

import tessellm
from tessellm.plugins.cache.paged.manager import PagedCache


class BrokenForkCache(PagedCache):
    """`paged`, but a shared block about to be written is written in place, not copied."""

    name = "broken-fork"
    api_version = "1.1"
    description = "paged without copy-on-write (a conformance-suite test fixture)"
    auto_priority = None

    def _copy_block(self, block: int) -> int:
        return block  # the bug: the child keeps writing into the parent's block


@tessellm.hookimpl
def register_cache(register):
    register(BrokenForkCache)
