"""The built-in routing policies: round-robin's turns, least-load's choice and ties, and
prefix-aware's record (the longest recorded prefix wins while the load is balanced, the
least loaded wins when it is not, memory stays bounded, the same calls give the same choices)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from tessellm.core.interfaces.routing import ReplicaState, RouteRequest
from tessellm.core.registry import get_registry
from tessellm.plugins.routing.prefix_aware import PrefixAware, PrefixRecord, block_hashes


def policy(name: str, num_replicas: int = 3, **options):
    cls = get_registry().get("routing", name).cls
    return cls(cls.Options.model_validate(options), num_replicas)


ROUTED: dict[int, int] = {}
"""Requests routed to each replica index in the running test (what a router's pool counts)."""


@pytest.fixture(autouse=True)
def _fresh_counts():
    ROUTED.clear()


def states(loads: list[int], healthy: list[bool] | None = None) -> list[ReplicaState]:
    return [ReplicaState(i, f"http://r{i}", True, load, ROUTED.get(i, 0)) for i, load in enumerate(loads)
            if healthy is None or healthy[i]]


def route(policy_obj, text: str, replicas: list[ReplicaState]) -> int:
    """What the router does: choose, then tell the policy where the request went."""
    request = RouteRequest(text)
    index = policy_obj.choose(request, replicas)
    policy_obj.routed(request, index)
    ROUTED[index] = ROUTED.get(index, 0) + 1
    return index


def test_round_robin_takes_turns_and_skips_a_replica_not_offered():
    rr = policy("round-robin")
    assert [route(rr, "x", states([0, 0, 0])) for _ in range(4)] == [0, 1, 2, 0]
    assert [route(rr, "x", states([0, 0, 0], [True, False, True])) for _ in range(3)] == [2, 0, 2]


def test_least_load_picks_the_fewest_in_flight_and_spreads_ties():
    ll = policy("least-load")
    assert ll.choose(RouteRequest("x"), states([3, 1, 2])) == 1
    idle = [ReplicaState(0, "a", True, 0, routed=5), ReplicaState(1, "b", True, 0, routed=2)]
    assert ll.choose(RouteRequest("x"), idle) == 1  # the tie goes to the one routed fewer


def test_prefix_aware_keeps_a_tenant_on_its_replica():
    pa = policy("prefix-aware", block_chars=8)
    tenants = [f"system prompt of tenant {t}: " * 10 for t in range(3)]
    first = [route(pa, tenant + "question 0", states([0, 0, 0])) for tenant in tenants]
    assert sorted(first) == [0, 1, 2]  # new prefixes spread over idle replicas
    again = [route(pa, tenant + f"question {q}", states([0, 0, 0])) for q in range(1, 4) for tenant in tenants]
    assert again == first * 3
    assert pa.stats()["routed_by_prefix"] == 9 and 0.5 < pa.stats()["prefix_match_ratio"] < 1


def test_prefix_aware_balances_when_the_load_is_out_of_balance():
    pa = policy("prefix-aware", num_replicas=2, block_chars=8, balance_abs_threshold=2, balance_rel_threshold=1.5)
    text = "a long shared system prompt " * 8
    assert route(pa, text + "q1", states([0, 0])) == 0
    assert route(pa, text + "q2", states([2, 0])) == 0  # 2 - 0 is not above 2: the prefix wins
    assert route(pa, text + "q3", states([3, 0])) == 1  # 3 - 0 > 2 and 3 > 1.5 * 0: balance wins
    assert pa.stats()["routed_for_balance"] == 1


def test_a_replica_down_forgets_its_prefixes():
    pa = policy("prefix-aware", num_replicas=2, block_chars=4)
    text = "shared prefix here, " * 5
    assert route(pa, text, states([0, 0])) == 0
    pa.replica_down(0)
    assert len(pa.records[0]) == 0
    assert route(pa, text, states([0, 0])) == 1  # no record left: the one routed fewer


texts = st.lists(st.text(alphabet="abc", min_size=0, max_size=40), min_size=1, max_size=30)


@given(sent=st.lists(st.tuples(st.integers(0, 2), st.text(alphabet="ab", max_size=40)), max_size=30),
       query=st.text(alphabet="ab", max_size=40))
def test_when_balanced_the_chosen_replica_holds_the_longest_recorded_prefix(sent, query):
    pa = policy("prefix-aware", block_chars=4, match_threshold=0.0)
    for index, text in sent:
        pa.routed(RouteRequest(text), index)
    hashes = block_hashes(query, 4)
    longest = max(pa.records[i].matched(hashes) for i in range(3))
    chosen = pa.choose(RouteRequest(query), states([0, 0, 0]))
    if longest:
        assert pa.records[chosen].matched(hashes) == longest
        # and it holds that prefix: some prompt sent to it starts with the matched text
        prefix = query[:4 * longest]
        assert any(text.startswith(prefix) for index, text in sent if index == chosen)


@given(prompts=texts, max_blocks=st.integers(1, 20))
def test_the_record_never_holds_more_than_max_blocks_and_keeps_prefixes_whole(prompts, max_blocks):
    record = PrefixRecord(max_blocks)
    for text in prompts:
        record.insert(block_hashes(text, 2))
        assert len(record) <= max_blocks
    last = block_hashes(prompts[-1], 2)
    # the last prompt's leading blocks are the most recent: they survive whole, up to max_blocks
    assert record.matched(last) == min(len(last), max_blocks) or len(set(last)) < len(last)


@given(prompts=texts, loads=st.lists(st.integers(0, 20), min_size=3, max_size=3))
def test_the_same_calls_give_the_same_choices(prompts, loads):
    runs = []
    for _ in range(2):
        ROUTED.clear()
        pa = policy("prefix-aware", block_chars=3)
        runs.append([route(pa, text, states(loads)) for text in prompts])
    assert runs[0] == runs[1]


def test_options_are_validated_and_bounded():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        PrefixAware.Options.model_validate({"block_chars": 0})
    with pytest.raises(ValidationError):
        PrefixAware.Options.model_validate({"match_threshold": True})  # a boolean is no number
