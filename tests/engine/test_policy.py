"""Eviction policies rank candidates; the tier manager decides who is a candidate."""

from __future__ import annotations

from kvdoctor.engine.config import EngineConfig
from kvdoctor.engine.kv.policy import HybridPolicy, LRUPolicy, make_policy
from kvdoctor.engine.kv.pool import Block


def blk(id, last_access=0, index=0, importance=0.0):
    return Block(id, "device", id, index, ["s"], last_access=last_access, importance=importance)


def test_lru_takes_the_least_recently_used_then_the_furthest_back():
    blocks = [blk(0, 5, 0), blk(1, 2, 0), blk(2, 2, 3), blk(3, 9, 1)]
    assert [b.id for b in LRUPolicy().victims(blocks, 3, 10, lambda b: 0.0)] == [2, 1, 0]


def test_hybrid_weights_trade_recency_distance_and_importance():
    blocks = [blk(0, 0, 0, importance=10.0), blk(1, 0, 1), blk(2, 9, 2), blk(3, 9, 3)]
    distance = {0: 1.0, 1: 0.75, 2: 0.5, 3: 0.25}.__getitem__
    pick = lambda pol, n: [b.id for b in pol.victims(blocks, n, 10, lambda b: distance(b.id))]  # noqa: E731
    # distance only: the block furthest from the newest token
    assert pick(HybridPolicy(0, 1, 0), 1) == [0]
    # an attention sink (high importance) is kept even though it is furthest away
    assert pick(HybridPolicy(0, 1, 1), 2) == [1, 2]
    # recency only: the two old blocks
    assert sorted(pick(HybridPolicy(1, 0, 0), 2)) == [0, 1]


def test_config_chooses_the_policy():
    base = dict(num_layers=1, num_kv_heads=1, head_dim=8)
    assert make_policy(EngineConfig(**base)).name == "lru"
    p = make_policy(EngineConfig(**base, eviction="hybrid", recency_weight=0.2, distance_weight=0.3, importance_weight=0.5))
    assert (p.name, p.w_recency, p.w_distance, p.w_importance) == ("hybrid", 0.2, 0.3, 0.5)
