"""The routing-policy contract as properties, written against the interface alone
(``RoutingPolicy``, ``RouteRequest``, ``ReplicaState``): whatever the traffic, the replicas
offered (a subset, as when some are down or a retry excludes one) and their loads, ``choose``
returns the index of an offered replica; the callbacks take any order of routed, finished and
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


@st.composite
def traffic(draw: Any) -> tuple[int, list[tuple[str, list[int], list[int], list[int]]]]:
    """A replica count and a list of (prompt, offered replica indices, in-flight per replica,
    replicas that go down before this request)."""
    n = draw(st.integers(1, MAX_REPLICAS))
    steps = []
    for _ in range(draw(st.integers(1, 25))):
        offered = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
        loads = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
        down = draw(st.lists(st.integers(0, n - 1), max_size=1))
        steps.append((draw(prompts), sorted(offered), loads, down))
    return n, steps


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

    def test_long_prompts_and_many_requests(self):
        """A thousand requests, some of 100 000 characters, over two replicas."""
        self.case()
        policy = self.build(2)
        steps = [(("shared " * 14_000 if i % 10 == 0 else f"prompt {i} ") + str(i), [0, 1], [i % 3, 0], [])
                 for i in range(1000)]
        self.run(policy, steps)
