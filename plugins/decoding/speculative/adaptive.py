"""Adaptive draft length: per sequence, the k that maximises expected tokens per unit time.

With per-token acceptance rate a, k drafts yield (1 - a^(k+1)) / (1 - a) tokens per target
forward (Leviathan et al.), and a step costs about 1 + k * (draft_cost + verify_cost) target
decode steps: drafting k tokens, plus verifying k more query tokens (nearly free on a GPU,
where decode is memory-bound; about a tenth of a step each on a CPU). k = 0 switches
speculation off; such a sequence still drafts one token every ``probe_interval`` steps, so
it notices when its text turns predictable (a quote, a copied passage).

The rate is estimated from verification outcomes, each accepted draft a success and the
first rejected one a failure, with exponential forgetting; a new sequence starts from the
rate of all sequences so far.
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(a: float, k: int) -> float:
    """Tokens per target forward with k drafts at acceptance rate a."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def best_k(a: float, k_max: int, step_cost: float) -> int:
    """argmax over k in [0, k_max] of expected_tokens(a, k) / (1 + k * step_cost)."""
    return max(range(k_max + 1), key=lambda k: (expected_tokens(a, k) / (1.0 + k * step_cost), -k))


@dataclass
class _Rate:
    accepted: float
    trials: float
    idle_steps: int = 0

    @property
    def value(self) -> float:
        return self.accepted / self.trials if self.trials else 0.0


class AdaptiveK:
    """Chooses each sequence's draft length from its acceptance history."""

    def __init__(self, k_max: int, step_cost: float, *, decay: float = 0.9, prior: float = 0.6,
                 prior_weight: float = 2.0, probe_interval: int = 16):
        self.k_max, self.step_cost, self.decay = k_max, step_cost, decay
        self.prior_weight, self.probe_interval = prior_weight, probe_interval
        self.overall = _Rate(prior * prior_weight, prior_weight)
        self._rates: dict[int, _Rate] = {}

    def k_for(self, seq_id: int) -> int:
        rate = self._rates.get(seq_id)
        if rate is None:
            a = self.overall.value
            rate = self._rates[seq_id] = _Rate(a * self.prior_weight, self.prior_weight)
        k = best_k(rate.value, self.k_max, self.step_cost)
        if k == 0:
            rate.idle_steps += 1
            if rate.idle_steps >= self.probe_interval:
                rate.idle_steps = 0
                return 1
        return k

    def observe(self, seq_id: int, drafted: int, accepted: int) -> None:
        """Record a verification: ``accepted`` of ``drafted`` drafts kept."""
        if drafted == 0:
            return
        trials = accepted + (1 if accepted < drafted else 0)
        for rate in (self._rates.setdefault(seq_id, _Rate(0.0, 0.0)), self.overall):
            rate.accepted = rate.accepted * self.decay + accepted
            rate.trials = rate.trials * self.decay + trials

    def rate(self, seq_id: int) -> float:
        rate = self._rates.get(seq_id)
        return self.overall.value if rate is None else rate.value

    def forget(self, seq_id: int) -> None:
        self._rates.pop(seq_id, None)
