"""Adaptive draft length: per sequence, the k that maximises expected tokens per unit time.

With per-token acceptance rate a, k drafts yield (1 - a^(k+1)) / (1 - a) tokens per target
forward (Leviathan et al.). A step with k drafts per sequence costs about 1 + k * (draft_cost
+ verify share) target decode steps: drafting k tokens, plus verifying k more query tokens
per sequence. Verification is nearly free while the forward is bound by reading weights (a
GPU at small batches) and costs more as the batch makes it compute-bound. With
``verify_cost`` v, the time of one more query token in a one-sequence step relative to that
step, one more token per sequence at batch B is taken to cost v * sqrt(B) of the step (at
most 1), which fits what bench/spec_costs.py measures (docs/benchmarks.md, "Speculative
decoding") better than a cost linear in the batch, which ignores that wider matrix products
run more efficiently. So speculation that pays alone may not pay in a large batch.

k = 0 switches speculation off; such a sequence still drafts one token after
``probe_interval`` idle steps, so it notices when its text turns predictable (a quote, a
copied passage); each probe that leaves it off doubles its wait (up to 16x). Where even
perfect acceptance would gain under 5%, nothing is drafted or probed.

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


def verify_share(verify_cost: float, batch_size: int) -> float:
    """Cost of one more query token per sequence, relative to the step, at ``batch_size``."""
    return min(1.0, verify_cost * max(batch_size, 1) ** 0.5)


@dataclass
class _Rate:
    accepted: float
    trials: float
    idle_steps: int = 0
    backoff: int = 1

    @property
    def value(self) -> float:
        return self.accepted / self.trials if self.trials else 0.0


class AdaptiveK:
    """Chooses each sequence's draft length from its acceptance history and the batch size."""

    def __init__(self, k_max: int, draft_cost: float, verify_cost: float, *, decay: float = 0.9,
                 prior: float = 0.6, prior_weight: float = 2.0, probe_interval: int = 16):
        self.k_max, self.draft_cost, self.verify_cost, self.decay = k_max, draft_cost, verify_cost, decay
        self.prior_weight, self.probe_interval = prior_weight, probe_interval
        self.overall = _Rate(prior * prior_weight, prior_weight)
        self._rates: dict[int, _Rate] = {}

    def step_cost(self, batch_size: int) -> float:
        """Cost of one more draft per sequence, relative to a plain step, at ``batch_size``."""
        return self.draft_cost + verify_share(self.verify_cost, batch_size)

    def hopeless(self, batch_size: int) -> bool:
        """Whether drafting cannot pay even if every draft were accepted."""
        cost = self.step_cost(batch_size)
        return max(expected_tokens(1.0, k) / (1.0 + k * cost) for k in range(1, self.k_max + 1)) < 1.05

    def k_for(self, seq_id: int, batch_size: int = 1) -> int:
        """Draft length for ``seq_id`` in a step decoding ``batch_size`` sequences."""
        if self.hopeless(batch_size):
            return 0
        rate = self._rates.get(seq_id)
        if rate is None:
            a = self.overall.value
            rate = self._rates[seq_id] = _Rate(a * self.prior_weight, self.prior_weight)
        k = best_k(rate.value, self.k_max, self.step_cost(batch_size))
        if k == 0:
            rate.idle_steps += 1
            if rate.idle_steps >= self.probe_interval * rate.backoff:
                rate.idle_steps = 0
                rate.backoff = min(rate.backoff * 2, 16)  # reset once a probe turns drafting back on
                return 1
        else:
            rate.backoff = 1
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
