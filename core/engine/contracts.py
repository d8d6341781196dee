"""Run-time checks that the pipeline's plugins keep their contracts.

A broken plugin that raises is reported where it raises (core/model/contract.py). These
checks catch the ones that return quietly with something wrong, which would otherwise show
only as garbage output or a TypeError deep in the engine: each is one ``ContractError`` line
naming the plugin, the rule and the docs section.

Always on (each costs microseconds a step, or runs once):
- attention: the first forward of the engine writes every layer's new cache slots (the
  slots are first filled with a sentinel: NaN, or the integer minimum for integer storage,
  and no slot may still hold it afterwards);
- decoding: ``decode`` returns a list with one list of 1 to drafts + 1 Python ints in the
  logits' range per sample slot; ``device_tokens`` one integer per slot;
- scheduler: an empty batch while requests are unfinished;
- cache: a step's query tokens each get a slot of their own, inside the storage.

``TESSELLM_CHECK_CONTRACTS=1`` checks more, every step: the attention check on every forward,
that no query token's slot holds a computed token of any live sequence (a block handed
to two sequences), and that a logits processor changes no row it was not handed (core/engine/
processors.py, which otherwise hands a third party's processor its own rows only).
"""

from __future__ import annotations

import os
import weakref

import numpy as np
import torch

from tessellm.core.errors import ContractError
from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.interfaces.sequence import Sequence
from tessellm.core.model.contract import describe
from tessellm.core.plugin import Plugin

DOCS = "docs/plugins.md#contract-checks-at-run-time"


def every_step() -> bool:
    """Whether ``TESSELLM_CHECK_CONTRACTS`` asks for the per-step checks."""
    return os.environ.get("TESSELLM_CHECK_CONTRACTS", "").strip().lower() not in ("", "0", "false", "no")


def broken(plugin: Plugin, rule: str) -> ContractError:
    """The one-line error for ``plugin`` breaking ``rule``."""
    return ContractError(f"{describe(plugin)} broke its contract: {rule} (see {DOCS})")


# ---------------------------------------------------------------------- attention


def _raw_tensors(storage) -> list[torch.Tensor]:
    """The tensors a layer's storage keeps a row per slot in, or [] where it exposes none."""
    try:
        return list(storage.kv_tensors())
    except (TypeError, NotImplementedError, AttributeError):  # a storage without plain tensors
        pass
    try:
        return [storage.latent_tensor()]
    except (TypeError, NotImplementedError, AttributeError):
        return []


def _sentinel(t: torch.Tensor) -> float | int:
    return float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min


def _unwritten(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Per slot, whether every value still is the sentinel."""
    rows = t[slots].reshape(slots.numel(), -1)
    return rows.isnan().all(dim=1) if t.is_floating_point() else (rows == _sentinel(t)).all(dim=1)


class KVWriteCheck:
    """Checks that the attention backend stores every layer's new K/V: on the engine's first
    forward, or on every forward with ``TESSELLM_CHECK_CONTRACTS=1``."""

    def __init__(self, backend: Plugin, cache: CacheManager, num_layers: int):
        self.backend = backend
        self.cache = cache
        self.num_layers = num_layers
        self.armed = True  # until a forward passed the check
        self.always = every_step()

    def wanted(self) -> bool:
        return self.armed or self.always

    def _slots(self, batch: BatchMetadata) -> list[torch.Tensor]:
        """Each layer's new slots: its layer group's slot mapping."""
        slots = [batch.slot_mapping] * self.num_layers
        for group, layers in enumerate(self.cache.layer_groups if batch.groups else ()):
            for layer in layers:
                slots[layer] = batch.group(group).slot_mapping
        return slots

    def mark(self, batch: BatchMetadata) -> list[tuple[int, torch.Tensor]]:
        """Fill the batch's new slots with the sentinel in every layer; the tensors filled."""
        marked = []
        held = set(self.cache.spec.held_layers)  # a pipeline stage's cache stores its own layers
        for index, slots in enumerate(self._slots(batch)):
            if index not in held:
                continue
            for t in _raw_tensors(self.cache.layer(index)):
                t[slots] = _sentinel(t)
                marked.append((index, t))
        return marked

    def verify(self, batch: BatchMetadata, marked: list[tuple[int, torch.Tensor]]) -> None:
        """A ContractError naming the first layer whose new slots still hold the sentinel."""
        layer_slots = self._slots(batch)
        for index, t in marked:
            slots = layer_slots[index]
            left = _unwritten(t, slots)
            if bool(left.any()):
                count = int(left.sum())
                raise broken(self.backend, f"forward left {count} of the {slots.numel()} new cache slots of layer "
                                           f"{index} unwritten; a backend stores every query token's K and V in "
                                           f"its slot (batch.slot_mapping) through the layer's KV storage")
        if marked:
            self.armed = False


# ---------------------------------------------------------------------- decoding


def _bad_token(token: object, vocab: int) -> str | None:
    if type(token) is not int:  # bool, numpy and torch integers included: a token is a plain int
        return f"a {type(token).__module__}.{type(token).__qualname__} ({token}), not a Python int"
    if not 0 <= token < vocab:
        return f"token {token}, outside the logits' range [0, {vocab})"
    return None


def check_decoded(decoder: Plugin, tokens: object, batch: BatchMetadata, vocab: int) -> None:
    """``decode``'s return: a list of one list of 1 to drafts + 1 Python ints a sample slot
    (tuples pass too: the engine only iterates them)."""
    slots = batch.samples
    if not isinstance(tokens, (list, tuple)) or len(tokens) != len(slots):
        got = f"a list of {len(tokens)}" if isinstance(tokens, (list, tuple)) else f"a {type(tokens).__name__}"
        raise broken(decoder, f"decode returned {got}; it returns a list with one entry for each of the "
                              f"{len(slots)} sample slots")
    for i, (slot, accepted) in enumerate(zip(slots, tokens)):
        if not isinstance(accepted, (list, tuple)):
            raise broken(decoder, f"decode returned the {type(accepted).__name__} {accepted!r} for sample slot {i}; "
                                  f"each slot's entry is a list of tokens (one for plain decoding)")
        if not 1 <= len(accepted) <= len(slot.draft_tokens) + 1:
            raise broken(decoder, f"decode returned {len(accepted)} tokens for sample slot {i}, which verifies "
                                  f"{len(slot.draft_tokens)} drafts; it returns 1 to drafts + 1 tokens a slot")
        for token in accepted:
            problem = _bad_token(token, vocab)
            if problem is not None:
                raise broken(decoder, f"decode returned {problem} for sample slot {i}")


def check_device_tokens(decoder: Plugin, tokens: object, batch: BatchMetadata) -> None:
    """``device_tokens``' return: an integer tensor with one token a sample slot."""
    want = len(batch.samples)
    if not isinstance(tokens, torch.Tensor) or tokens.shape != (want,) or tokens.is_floating_point():
        got = f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise broken(decoder, f"device_tokens returned {got}; it returns an integer tensor of shape ({want},), "
                              f"one token a sample slot")


# ---------------------------------------------------------------------- scheduler and cache


def idle_scheduler_error(scheduler: Plugin, waiting: int, running: int) -> ContractError:
    return broken(scheduler, f"schedule returned an empty batch while {waiting} requests wait and {running} run; "
                             f"it schedules work whenever any is unfinished (preempting if the cache is full)")


_storage_slots: "weakref.WeakKeyDictionary[CacheManager, int | None]" = weakref.WeakKeyDictionary()


def storage_slots(cache: CacheManager) -> int | None:
    """How many slots the cache's layer storage has (None where it exposes no tensors)."""
    if cache not in _storage_slots:
        tensors = _raw_tensors(cache.layer(0))
        _storage_slots[cache] = int(tensors[0].shape[0]) if tensors else None
    return _storage_slots[cache]


def check_slots(cache: CacheManager, slots: np.ndarray) -> None:
    """A step's query tokens each have a slot of their own inside the storage. (Only a cache
    plugin is held to it: warm-up's scratch tables put every row in one block on purpose.)"""
    if slots.size == 0 or not isinstance(cache, CacheManager):
        return
    num_slots = storage_slots(cache)
    if int(slots.min()) < 0 or (num_slots is not None and int(slots.max()) >= num_slots):
        raise broken(cache, f"a query token's slot is {int(slots.min()) if slots.min() < 0 else int(slots.max())}, "
                            f"outside the storage's [0, {num_slots}): reserve gives every token a block "
                            f"before the step runs")
    if np.unique(slots).size != slots.size:
        values, counts = np.unique(slots, return_counts=True)
        raise broken(cache, f"slot {int(values[counts > 1][0])} was handed to two query tokens of one step; "
                            f"every token's slot is its own")


def query_slots(batch: BatchMetadata) -> np.ndarray:
    """The slot of every query token of ``batch``, from its host-side fields."""
    bs = batch.block_size
    out = []
    for table, seq_len, q_len in zip(batch.block_tables_cpu, batch.seq_lens_cpu, batch.query_lens_cpu):
        pos = np.arange(seq_len - q_len, seq_len, dtype=np.int64)
        out.append(np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs)
    return np.concatenate(out) if out else np.empty(0, dtype=np.int64)


def check_slots_not_held(cache: CacheManager, slots: np.ndarray, live: list[Sequence]) -> None:
    """Per step, with ``TESSELLM_CHECK_CONTRACTS``: no query token writes a slot that holds a
    computed token of a live sequence (its own earlier tokens, or another's)."""
    bs = cache.layout.block_size
    held = []
    for seq in live:
        table = np.asarray(cache.block_table(seq), dtype=np.int64)
        pos = np.arange(min(seq.num_computed_tokens, table.size * bs), dtype=np.int64)
        held.append(table[pos // bs] * bs + pos % bs)
    clash = np.intersect1d(slots, np.concatenate(held) if held else np.empty(0, dtype=np.int64))
    if clash.size:
        raise broken(cache, f"slot {int(clash[0])} is a query token's while it holds a computed token of a live "
                            f"sequence; a block holding computed tokens is never handed out again until freed")
