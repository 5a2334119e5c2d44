"""Eviction policies rank candidates; the tier manager decides who is a candidate."""

from __future__ import annotations

from kvdoctor.engine.bus import Bus
from kvdoctor.engine.config import EngineConfig
from kvdoctor.engine.kv.policy import HybridPolicy, Importance, LRUPolicy, make_policy
from kvdoctor.engine.kv.pool import Block, BlockPool


def blk(id, last_access=0, index=0):
    return Block(id, "device", id, index, ["s"], last_access=last_access)


def test_lru_takes_the_least_recently_used_then_the_furthest_back():
    blocks = [blk(0, 5, 0), blk(1, 2, 0), blk(2, 2, 3), blk(3, 9, 1)]
    assert [b.id for b in LRUPolicy().victims(blocks, 3, 10, lambda b: 0.0)] == [2, 1, 0]


def test_hybrid_weights_trade_recency_distance_and_importance():
    blocks = [blk(0, 0, 0), blk(1, 0, 1), blk(2, 9, 2), blk(3, 9, 3)]
    mass = Importance()
    mass.observe(blocks[:1], [10.0])
    distance = {0: 1.0, 1: 0.75, 2: 0.5, 3: 0.25}.__getitem__
    pick = lambda pol, n: [b.id for b in pol.victims(blocks, n, 10, lambda b: distance(b.id))]  # noqa: E731
    # distance only: the block furthest from the newest token
    assert pick(HybridPolicy(0, 1, 0, mass), 1) == [0]
    # an attention sink (high importance) is kept even though it is furthest away
    assert pick(HybridPolicy(0, 1, 1, mass), 2) == [1, 2]
    # recency only: the two old blocks
    assert sorted(pick(HybridPolicy(1, 0, 0, mass), 2)) == [0, 1]


def test_importance_decays_each_observation_and_forgets_a_freed_block():
    # GIVEN a pool whose side table is the attention importance
    pool = BlockPool(EngineConfig(num_layers=1, num_kv_heads=1, head_dim=8, device_blocks=4, host_blocks=0),
                     Bus(), {"device": lambda arena: range(4)})
    mass = Importance()
    pool.track(mass.forget)
    b = pool.alloc("device", "s", 0)
    # WHEN the block is observed twice
    mass.observe([b], [1.0])
    mass.observe([b], [2.0])
    # THEN the first observation decayed once
    assert mass.of(b) == 1.0 * 0.9 + 2.0
    # WHEN it is freed and its id handed out again
    pool.free(b)
    again = pool.alloc("device", "t", 0)
    # THEN the new block starts with no importance
    assert again.id == b.id and mass.of(again) == 0.0


def test_config_chooses_the_policy():
    base = dict(num_layers=1, num_kv_heads=1, head_dim=8)
    assert make_policy(EngineConfig(**base), Importance()).name == "lru"
    p = make_policy(EngineConfig(**base, eviction="hybrid", recency_weight=0.2, distance_weight=0.3, importance_weight=0.5),
                    Importance())
    assert (p.name, p.w_recency, p.w_distance, p.w_importance) == ("hybrid", 0.2, 0.3, 0.5)
