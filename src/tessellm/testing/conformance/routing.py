"""The routing-policy contract as properties, written against the interface alone
(``RoutingPolicy``, ``RouteRequest``, ``ReplicaState``): whatever the traffic, the replicas
offered (a subset, as when some are down or a retry excludes one) and their loads (idle,
equal, one far busier: where fallbacks take over), ``choose`` returns the index of an offered
replica, an int (not the ``ReplicaState``), on every path; the callbacks take any order of routed, finished and
down replicas; ``stats`` are finite numbers; the same calls give the same choices (a policy
that draws at random seeds itself from its options); and long prompts, many of them, do not
break it. That its memory stays bounded is for the policy's own tests (the suite cannot see
inside it)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from hypothesis import given, strategies as st

from tessellm.core.interfaces.routing import ReplicaState, RouteRequest, RoutingContext, RoutingPolicy
from tessellm.testing.conformance.base import ConformanceSuite, property_settings

MAX_REPLICAS = 6

prompts = st.one_of(st.text(alphabet="abc ", max_size=200),
                    st.builds(lambda head, tail: head * 20 + tail, st.sampled_from(["sys A: ", "sys B: "]),
                              st.text(alphabet="xyz", max_size=20)))
"""Prompts: short random texts, and long ones sharing one of two system prompts."""


loads_of = {
    "spread": lambda n: st.lists(st.integers(0, 50), min_size=n, max_size=n),
    "idle": lambda n: st.just([0] * n),
    "equal": lambda n: st.integers(0, 10_000).map(lambda load: [load] * n),
    "one hot": lambda n: st.tuples(st.integers(0, n - 1), st.integers(100, 100_000)).map(
        lambda hot: [hot[1] if i == hot[0] else 0 for i in range(n)]),
    "huge": lambda n: st.lists(st.integers(0, 1_000_000), min_size=n, max_size=n),
}
"""In-flight counts per replica, of every shape a policy's branches test: spread, all idle,
all equal, one replica far busier than the rest (where load-balancing fallbacks take over),
and very large."""


@st.composite
def traffic(draw: Any) -> tuple[int, list[tuple[str, list[int], list[int], list[int]]]]:
    """A replica count and a list of (prompt, offered replica indices, in-flight per replica,
    replicas that go down before this request). Prompts repeat (prefix matches), loads take
    every shape of ``loads_of``, and offers range from every replica to one."""
    n = draw(st.integers(1, MAX_REPLICAS))
    seen: list[str] = []
    steps = []
    for _ in range(draw(st.integers(1, 25))):
        offered = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
        loads = draw(st.sampled_from(sorted(loads_of)).flatmap(lambda shape: loads_of[shape](n)))
        down = draw(st.lists(st.integers(0, n - 1), max_size=1))
        text = draw(st.sampled_from(seen)) if seen and draw(st.booleans()) else draw(prompts)
        seen.append(text)
        steps.append((text, sorted(offered), loads, down))
    return n, steps


def scenarios(n: int) -> dict[str, list[tuple[str, list[int], list[int], list[int]]]]:
    """Fixed traffic over ``n`` replicas that drives a policy down each kind of path: cold,
    idle and empty prompts; one prompt sent again and again (a prefix match), then with its
    replica busy, down, or not offered (a retry); every load but one far higher; a single
    replica offered."""
    every = list(range(n))
    shared = "system: you are a helpful assistant. " * 8
    out = {
        "cold": [(f"prompt {i}", every, [0] * n, []) for i in range(4)],
        "empty prompts": [("", every, [i % 3] * n, []) for i in range(4)],
        "repeated prompt": [(shared + "question", every, [0] * n, []) for _ in range(6)],
        "imbalanced": [(shared + f"q{i}", every, [0 if j == i % n else 10_000 for j in every], []) for i in range(6)],
        "one offered": [(shared + f"q{i}", [i % n], [5] * n, []) for i in range(4)],
    }
    if n > 1:
        out["matched replica busy"] = out["repeated prompt"] + [(shared + "question", every,
                                                                  [100_000] + [0] * (n - 1), [])] * 3
        out["matched replica down"] = out["repeated prompt"] + [(shared + "question", every[1:], [0] * n, [0])] * 3
        out["retry elsewhere"] = out["repeated prompt"] + [(shared + "question", every[1:], [0] * n, [])] * 3
    return out


class RoutingConformance(ConformanceSuite):
    """The contract every routing policy honours (core/interfaces/routing.py), checked on the
    plugin named by ``plugin`` (or ``plugin_class``) with ``options``."""

    kind = "routing"
    max_examples: ClassVar[int] = 30

    def build(self, num_replicas: int) -> RoutingPolicy:
        cls = self.under_test()
        reasons = cls.unsupported_reasons(RoutingContext(num_replicas))
        if reasons:
            import pytest

            pytest.skip(f"routing plugin {cls.name!r} declares {num_replicas} replicas unsupported: "
                        f"{'; '.join(reasons)}")
        return cls(self.plugin_options(), num_replicas)

    @staticmethod
    def run(policy: RoutingPolicy, steps: list[tuple[str, list[int], list[int], list[int]]]) -> list[int]:
        """Route every step as a router would; the indices chosen."""
        routed: dict[int, int] = {}
        chosen = []
        for i, (text, offered, loads, down) in enumerate(steps):
            for index in down:
                policy.replica_down(index)
            request = RouteRequest(text, "model", i % 2 == 0, "/v1/completions")
            states = [ReplicaState(j, f"http://replica-{j}", True, loads[j], routed.get(j, 0)) for j in offered]
            index = policy.choose(request, states)
            assert type(index) is int, (
                f"choose returned {type(index).__name__} {index!r} for request {i} ({text[:40]!r}, loads {loads}, "
                f"offered {offered}): it returns the chosen replica's index, an int (replica.index, e.g. "
                f"tessellm.least_loaded(replicas).index)")
            assert index in offered, (f"choose returned {index!r}, not one of the offered replicas {offered} "
                                      f"(request {i}: {text[:40]!r})")
            policy.routed(request, index)
            routed[index] = routed.get(index, 0) + 1
            policy.finished(request, index, ok=i % 3 != 0)
            chosen.append(index)
        return chosen

    @property_settings(max_examples=30)
    @given(case=traffic())
    def test_choose_returns_an_offered_replica(self, case):
        self.case()
        n, steps = case
        self.run(self.build(n), steps)

    @property_settings(max_examples=20)
    @given(case=traffic())
    def test_the_same_calls_give_the_same_choices(self, case):
        self.case()
        n, steps = case
        assert self.run(self.build(n), steps) == self.run(self.build(n), steps), \
            "two fresh policies routed the same requests differently"

    @property_settings(max_examples=20)
    @given(case=traffic())
    def test_stats_are_finite_numbers_by_name(self, case):
        self.case()
        n, steps = case
        policy = self.build(n)
        self.run(policy, steps)
        stats = policy.stats()
        assert isinstance(stats, dict)
        for name, value in stats.items():
            assert isinstance(name, str) and name, f"stat name {name!r}"
            assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), \
                f"stat {name!r} is {value!r}, not a finite number"

    def test_every_kind_of_path_returns_an_offered_index(self):
        """Fixed traffic down each kind of path a policy has (``scenarios``: cold, empty
        prompts, prefix matches, a busy, down or excluded matched replica, imbalanced loads,
        one replica offered), for 1 to ``MAX_REPLICAS`` replicas: an int index every time."""
        for n in range(1, MAX_REPLICAS + 1):
            for name, steps in scenarios(n).items():
                self.case()
                self.run(self.build(n), steps)

    def test_long_prompts_and_many_requests(self):
        """A thousand requests, some of 100 000 characters, over two replicas."""
        self.case()
        policy = self.build(2)
        steps = [(("shared " * 14_000 if i % 10 == 0 else f"prompt {i} ") + str(i), [0, 1], [i % 3, 0], [])
                 for i in range(1000)]
        self.run(policy, steps)
