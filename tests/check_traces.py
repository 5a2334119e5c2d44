"""Small hand-written traces shared by the session and `kvdoctor check` tests."""

from __future__ import annotations

from pathlib import Path

from kvdoctor import events as E
from kvdoctor.trace import TraceWriter

HEADER = E.Header(block_size=4, num_layers=2, tiers=[
    E.TierSpec(name="device", capacity_blocks=8), E.TierSpec(name="host", capacity_blocks=16)])


def request(seq, block, *, step=0, leak=False, swap=True) -> list[E.Event]:
    """One request of one block: written, swapped out, ended; freed unless ``leak``."""
    evs: list[E.Event] = [
        E.SeqStart(step=step, seq=seq, prompt_len=4),
        E.Alloc(step=step, block=block, tier="device", seq=seq),
        E.Write(step=step, block=block, seq=seq, pos=0, n=4, version=4),
        E.Read(step=step, seq=seq, blocks=[block], versions=[4], layer=0),
    ]
    if swap:
        evs.append(E.SwapOut(step=step, block=block, src="device", dst="host", version=4))
    evs.append(E.SeqEnd(step=step, seq=seq))
    if not leak:
        evs.append(E.Free(step=step, block=block))
    evs.append(E.StepEnd(step=step))
    return evs


def clean_events(num_requests: int = 3) -> list[E.Event]:
    return [ev for i in range(num_requests) for ev in request(f"r{i}", i, step=i)]


def leaky_events() -> list[E.Event]:
    """r0 clean; r1's swapped-out block 1 is never freed (error); r2 clean; plus one warning."""
    evs = request("r0", 0, step=0) + request("r1", 1, step=1, leak=True) + request("r2", 2, step=2)
    evs.append(E.Share(step=3, block=99, seq="r2"))  # accounting/unknown-block: a warning
    return evs


def write_trace(path: Path, events: list[E.Event], *, close: bool = True, header: E.Header = HEADER) -> Path:
    writer = TraceWriter(path, header)
    writer.write_many(events)
    if close:
        writer.close()
    else:
        writer._flush()
    return path


def with_usage(events: list[E.Event], block_bytes: int = 4096) -> list[E.Event]:
    """``events`` with a true ``usage`` reading per tier before each step end (blocks counted from
    the allocs, swaps and frees before it), as an engine reports them."""
    where: dict[int, str] = {}
    out: list[E.Event] = []
    for e in events:
        if isinstance(e, E.Alloc):
            where[e.block] = e.tier
        elif isinstance(e, (E.SwapOut, E.SwapIn)):
            where[e.block] = e.dst
        elif isinstance(e, E.Free):
            where.pop(e.block, None)
        elif isinstance(e, E.StepEnd):
            for spec in HEADER.tiers:
                used = sum(t == spec.name for t in where.values())
                out.append(E.Usage(step=e.step, tier=spec.name, used_blocks=used,
                                   capacity_blocks=spec.capacity_blocks, bytes=used * block_bytes))
        out.append(e)
    return out
