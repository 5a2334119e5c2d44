"""The engine's prefix cache: full blocks found again by their content keys, owned by the cache between
requests, evicted least recently used, hit on slower tiers, never shared while partial; and its events
judged by the same checks as vLLM's prefix cache (zero findings on a clean run)."""

from __future__ import annotations

import pytest
import torch

from kvdoctor.checks import make_suite
from kvdoctor.engine.kv.prefix import content_key
from kvdoctor.events import PREFIX_CACHE

P = list(range(10, 20))  # a 10-token prompt: two full blocks of 4 and a partial one


def start(r, seq, tokens, adapter=None):
    """Admit ``seq`` as the scheduler does: reuse what the cache holds of ``tokens``, compute the rest."""
    r.cache.add_sequence(seq, prompt_len=len(tokens), adapter=adapter)
    hit = r.cache.reuse_prefix(seq, tokens)
    if hit:  # the K/V a hit serves is that of the request that computed the blocks
        donor = next(s for s in r.kv if r.cache.seqs.get(s) is None or s != seq)
        r.kv[seq] = [(k[:hit], v[:hit]) for k, v in r.kv[donor]]
    r.write(seq, len(tokens) - hit, tokens[hit:])
    return hit


def shares(r, seq):
    return [(e.block, e.hash) for e in r.kinds("share") if e.seq == seq]


def clean(r):
    suite = make_suite()
    r.cache.bus.flush()
    suite.observe_many(r.events)
    suite.finish()
    return [f.message for f in suite.findings]


def test_a_request_sharing_a_prefix_reuses_its_full_blocks_and_computes_the_rest(make_cache):
    r = make_cache(prefix_cache=True, device_blocks=8)
    # GIVEN a request whose 10 tokens fill two blocks and part of a third
    assert start(r, "a", P) == 0
    # THEN the two full blocks are registered under their chain keys; the partial one is not
    reg = shares(r, PREFIX_CACHE)
    assert [b for b, _ in reg] == [0, 1]
    assert reg[1][1] == content_key(reg[0][1], P[4:8])
    # WHEN a second request starts with the same 8 tokens and then differs
    assert start(r, "b", P[:8] + [99, 98, 97]) == 8
    # THEN it holds the cached blocks first (hits carrying the same keys), and only its own 3 tokens were written
    assert shares(r, "b") == reg
    assert r.cache.block_table("b")[:2] == [0, 1]
    assert [(e.pos, e.n) for e in r.kinds("write") if e.seq == "b"] == [(8, 3)]
    r.assert_intact("b")
    # AND the step says how many prompt blocks were served and how many computed
    r.cache.end_step()
    (end,) = r.kinds("step_end")
    assert (end.prefix_hits, end.prefix_misses) == (2, 2)
    assert clean(r) == []


def test_a_prompt_ending_on_a_block_boundary_still_computes_its_last_token(make_cache):
    r = make_cache(prefix_cache=True, device_blocks=8)
    start(r, "a", P)
    # WHEN a prompt is exactly the first two cached blocks
    # THEN only the first block is reused: the last token must be computed for its logits
    assert start(r, "b", P[:8]) == 4
    assert r.cache.block_table("b")[0] == 0 and r.cache.block_table("b")[1] != 1
    r.assert_intact("b")


def test_another_adapter_misses_because_the_salt_differs(make_cache):
    r = make_cache(prefix_cache=True, device_blocks=8)
    start(r, "a", P)
    assert start(r, "b", P, adapter="lora-1") == 0
    assert r.cache.stats()["prefix"]["hit_blocks"] == 0


def test_cached_blocks_outlive_their_request_and_the_lru_ones_are_evicted_for_room(make_cache):
    r = make_cache(prefix_cache=True, device_blocks=6, host_blocks=0, disk_blocks=0)
    start(r, "a", P)
    r.cache.end_step()
    # WHEN the request ends THEN its partial block is freed and its full ones stay, owned by the cache
    r.cache.remove_sequence("a")
    r.cache.end_step()
    assert [e.block for e in r.kinds("free")] == [2]
    assert r.cache.reclaimable("device") == 2
    # WHEN a new request needs five of the six device blocks
    start(r, "c", list(range(50, 70)))
    r.cache.end_step()
    # THEN the least recently used cached block (the later one of the chain first) is evicted for it
    assert [(e.block, e.reason) for e in r.kinds("evict")] == [(1, PREFIX_CACHE)]
    assert r.cache.stats()["prefix"]["cached_blocks"] == 1 + 5  # block 0, and c's five full blocks
    # AND a request with the old prefix still hits the block that is left
    assert start(r, "d", P[:4] + [1, 2]) == 4
    assert clean(r) == []


def test_cached_blocks_move_down_a_tier_and_a_hit_there_swaps_them_back_in(make_cache):
    r = make_cache(prefix_cache=True, device_blocks=6, host_blocks=4, disk_blocks=0)
    start(r, "a", P)
    r.cache.end_step()
    r.cache.remove_sequence("a")
    # WHEN another request needs the device room
    start(r, "c", list(range(50, 70)))
    r.cache.remove_sequence("c")
    r.cache.end_step()
    # THEN the least recently used cached block went to host rather than being dropped
    assert [(e.block, e.dst) for e in r.kinds("swap_out")] == [(1, "host")]
    assert r.kinds("evict") == []
    # WHEN a request with their prefix starts THEN it hits both, and the one on host comes back up when read
    assert start(r, "d", P) == 8
    r.assert_intact("d")
    assert [(e.block, e.src, e.dst) for e in r.kinds("swap_in")] == [(1, "host", "device")]
    r.cache.end_step()
    assert clean(r) == []


def test_rolling_back_into_a_cached_block_copies_it_before_writing(make_cache):
    r = make_cache(prefix_cache=True, device_blocks=8)
    start(r, "a", P[:8])
    before = [t.clone() for t in r.cache.gather("a", 0)]
    # WHEN the request takes back 2 tokens of its second (cached) block and writes 2 others
    r.rollback("a", 2)
    r.write("a", 2, [7, 7])
    # THEN it wrote into a private copy; the cached block still holds the registered tokens
    assert r.cache.block_table("a")[1] != 1
    assert [e.block for e in r.kinds("release") if e.seq == "a"] == [1]
    assert start(r, "b", P[:8] + [5]) == 8
    k, _ = r.cache.gather("b", 0)
    assert torch.equal(k[:, :8].cpu(), before[0].cpu())
    r.assert_intact("a")
    assert clean(r) == []


def test_without_a_prefix_cache_nothing_is_reused(make_cache):
    r = make_cache(device_blocks=8)
    start(r, "a", P)
    assert start(r, "b", P) == 0
    assert "prefix" not in r.cache.stats()
    r.cache.end_step()
    assert r.kinds("step_end")[0].prefix_hits is None


def test_reuse_prefix_refuses_a_sequence_that_already_holds_tokens(make_cache):
    r = make_cache(prefix_cache=True)
    start(r, "a", P)
    with pytest.raises(ValueError, match="already holds 10 tokens"):
        r.cache.reuse_prefix("a", P)


def test_a_fork_continues_its_parents_chain_of_keys(make_cache):
    r = make_cache(prefix_cache=True, device_blocks=8)
    start(r, "a", P[:6])
    r.fork("a", "b")
    # WHEN the child fills its second block with its own tokens
    r.write("b", 2, [50, 51])
    # THEN that block is registered under the key of the parent's tokens followed by the child's
    reg = shares(r, PREFIX_CACHE)
    assert reg[-1][1] == content_key(reg[0][1], P[4:6] + [50, 51])
    assert start(r, "c", P[:6] + [50, 51, 9]) == 8
    assert clean(r) == []
