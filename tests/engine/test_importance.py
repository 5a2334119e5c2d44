"""Importance eviction (H2O, StreamingLLM): sinks and the local window always stay; evicted blocks emit `evict`."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor.engine.features.importance import ImportanceEviction, choose_victims, protected_blocks


@settings(deadline=None, max_examples=200)
@given(
    scores=st.lists(st.floats(0, 100, allow_nan=False), min_size=0, max_size=40),
    budget=st.integers(0, 40), sink=st.integers(0, 4), local=st.integers(1, 6),
    mode=st.sampled_from(["h2o", "streaming"]),
)
def test_victims_never_include_the_sinks_or_the_local_window(scores, budget, sink, local, mode):
    # WHEN a policy picks victims to get within the budget
    victims = choose_victims(mode, scores, budget, sink, local)
    n = len(scores)
    keep = protected_blocks(n, sink, local)
    # THEN no sink or local-window block is among them, and as many go as needed (or as are allowed)
    assert not set(victims) & keep
    assert len(victims) == min(max(n - budget, 0), n - len(keep))
    assert victims == sorted(set(victims))


def test_streaming_drops_the_oldest_and_h2o_the_least_attended():
    scores = [9.0, 1.0, 5.0, 0.5, 7.0, 3.0, 2.0]
    assert choose_victims("streaming", scores, 4, 1, 2) == [1, 2, 3]
    assert choose_victims("h2o", scores, 4, 1, 2) == [1, 2, 3]  # every candidate but the one of 7.0
    assert choose_victims("h2o", scores, 5, 1, 2) == [1, 3]  # 1.0 and 0.5 are the least attended


def test_enforce_evicts_through_the_cache_with_the_policy_as_reason(make_cache):
    # GIVEN a sequence of 8 blocks and an H2O policy that keeps 4
    r = make_cache(device_blocks=16)
    r.add("a", 30)  # 8 blocks of 4, the last one partial
    ids = r.cache.block_table("a")
    imp = ImportanceEviction(r.cache, mode="h2o", budget_blocks=4, sink_blocks=1, local_blocks=2)
    imp.observe("a", ids, torch.tensor([5.0, 0.1, 4.0, 0.2, 0.3, 3.0, 0.0, 0.0]))
    # WHEN it enforces the budget
    gone = imp.enforce(["a"])
    # THEN the least attended blocks outside the sink and window are evicted, one `evict` each
    assert gone == [ids[1], ids[3], ids[4], ids[5]]
    assert r.cache.block_table("a") == [ids[0], ids[2], ids[6], ids[7]]
    ev = r.kinds("evict")
    assert [e.block for e in ev] == gone and {e.reason for e in ev} == {"h2o"}
    # AND what attention still reads is intact, evicted blocks skipped
    r.assert_intact("a")
    r.write("a", 3)
    r.assert_intact("a")
    r.cache.pool.check()
