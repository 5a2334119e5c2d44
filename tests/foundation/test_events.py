"""The v1 event contract: every kind round-trips, and readers tolerate what they do not know."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor import events as E

seq_ids = st.one_of(st.integers(0, 2**40), st.text(min_size=1, max_size=12))
ints = st.integers(0, 2**53)
tiers = st.sampled_from(E.TIERS)
floats = st.floats(allow_nan=False, allow_infinity=False, width=64)
int_lists = st.lists(ints, max_size=8)
codecs = st.sampled_from(["fp16", "bf16", "int8", "nf4"])
common = {"t": ints, "step": ints}


@st.composite
def _attn_steps(draw) -> E.AttnStep:
    """A step's statistics: every grid ``layers x rows``, one row per seq."""
    seqs = draw(st.lists(seq_ids, max_size=3))
    layers = draw(st.integers(0, 3))

    def grid(cell):
        return st.lists(st.lists(cell, min_size=len(seqs), max_size=len(seqs)), min_size=layers, max_size=layers)

    return E.AttnStep(seqs=seqs, max_logit=draw(grid(floats)), entropy=draw(grid(floats)), sink=draw(grid(floats)),
                      nonfinite=draw(grid(ints)), heads_entropy=draw(st.none() | grid(st.lists(floats, max_size=3))),
                      t=draw(ints), step=draw(ints))


def _strategy(cls: type[E.Event]) -> st.SearchStrategy[E.Event]:
    if cls is E.AttnStep:
        return _attn_steps()
    fields = {
        E.SeqStart: dict(seq=seq_ids, prompt_len=ints, stack=st.none() | st.lists(st.text(max_size=30), max_size=3)),
        E.SeqEnd: dict(seq=seq_ids, reason=st.sampled_from(["finished", "aborted"]),
                       error=st.none() | st.sampled_from(["StorageError", "ChecksumMismatch"])),
        E.Alloc: dict(block=ints, tier=tiers, seq=seq_ids, codec=st.none() | codecs),
        E.Share: dict(block=ints, seq=seq_ids),
        E.Release: dict(block=ints, seq=seq_ids),
        E.Free: dict(block=ints),
        E.Evict: dict(block=ints, tier=tiers, reason=st.text(max_size=10)),
        E.Write: dict(block=ints, seq=seq_ids, pos=ints, n=ints, version=ints),
        E.Read: dict(seq=seq_ids, blocks=int_lists, versions=int_lists, layer=st.none() | ints,
                     tiers=st.none() | st.lists(tiers, max_size=8)),
        E.SwapOut: dict(block=ints, src=tiers, dst=tiers, version=ints, codec=st.none() | codecs),
        E.SwapIn: dict(block=ints, src=tiers, dst=tiers, version=ints, codec=st.none() | codecs),
        E.Recode: dict(block=ints, tier=tiers, src_codec=codecs, dst_codec=codecs, version=ints),
        E.Rollback: dict(seq=seq_ids, n=ints, version=ints),
        E.Batch: dict(rows=st.lists(seq_ids, max_size=6), positions=int_lists, n=int_lists,
                      shape=st.none() | int_lists),
        E.Attn: dict(seq=seq_ids, layer=ints, max_logit=floats, entropy=floats, sink=floats, nonfinite=ints,
                     heads_entropy=st.none() | st.lists(floats, max_size=4)),
        E.Usage: dict(tier=tiers, used_blocks=ints, capacity_blocks=ints, bytes=st.none() | ints),
        E.Mem: dict(rss=st.none() | ints, py_heap=st.none() | ints, kv_bytes=st.none() | ints),
        E.StepEnd: dict(num_tokens=ints, duration_ns=ints),
        E.ChecksumError: dict(block=ints, tier=tiers, expected=ints, actual=ints),
        E.IoError: dict(tier=tiers, op=st.text(max_size=10), message=st.text(max_size=20),
                        errno=st.none() | ints, path=st.none() | st.text(max_size=10), blocks=int_lists),
        E.Prefetch: dict(blocks=int_lists, src=tiers, dst=tiers),
        E.Stage: dict(seq=seq_ids, blocks=int_lists, srcs=st.lists(tiers, max_size=8), versions=int_lists, bytes=ints),
        E.PrefetchUse: dict(seq=seq_ids, hits=int_lists, misses=int_lists),
        E.Merge: dict(block=ints, tier=tiers, version=ints, tokens=ints, heads=ints, layers=int_lists, slots=int_lists,
                      digest=st.none() | st.integers(0, 2**64 - 1), new_digest=st.none() | st.integers(0, 2**64 - 1)),
        E.TraceEnd: dict(reason=st.text(max_size=10)),
        E.ObserverError: dict(producer=st.sampled_from(["vllm", "transformers"]), part=st.text(max_size=20),
                              error=st.text(max_size=10), message=st.text(max_size=30),
                              where=st.none() | st.text(max_size=20), stopped=st.booleans()),
        E.Weights: dict(version=ints, cause=st.sampled_from(["update", "load", "wake"]),
                        detail=st.none() | st.text(max_size=20), digest=st.none() | st.text(max_size=16)),
        E.TransferStart: dict(transfer=st.text(max_size=10), op=st.sampled_from(["save", "load"]), blocks=int_lists,
                              seq=st.none() | seq_ids, lease_steps=st.none() | ints),
        E.TransferDone: dict(transfer=st.text(max_size=10)),
        E.TransferFailed: dict(transfer=st.text(max_size=10), reason=st.none() | st.text(max_size=10)),
        E.Adapter: dict(op=st.sampled_from(["load", "reload", "unload"]), name=st.text(max_size=10),
                        adapter_id=seq_ids, load=ints, path=st.none() | st.text(max_size=10)),
        E.Truncate: dict(op=st.sampled_from(["crop", "reset"]), keep=ints, length=ints, layer=st.none() | ints),
        E.Padding: dict(seq=seq_ids, slots=int_lists, nonfinite=ints, layer=st.none() | ints),
        E.Snapshot: dict(
            seqs=st.lists(st.builds(E.SnapSeq, seq=seq_ids, prompt_len=ints, length=ints, version=ints,
                                    adapter=st.none() | st.text(max_size=8)), max_size=3),
            blocks=st.lists(st.builds(E.SnapBlock, block=ints, tier=tiers, owners=st.lists(seq_ids, max_size=3),
                                      seq=seq_ids, pos=ints, n=ints, version=ints, codec=st.none() | codecs,
                                      hash=st.none() | st.text(max_size=16)), max_size=4)),
    }[cls]
    return st.builds(cls, **fields, **common)


any_event = st.one_of([_strategy(cls) for cls in E.KNOWN_EVENTS])


def test_every_known_kind_has_a_strategy_and_a_unique_tag():
    # GIVEN the contract's classes THEN each kind tag is unique and covers docs/trace-format.md's vocabulary
    assert len(E.KINDS) == len(E.KNOWN_EVENTS)
    for kind in ("seq_start", "seq_end", "alloc", "share", "release", "free", "evict", "write", "read",
                 "swap_out", "swap_in", "rollback", "batch", "attn", "usage", "mem"):
        assert kind in E.KINDS


@settings(deadline=None, max_examples=300)
@given(any_event)
def test_round_trip_single(event):
    # WHEN an event is encoded and decoded THEN it comes back equal, with its kind on the wire
    line = E.encode(event)
    assert b"\n" not in line
    assert E.decode(line) == event
    assert E.to_dict(event)["kind"] == event.__struct_config__.tag


@settings(deadline=None, max_examples=100)
@given(st.lists(any_event, max_size=20))
def test_round_trip_lines(events):
    buf = E.encode_lines(events)
    assert buf.count(b"\n") == len(events)
    assert E.decode_lines(buf) == events


def test_unknown_kind_is_kept_whole():
    # GIVEN a producer's own kind THEN it decodes as Unknown with every field, and encodes back the same
    ev = E.decode(b'{"kind":"gpu_sync","t":7,"step":3,"stream":2,"note":"x"}')
    assert ev == E.Unknown(kind="gpu_sync", t=7, step=3, fields={"stream": 2, "note": "x"})
    assert E.decode(E.encode(ev)) == ev


def test_unknown_fields_are_ignored():
    ev = E.decode(b'{"kind":"free","t":1,"step":2,"block":5,"future_field":[1,2]}')
    assert ev == E.Free(t=1, step=2, block=5)


@pytest.mark.parametrize("line", [
    b'{"kind":"free","t":1,"step":2}',                 # missing required field
    b'{"kind":"free","t":1,"step":2,"block":"five"}',  # wrong type
    b'{"kind":"alloc","block":1,"tier":"gpu","seq":1}',  # tier outside the vocabulary
    b'{"t":1}',                                        # no kind at all
    b'not json',
])
def test_invalid_known_events_are_errors(line):
    with pytest.raises(msgspec.DecodeError):
        E.decode(line)


def test_events_are_immutable():
    ev = E.Free(block=1)
    with pytest.raises(AttributeError):
        ev.block = 2  # type: ignore[misc]


def test_an_attn_step_stands_for_its_attn_events_and_keeps_non_finite_statistics():
    # GIVEN a step's statistics of two rows at two layers, one of them not finite
    step = E.AttnStep(t=5, step=3, seqs=["a", 7], max_logit=[[1.0, 2.0], [3.0, float("nan")]],
                      entropy=[[0.1, 0.2], [0.3, 0.4]], sink=[[0.5, 0.6], [0.7, float("inf")]],
                      nonfinite=[[0, 0], [0, 9]], heads_max_logit=[[[1.0], [2.0]], [[3.0], [4.0]]])
    # WHEN it is written and read back
    back = E.decode(E.encode(step))
    # THEN it gives the attn events of every layer and row, layer by layer, non-finite values as NaN
    rows = back.rows()
    assert [(r.layer, r.seq) for r in rows] == [(0, "a"), (0, 7), (1, "a"), (1, 7)]
    assert rows[1] == E.Attn(t=5, step=3, seq=7, layer=0, max_logit=2.0, entropy=0.2, sink=0.6, nonfinite=0,
                             heads_max_logit=[2.0])
    last = rows[3]
    assert last.nonfinite == 9 and last.max_logit != last.max_logit and last.sink != last.sink


def test_an_attn_step_whose_grids_do_not_fit_its_rows_is_an_invalid_event():
    # GIVEN a line whose statistics have two rows for one seq THEN the reader refuses it
    with pytest.raises(msgspec.ValidationError, match="one per seq"):
        E.decode(b'{"kind":"attn_step","seqs":[1],"max_logit":[[1.0,2.0]],"entropy":[[0.1]],"sink":[[0.5]],'
                 b'"nonfinite":[[0]]}')
