"""The ledger: the cache as the events describe it, the state every check judges against and the
TUI's block map draws. Fed directly through its appliers, as a suite feeds it after the checks."""

from __future__ import annotations

from kvdoctor.checks import Ledger
from kvdoctor.events import (
    Alloc, Evict, Free, Merge, Recode, Release, Rollback, SeqEnd, SeqStart, Share, Snapshot, SwapIn, SwapOut, Write,
)


def fold(*events, ledger: Ledger | None = None) -> Ledger:
    ledger = ledger or Ledger()
    apply = ledger.appliers()
    for ev in events:
        apply[type(ev)](ev)
    return ledger


def test_alloc_share_release_and_free_keep_owners_tiers_and_counts():
    # GIVEN a block allocated by one sequence and shared by another
    ledger = fold(SeqStart(seq="a", prompt_len=4), SeqStart(seq="b", prompt_len=4),
                  Alloc(block=1, tier="device", seq="a"), Share(block=1, seq="b"))
    # THEN both own it, it sits on the device, and the device counts one block
    assert ledger.owners == {1: {"a", "b"}} and ledger.tier == {1: "device"} and ledger.used == {"device": 1}
    assert ledger.seqs["a"].blocks == ledger.seqs["b"].blocks == {1}
    assert ledger.owner(1) == "a"  # shared: the first by name
    # WHEN one releases it THEN the other still owns it and nothing is orphaned
    fold(Release(block=1, seq="a"), ledger=ledger)
    assert ledger.owners[1] == {"b"} and not ledger.orphans and ledger.seqs["a"].length == 0
    # WHEN it is freed THEN it is gone from every table and the device counts none
    fold(Free(block=1), ledger=ledger)
    assert ledger.owners == {} and ledger.tier == {} and ledger.used == {"device": 0}
    assert ledger.seqs["b"].blocks == set() and ledger.freed_by(1) == Free(block=1)


def test_a_sequence_that_ends_releases_its_blocks_and_leaves_them_orphaned_from_that_step():
    # GIVEN a sequence with two blocks, one swapped to the host
    ledger = fold(SeqStart(seq=7, prompt_len=8), Alloc(block=3, tier="device", seq=7),
                  Alloc(block=4, tier="device", seq=7), SwapOut(block=4, src="device", dst="host", version=0))
    assert ledger.used == {"device": 1, "host": 1}
    # WHEN it ends at step 5 without freeing them
    fold(SeqEnd(seq=7, step=5, reason="aborted"), ledger=ledger)
    # THEN both blocks are allocated with no owner, orphans since step 5, and the sequence is remembered as ended
    assert ledger.owners == {3: set(), 4: set()} and ledger.orphans == {3: 5, 4: 5}
    assert 7 not in ledger.seqs and ledger.ended == {7: 5}
    # WHEN the leak check reports one THEN it moves to the stranded ones; a free forgets it
    ledger.strand(4)
    assert ledger.orphans == {3: 5} and ledger.stranded == {4: 5}
    fold(Free(block=4), ledger=ledger)
    assert ledger.stranded == {} and ledger.used == {"device": 1, "host": 0}


def test_a_sequence_never_announced_still_owns_what_it_allocated_and_releases_it_at_its_end():
    # GIVEN a producer without seq_start (vLLM's KV events)
    ledger = fold(Alloc(block=2, tier="device", seq="r1"))
    # THEN its cached length is unknown, not zero
    assert ledger.seqs["r1"].length is None and ledger.seqs["r1"].blocks == {2}
    # WHEN it ends THEN its block is orphaned as for any sequence
    fold(SeqEnd(seq="r1", step=1), ledger=ledger)
    assert ledger.owners == {2: set()} and ledger.orphans == {2: 1}


def test_swaps_move_a_block_between_tiers_and_ignore_ids_not_allocated():
    ledger = fold(Alloc(block=1, tier="device", seq="a"), SwapOut(block=1, src="device", dst="disk", version=0),
                  SwapIn(block=9, src="host", dst="device", version=0))
    assert ledger.tier == {1: "disk"} and ledger.used == {"device": 0, "disk": 1}
    fold(SwapIn(block=1, src="disk", dst="device", version=0), ledger=ledger)
    assert ledger.tier == {1: "device"} and ledger.used == {"device": 1, "disk": 0}


def test_events_about_blocks_or_owners_it_does_not_know_change_nothing():
    # GIVEN one allocated block
    ledger = fold(Alloc(block=1, tier="device", seq="a"))
    # WHEN a free id is shared, a non-owner releases, and a free id is freed
    fold(Share(block=5, seq="b"), Release(block=1, seq="b"), Free(block=6), ledger=ledger)
    # THEN nothing moved
    assert ledger.owners == {1: {"a"}} and ledger.used == {"device": 1} and not ledger.orphans


def test_an_id_allocated_again_while_allocated_is_counted_once():
    ledger = fold(Alloc(block=1, tier="device", seq="a"), Alloc(block=1, tier="host", seq="b"))
    assert ledger.owners == {1: {"b"}} and ledger.used == {"device": 0, "host": 1}


def test_writes_and_rollbacks_keep_versions_and_cached_lengths():
    # GIVEN a sequence that wrote 6 tokens into two blocks
    ledger = fold(SeqStart(seq="s", prompt_len=6), Alloc(block=1, tier="device", seq="s"),
                  Write(block=1, seq="s", pos=0, n=4, version=4), Alloc(block=2, tier="device", seq="s"),
                  Write(block=2, seq="s", pos=4, n=2, version=6))
    state = ledger.seqs["s"]
    assert (state.version, state.length, ledger.version) == (6, 6, {1: 4, 2: 6})
    # WHEN it rolls back 2 tokens THEN its version advances and its length drops; a count below 1 drops nothing
    fold(Rollback(seq="s", n=2, version=7), Rollback(seq="s", n=0, version=8), ledger=ledger)
    assert (state.version, state.length) == (8, 4)
    # WHEN one of its blocks is evicted THEN its length is no longer known; all gone, it is 0
    fold(Evict(block=2, tier="device", reason="lru"), ledger=ledger)
    assert state.length is None and 2 not in ledger.version
    fold(Free(block=1), ledger=ledger)
    assert state.length == 0


def test_a_block_history_starts_with_its_alloc_and_outlives_its_free_within_the_bound():
    # GIVEN a history of 3 events per block and one freed block kept
    ledger = Ledger(history=3, freed_kept=1)
    fold(Alloc(block=1, tier="device", seq="a"), Write(block=1, seq="a", pos=0, n=1, version=1), Write(block=1, seq="a", pos=1, n=1, version=2),
         Recode(block=1, tier="device", src_codec="fp16", dst_codec="int8", version=2), ledger=ledger)
    # THEN the story keeps the alloc first, then the latest 3 events
    assert [e["kind"] for e in ledger.block_history(1)] == ["alloc", "write", "write", "recode"]
    # WHEN it is freed THEN its last life is still told, ending with the free
    fold(Free(block=1), ledger=ledger)
    assert [e["kind"] for e in ledger.block_history(1)] == ["alloc", "write", "recode", "free"]
    assert ledger.never_allocated() == "never allocated"
    # WHEN a second block is freed THEN the first is forgotten, and "never allocated" is no longer claimed
    fold(Alloc(block=2, tier="device", seq="a"), Free(block=2), ledger=ledger)
    assert ledger.block_history(1) == [] and ledger.freed_by(1) is None and ledger.num_freed_forgotten == 1
    assert "not among the 1 most recently freed blocks" in ledger.never_allocated()


def test_ended_sequences_are_remembered_up_to_the_bound_and_a_restart_forgets_the_end():
    ledger = fold(*(SeqEnd(seq=i, step=i) for i in range(5)), ledger=Ledger(ended_kept=3))
    assert list(ledger.ended) == [2, 3, 4]
    fold(SeqStart(seq=4, prompt_len=1), ledger=ledger)
    assert list(ledger.ended) == [2, 3] and ledger.seqs[4].length == 0


def test_merges_and_recodes_are_told_but_move_nothing():
    ledger = fold(Alloc(block=1, tier="host", seq="a"),
                  Recode(block=1, tier="host", src_codec="fp16", dst_codec="nf4", version=0),
                  Merge(block=1, tier="host", version=0, tokens=4, heads=1, layers=[0], slots=[2]))
    assert ledger.tier == {1: "host"} and ledger.owners == {1: {"a"}} and ledger.used == {"host": 1}
    assert [e["kind"] for e in ledger.block_history(1)] == ["alloc", "recode", "merge"]


def test_ownership_names_the_events_the_tui_applies():
    # THEN exactly the events with an update of owners, tiers or a sequence's blocks are listed
    assert Ledger.OWNERSHIP == {SeqStart, SeqEnd, Alloc, Share, Release, Free, Evict, SwapOut, SwapIn, Snapshot}
    assert Ledger.OWNERSHIP <= set(Ledger().appliers())
