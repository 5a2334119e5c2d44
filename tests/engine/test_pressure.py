"""The engine under pressure (issue 17, part 6): requests arriving faster than the device tier holds, a
disk that fills in the middle of a swap, a spill file deleted or cut short under the engine, a slow disk.

In each case the scheduler keeps serving what it can, fails only the requests whose K/V was lost (with
the engine's typed error, an ``io_error`` event and ``seq_end.error``), releases their blocks, and every
check over the recorded trace stays silent: no false leak, no stale read, no accounting gap.

The failures are injected where the disk arena meets the operating system: ``os.posix_fallocate`` (the
call that reserves a spill file's bytes), the spill files themselves (unlinked, truncated), and
``os.pwritev``/``os.preadv`` (the calls that move a swap's bytes) for a slow disk and a write or read that fails.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import threading
import time

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from kvdoctor.engine.errors import ChecksumMismatch, StorageError
from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.engine.serving.runner import Runner
from kvdoctor.engine.serving.scheduler import Request, Scheduler
from kvdoctor.engine.kv.storage import DISK_ALIGN, DiskArena
from kvdoctor.events import IoError, Prefetch, Rollback, SeqEnd, SwapIn, SwapOut, Usage

from engine_support import findings_of

NEW = 6
EOS = 2


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_llama().model


def _prompts(n: int, seed: int = 0, longest: int = 14) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 120) for _ in range(rng.randrange(3, longest))] for _ in range(n)]


_references: dict[tuple[int, ...], list[int]] = {}


@torch.no_grad()
def _reference(model, prompt: list[int]) -> list[int]:
    """Greedy decoding by transformers alone, recomputing the whole sequence each token (no cache at all)."""
    key = tuple(prompt)
    if key not in _references:
        ids = list(prompt)
        for _ in range(NEW):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        _references[key] = ids[len(prompt):]
    return _references[key]


def _same_as_alone(model, prompt: list[int], got: list[int]) -> bool:
    """The tokens a request got are those transformers gives it alone (up to an end-of-sequence token)."""
    ref = _reference(model, prompt)
    return got == ref[: len(got)] and (len(got) == NEW or got[-1] == EOS)


class Engine:
    """A tiny-model runner and scheduler tracing to a file; ``check()`` runs every check over that file."""

    def __init__(self, model, tmp_path, monkeypatch, **config) -> None:
        self.trace = tmp_path / "run.kvtrace"
        monkeypatch.setenv("KVDOCTOR_TRACE", str(self.trace))
        config = {"block_size": 4, "chunk_blocks": 2, "disk_dir": str(tmp_path), "prefetch_depth": 0, **config}
        self.runner = Runner.create(model, **config)
        monkeypatch.delenv("KVDOCTOR_TRACE")
        self.sched = Scheduler(self.runner, max_batch=4)
        self.prompts: dict = {}

    def submit(self, prompt: list[int], priority: int = 0):
        seq = self.sched.submit(Request(prompt, max_new_tokens=NEW, priority=priority))
        self.prompts[seq] = prompt
        return seq

    @property
    def disk(self) -> DiskArena:
        return self.runner.cache.arenas["disk"]

    def check(self) -> tuple[list, list]:
        """Close the engine; the trace's events and every finding over them."""
        self.runner.close()
        _, events, findings = findings_of(self.trace)
        return events, findings


def _of(events, cls) -> list:
    return [e for e in events if isinstance(e, cls)]


# ---- (a) requests arriving faster than the device tier can hold ----

def test_requests_arriving_faster_than_the_device_holds_are_all_served(model, tmp_path, monkeypatch):
    # GIVEN a device tier of 10 blocks, a host of 6, and 3 new requests every step for 6 steps (~60 blocks of work)
    eng = Engine(model, tmp_path, monkeypatch, device_blocks=10, host_blocks=6, disk_blocks=64)
    prompts = iter(_prompts(18))
    seqs = []
    while eng.sched.has_work() or len(seqs) < 18:
        if len(seqs) < 18:
            seqs += [eng.submit(next(prompts), priority=len(seqs) % 3) for _ in range(3)]
        eng.sched.step()
    done = eng.sched.done
    events, findings = eng.check()
    # THEN the scheduler queued and preempted (swapped out, or dropped to recompute) rather than refusing
    assert _of(events, SwapOut) and (_of(events, SwapIn) or _of(events, Rollback))
    # AND no request was lost or failed, and each got the tokens it gets alone
    assert sorted(done) == sorted(seqs)
    assert all(done[s].finish_reason in ("length", "stop") for s in seqs)
    assert all(_same_as_alone(model, eng.prompts[s], done[s].token_ids) for s in seqs)
    # AND the device tier never held more than its capacity, and every check is silent
    assert max(u.used_blocks for u in _of(events, Usage) if u.tier == "device") <= 10
    assert findings == []


# ---- (b) disk full in the middle of a swap ----

def _file_bytes(config, blocks: int) -> int:
    """Bytes of spill file that ``blocks`` slots take: each slot is padded to a 4 KiB boundary (O_DIRECT)."""
    return blocks * (-(-config.bytes_per_block // DISK_ALIGN) * DISK_ALIGN)


class SmallDisk:
    """A filesystem with room for ``capacity`` bytes of spill files: ``posix_fallocate`` (the call the disk
    arena reserves a spill file's bytes with) fails with ENOSPC past it, as a full disk does."""

    def __init__(self, monkeypatch, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self._real = os.posix_fallocate
        monkeypatch.setattr(os, "posix_fallocate", self)

    def __call__(self, fd: int, offset: int, size: int) -> None:
        if self.used + size > self.capacity:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._real(fd, offset, size)
        self.used += size


def test_a_disk_that_fills_mid_swap_undoes_the_swap_and_the_caller_fails_only_that_sequence(
        make_cache, monkeypatch):
    # GIVEN room on disk for one chunk (2 blocks) and a sequence of 4 blocks to swap there
    r = make_cache(device_blocks=8, host_blocks=0, disk_blocks=8, chunk_blocks=2)
    SmallDisk(monkeypatch, _file_bytes(r.cache.config, 2))
    r.add("a", 16)
    r.add("b", 8)
    r.cache.end_step()
    before = {b.id: (b.tier, b.slot) for b in r.cache.pool.blocks.values()}
    # WHEN the swap reaches the second chunk and the disk is full
    with pytest.raises(StorageError) as exc:
        r.cache.swap_out(r.cache.block_table("a"), "disk")
    # THEN the error is typed, with its errno; the first chunk's two blocks did not move either
    assert exc.value.errno == errno.ENOSPC and exc.value.blocks == ()
    assert {b.id: (b.tier, b.slot) for b in r.cache.pool.blocks.values()} == before
    (ev,) = r.kinds("io_error")
    assert (ev.tier, ev.op, ev.errno, ev.blocks) == ("disk", "grow", errno.ENOSPC, [])
    r.cache.pool.check()
    # AND when the caller fails that sequence, the other one is intact and the disk still takes what fits
    r.cache.remove_sequence("a", reason="aborted", error=type(exc.value).__name__)
    r.cache.end_step()
    r.cache.swap_out(r.cache.block_table("b")[:2], "disk")
    r.assert_intact("b")
    r.cache.pool.check()


def test_a_write_failing_in_the_middle_of_a_swap_gives_back_every_slot(make_cache, monkeypatch):
    # GIVEN a disk that fails the second write of a swap (one per chunk; as an unbuffered spill file reports ENOSPC)
    r = make_cache(device_blocks=8, host_blocks=0, disk_blocks=8, chunk_blocks=2)
    r.add("a", 16)
    r.cache.end_step()
    real_write = os.pwritev
    calls = []

    def failing_write(fd, buffers, pos):
        calls.append(pos)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, buffers, pos)

    monkeypatch.setattr(os, "pwritev", failing_write)
    before = {b.id: (b.tier, b.slot) for b in r.cache.pool.blocks.values()}
    free = r.cache.pool.slots["disk"].num_free
    # WHEN the swap fails after its first write
    with pytest.raises(StorageError) as exc:
        r.cache.swap_out(r.cache.block_table("a"), "disk")
    # THEN nothing was booked, every disk slot is free again, and the failure is an io_error
    assert exc.value.errno == errno.ENOSPC and exc.value.op.startswith("write") and exc.value.path.endswith(".kv")
    assert {b.id: (b.tier, b.slot) for b in r.cache.pool.blocks.values()} == before
    assert r.cache.pool.slots["disk"].num_free == free
    assert [e.op for e in r.kinds("io_error")] == ["write"]
    monkeypatch.undo()
    r.assert_intact("a")
    r.cache.pool.check()


def test_a_full_disk_under_a_serving_scheduler_falls_back_to_recompute(model, tmp_path, monkeypatch):
    # GIVEN a device of 8 blocks, no host, and a disk with room for one chunk of 2 blocks
    eng = Engine(model, tmp_path, monkeypatch, device_blocks=8, host_blocks=0, disk_blocks=32)
    SmallDisk(monkeypatch, _file_bytes(eng.runner.cache.config, 2))
    seqs = [eng.submit(p, priority=i % 2) for i, p in enumerate(_prompts(6, seed=3, longest=24))]
    # WHEN it serves more than the device holds, preempting to a disk that fills up
    done = eng.sched.run()
    events, findings = eng.check()
    # THEN the full disk was met and recorded, and the preempted requests were recomputed instead
    full = _of(events, IoError)
    assert full and all((e.op, e.errno, e.blocks) == ("grow", errno.ENOSPC, []) for e in full)
    assert _of(events, Rollback)
    # AND every request was served with its own tokens; the checks find nothing
    assert all(done[s].finish_reason in ("length", "stop") for s in seqs)
    assert all(_same_as_alone(model, eng.prompts[s], done[s].token_ids) for s in seqs)
    assert findings == []


def test_a_prefetch_whose_read_fails_leaves_the_block_where_it_was(make_cache, monkeypatch):
    # GIVEN a sequence on disk, and a disk whose reads fail on the prefetch thread (an I/O error)
    r = make_cache(device_blocks=8, host_blocks=0, disk_blocks=8, chunk_blocks=2, prefetch_depth=4)
    r.add("a", 8)
    r.cache.end_step()
    r.cache.swap_out(r.cache.block_table("a"), "disk")
    real_read = os.preadv

    def failing_read(fd, buffers, pos):
        if threading.current_thread().name.startswith("kvdoctor-prefetch"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_read(fd, buffers, pos)

    monkeypatch.setattr(os, "preadv", failing_read)
    free = r.cache.pool.slots["device"].num_free
    # WHEN the prefetch is booked at the end of the step
    assert r.cache.prefetch("a") == 2
    r.cache.mover.drain()
    r.cache.end_step()
    # THEN its device slots are free again, the blocks are still on disk, and each failure is an io_error
    assert r.cache.pool.slots["device"].num_free == free and not r.cache.mover.inflight
    assert all(r.cache.pool.blocks[b].tier == "disk" for b in r.cache.block_table("a"))
    assert [(e.op, e.errno) for e in r.kinds("io_error")] == [("read", errno.EIO)] * 2
    r.cache.pool.check()
    # AND the swap-in that needs them reads them on the caller's thread
    r.assert_intact("a")


# ---- (c) a spill file deleted or cut short under the engine ----

def _until_on_disk(eng: Engine, max_steps: int = 50) -> list:
    """Step until some request is swapped out with blocks on disk; those requests."""
    for _ in range(max_steps):
        eng.sched.step()
        away = [lv.seq for lv in eng.sched.live.values() if lv.state == "swapped"
                and any(b.tier == "disk" for b in eng.runner.cache.seqs[lv.seq].blocks)]
        if away:
            return away
    raise AssertionError("no request was swapped out to disk")


def test_spill_files_unlinked_under_the_engine_keep_serving(model, tmp_path, monkeypatch):
    # GIVEN requests swapped out to disk
    eng = Engine(model, tmp_path, monkeypatch, device_blocks=8, host_blocks=0, disk_blocks=32)
    seqs = [eng.submit(p, priority=i % 2) for i, p in enumerate(_prompts(6, seed=2))]
    _until_on_disk(eng)
    # WHEN someone deletes the whole spill directory (a tmp cleaner)
    shutil.rmtree(eng.disk.dir)
    done = eng.sched.run()
    events, findings = eng.check()
    # THEN the blocks already spilled are still read (the mappings hold the files), new chunks cannot be
    # made (io_error, ENOENT) and the preemptions that needed them recompute instead; nobody fails
    assert all(done[s].finish_reason in ("length", "stop") for s in seqs)
    assert all(_same_as_alone(model, eng.prompts[s], done[s].token_ids) for s in seqs)
    assert any(e.src == "disk" for e in _of(events, SwapIn))
    gone = _of(events, IoError)
    assert gone and all(e.errno == errno.ENOENT and e.blocks == [] for e in gone)
    assert findings == []


def test_a_spill_file_cut_short_fails_only_the_requests_whose_blocks_it_held(model, tmp_path, monkeypatch):
    # GIVEN requests swapped out to disk
    eng = Engine(model, tmp_path, monkeypatch, device_blocks=8, host_blocks=0, disk_blocks=32)
    seqs = [eng.submit(p, priority=i % 2) for i, p in enumerate(_prompts(6, seed=3))]
    _until_on_disk(eng)
    cache = eng.runner.cache
    # WHEN the spill file of the first chunk is truncated to nothing
    path = eng.disk.path(0)
    os.truncate(path, 0)
    hit = {b.id for b in cache.pool.blocks.values() if b.tier == "disk" and b.slot < eng.disk.chunk}
    victims = {o for b in hit for o in cache.pool.blocks[b].owners}
    assert hit and victims
    done = eng.sched.run()
    whole = os.path.getsize(path) == _file_bytes(cache.config, eng.disk.chunk)
    events, findings = eng.check()
    # THEN exactly the requests owning blocks of that file fail, with the typed error naming the blocks
    failed = {s for s in seqs if done[s].finish_reason == "error"}
    assert failed == victims and set(seqs) - failed
    for s in failed:
        err = done[s].error
        assert isinstance(err, StorageError) and err.tier == "disk" and set(err.blocks) == hit
    # AND the loss is one io_error naming those blocks, and each failed request's seq_end says why
    (lost,) = [e for e in _of(events, IoError) if e.blocks]
    assert set(lost.blocks) == hit and lost.errno is None
    ends = {e.seq: e for e in _of(events, SeqEnd)}
    assert all(ends[s].reason == "aborted" and ends[s].error == "StorageError" for s in failed)
    # AND every other request was served with its own tokens, the file was made whole again ...
    assert whole
    for s in set(seqs) - failed:
        assert done[s].finish_reason in ("length", "stop")
        assert _same_as_alone(model, eng.prompts[s], done[s].token_ids)
    # ... and the checks find nothing: the lost blocks were released and freed, not leaked
    assert findings == []


def test_a_spill_file_cut_while_a_prefetch_waits_is_not_read(make_cache, monkeypatch):
    # GIVEN two sequences on disk, one per spill file, and a prefetch thread busy with the first one
    r = make_cache(device_blocks=8, host_blocks=0, disk_blocks=8, chunk_blocks=2, prefetch_depth=4)
    r.add("a", 8)
    r.add("b", 8)
    r.cache.end_step()
    r.cache.swap_out(r.cache.block_table("a"), "disk")
    r.cache.swap_out(r.cache.block_table("b"), "disk")
    disk = r.cache.arenas["disk"]
    b_blocks = [r.cache.pool.blocks[i] for i in r.cache.block_table("b")]
    assert {b.slot // disk.chunk for b in b_blocks} == {1}
    busy, real_read = threading.Event(), os.preadv

    def held_read(fd, buffers, pos):
        if threading.current_thread().name.startswith("kvdoctor-prefetch"):
            busy.wait(10)
        return real_read(fd, buffers, pos)

    monkeypatch.setattr(os, "preadv", held_read)
    assert r.cache.prefetch("a") == 2 and r.cache.prefetch("b") == 2
    # WHEN b's spill file is cut to nothing while b's prefetch is still queued
    os.truncate(disk.path(1), 0)
    busy.set()
    r.cache.mover.drain()
    r.cache.end_step()
    # THEN the prefetch did not read it (no SIGBUS): it failed, and b's blocks stayed on disk
    assert all(b.tier == "disk" for b in b_blocks)
    assert [e.op for e in r.kinds("io_error")] == ["read", "read"]
    # AND the swap-in that needs them finds the cut and names exactly b's blocks; a is intact
    with pytest.raises(StorageError) as exc:
        r.cache.ensure_resident(["b"])
    assert sorted(exc.value.blocks) == sorted(b.id for b in b_blocks)
    r.cache.remove_sequence("b", reason="aborted", error="StorageError")
    r.cache.end_step()
    r.assert_intact("a")
    r.cache.pool.check()


def test_a_corrupt_spill_block_fails_only_its_request_and_is_the_only_finding(model, tmp_path, monkeypatch):
    # GIVEN requests swapped out to disk
    eng = Engine(model, tmp_path, monkeypatch, device_blocks=8, host_blocks=0, disk_blocks=32)
    seqs = [eng.submit(p, priority=i % 2) for i, p in enumerate(_prompts(6, seed=3))]
    (victim, *_) = _until_on_disk(eng)
    cache = eng.runner.cache
    blk = next(b for b in cache.seqs[victim].blocks if b.tier == "disk")
    # WHEN someone scribbles over one of its blocks in the spill file
    chunk, local = divmod(blk.slot, eng.disk.chunk)
    with open(eng.disk.path(chunk), "r+b") as fh:
        fh.seek(local * eng.disk.stride + 64)
        fh.write(b"\xde\xad\xbe\xef")
    done = eng.sched.run()
    events, findings = eng.check()
    # THEN that request fails with the typed error, the corrupt copy is never served, the others run on
    assert [s for s in seqs if done[s].finish_reason == "error"] == [victim]
    assert isinstance(done[victim].error, ChecksumMismatch) and done[victim].error.block == blk.id
    for s in set(seqs) - {victim}:
        assert _same_as_alone(model, eng.prompts[s], done[s].token_ids)
    # AND the only finding is the checksum mismatch itself: no leak of the failed request's blocks
    assert [(f.check, f.rule, f.block) for f in findings] == [("accounting", "checksum-mismatch", blk.id)]


# ---- (d) a slow disk ----

def _slowed(call):
    def slow(fd, buffers, pos):
        time.sleep(0.02)
        return call(fd, buffers, pos)
    return slow


def test_a_slow_disk_slows_the_engine_but_changes_nothing(model, tmp_path, monkeypatch):
    # GIVEN every access to a spill file taking 20 ms, and prefetching from disk on
    for name in ("preadv", "pwritev"):
        monkeypatch.setattr(os, name, _slowed(getattr(os, name)))
    eng = Engine(model, tmp_path, monkeypatch, device_blocks=8, host_blocks=0, disk_blocks=32, prefetch_depth=4)
    seqs = [eng.submit(p, priority=i % 2) for i, p in enumerate(_prompts(6, seed=4))]
    # WHEN it serves more than the device holds
    done = eng.sched.run()
    events, findings = eng.check()
    # THEN prefetches from the slow disk were still in flight when their step ended and landed later ...
    started = {b: e.step for e in _of(events, Prefetch) if e.src == "disk" for b in e.blocks}
    landed = [e for e in _of(events, SwapIn) if e.src == "disk" and e.block in started]
    assert any(e.step > started[e.block] for e in landed)
    # ... and still every request got its own tokens, nothing failed, and the checks find nothing
    assert all(done[s].finish_reason in ("length", "stop") for s in seqs)
    assert all(_same_as_alone(model, eng.prompts[s], done[s].token_ids) for s in seqs)
    assert not _of(events, IoError) and findings == []


# ---- all of it at once, at random ----

@settings(max_examples=8, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
# (the device holds the longest request: 23 prompt tokens and 6 new ones need 8 blocks)
@given(data=st.data(), num=st.integers(3, 8), device=st.integers(8, 12), host=st.sampled_from([0, 4]),
       disk_chunks=st.none() | st.integers(0, 3), cut_at=st.none() | st.integers(1, 10),
       per_step=st.integers(1, 4), seed=st.integers(0, 1000))
def test_whatever_the_disk_does_every_request_ends_and_only_lost_ones_fail(
        model, tmp_path_factory, data, num, device, host, disk_chunks, cut_at, per_step, seed):
    # GIVEN requests arriving a few per step at a small device, a disk that may be small, and maybe, at some
    # step, the first spill file cut to nothing
    tmp = tmp_path_factory.mktemp("random")
    mp = pytest.MonkeyPatch()
    try:
        eng = Engine(model, tmp, mp, device_blocks=device, host_blocks=host, disk_blocks=32,
                     prefetch_depth=data.draw(st.sampled_from([0, 4])))
        if disk_chunks is not None:
            SmallDisk(mp, _file_bytes(eng.runner.cache.config, disk_chunks * 2))
        pending = _prompts(num, seed=seed, longest=24)
        victims: set = set()
        step = 0
        while pending or eng.sched.has_work():
            for _ in range(min(per_step, len(pending))):
                eng.submit(pending.pop(), priority=data.draw(st.integers(0, 2)))
            if step == cut_at and eng.disk.num_slots:
                cache = eng.runner.cache
                cache.mover.drain()  # (a file cut while a prefetch reads it faults: docs/reliability.md, limits)
                # a block whose prefetch has copied it is safe on the device: only the others are lost
                hit = [b for b in cache.pool.blocks.values()
                       if b.tier == "disk" and b.slot < eng.disk.chunk and b.inflight is None]
                victims = {o for b in hit for o in b.owners}
                os.truncate(eng.disk.path(0), 0)
            eng.sched.step()
            step += 1
        done = eng.sched.done
        eng.runner.cache.pool.check()
        events, findings = eng.check()
    finally:
        mp.undo()
    # THEN every request ended; exactly those owning a block the cut took failed, with StorageError
    assert len(done) == num and all(g.finish_reason in ("length", "stop", "error") for g in done.values())
    failed = {s for s, g in done.items() if g.finish_reason == "error"}
    assert failed == victims
    assert all(isinstance(done[s].error, StorageError) for s in failed)
    # AND the others got their own tokens, and no check finds anything
    for s in set(done) - failed:
        assert _same_as_alone(model, eng.prompts[s], done[s].token_ids)
    assert findings == []
