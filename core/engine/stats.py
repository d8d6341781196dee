"""What an engine counts as it runs: steps, tokens, preemptions, KV memory, speculation and
async overlap (``EngineStats``), read by the benchmarks, the A/B reports and the server."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

PHASES = ("schedule", "prepare", "forward", "sample", "process")
"""A step's phases: the scheduler's choice; drafts, forks and the packed batch; the model's
forward (with the device's time, waited for); logits processors and the decoder's pick; the
tokens appended, stop rules checked, blocks committed."""

WASTE_SAMPLE_STEPS = 8
"""KV waste is sampled every this many steps: counting used slots walks every live sequence
(bench/host_overhead.py times it), and a run's average needs no more."""


@dataclass
class EngineStats:
    """Counters of one engine since it was built; every field only grows, but
    ``step_seconds`` keeps the most recent steps only."""

    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    peak_kv_blocks: int = 0
    """Most blocks held by live sequences after any step (cached-but-evictable ones excluded)."""
    peak_running: int = 0
    """Most sequences running in one step (the batch size reached)."""
    kv_allocated_slots: int = 0
    kv_used_slots: int = 0
    """Sums of allocated and used KV slots over every ``WASTE_SAMPLE_STEPS``-th step (the
    first included): waste = 1 - used / allocated."""
    sample_slots: int = 0
    """Sequence-steps that produced tokens (one target forward each, verifying any drafts)."""
    draft_tokens: int = 0
    """Draft tokens verified (speculative decoding)."""
    accepted_draft_tokens: int = 0
    """Draft tokens the target accepted."""
    overlapped_steps: int = 0
    """Steps launched before the previous step's tokens reached the host (async scheduling)."""
    device_wait_seconds: float = 0.0
    """Host time spent waiting for launched steps' tokens (async scheduling): near zero over
    a run means the host, not the GPU, set its pace."""
    kernel_builds: int = 0
    """Triton kernel variants built during steps (each stalls its step for a compile; start-up
    warm-up should leave none: see core/engine/warm_up.py). Counted where Triton is in use."""
    image_tokens: int = 0
    """Prompt tokens that were images' placeholders (counted in ``prompt_tokens`` too)."""
    images_encoded: int = 0
    """Images the vision encoder ran on (an image the encoder cache held is not counted)."""
    encoder_cache_hits: int = 0
    """Images whose embeddings came from the encoder cache instead of the encoder."""
    encoder_seconds: float = 0.0
    """Wall time spent in the vision encoder (inside the steps' "prepare" phase)."""
    step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    """Wall time of the most recent steps (bounded: an engine may run for days)."""
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    """Wall time of every step so far by phase (``PHASES``): where the host's time goes."""

    def add_phase(self, phase: str, since: float) -> float:
        """Count the time from ``since`` to now in ``phase``; now (the next phase's start)."""
        now = time.perf_counter()
        self.phase_seconds[phase] += now - since
        return now

    @property
    def kv_waste(self) -> float | None:
        """Share of allocated KV slots holding no token, averaged over steps (None: untracked)."""
        if not self.kv_allocated_slots:
            return None
        return 1.0 - self.kv_used_slots / self.kv_allocated_slots

    @property
    def acceptance_rate(self) -> float | None:
        """Share of draft tokens accepted (None: nothing was drafted)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def tokens_per_forward(self) -> float | None:
        """Mean tokens a sequence gained per target forward that sampled it (1.0 without
        speculation; (1 - a^(k+1)) / (1 - a) for acceptance a and k drafts every step)."""
        if not self.sample_slots:
            return None
        return (self.sample_slots + self.accepted_draft_tokens) / self.sample_slots
