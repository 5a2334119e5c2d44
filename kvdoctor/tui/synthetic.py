"""A synthetic serving workload's events: the TUI's test fixture, benchmark load and screenshot.

It plays a small continuous-batching engine by the rules of the event contract
(admission by free device blocks, preemption by swapping a whole sequence to host,
swap-in before attention, one decode token per step, blocks freed at the end), so
the checks find nothing in it unless a ``fault`` is asked for. Seeded, so the same
arguments give the same events, byte for byte, which keeps snapshot tests stable.
No torch: it runs wherever the TUI does.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Iterator

from ..events import (
    Alloc, Attn, Batch, Event, Free, Header, Mem, Read, SeqEnd, SeqStart, StepEnd, SwapIn, SwapOut,
    TierSpec, Usage, Write,
)

__all__ = ["SyntheticWorkload", "FAULTS"]

FAULTS = ("leak-swapped", "stale-version", "attention-nan")
_STEP_NS = 20_000_000


@dataclass
class _Seq:
    seq: int
    prompt_len: int
    target_len: int
    length: int = 0
    version: int = 0
    blocks: list[int] = field(default_factory=list)


@dataclass
class SyntheticWorkload:
    num_steps: int = 200
    seed: int = 0
    block_size: int = 16
    num_layers: int = 4
    device_blocks: int = 24
    host_blocks: int = 192
    max_active: int = 8
    fault: str | None = None
    fault_step: int = 60   # the first step at which the fault may strike
    bytes_per_block: int = 65536
    fresh_ids: bool = False  # a new block id for every allocation (an engine without an id pool), never a reused one

    def header(self) -> Header:
        return Header(
            block_size=self.block_size, num_layers=self.num_layers, model="synthetic", engine="kvdoctor.synthetic",
            tiers=[TierSpec(name="device", capacity_blocks=self.device_blocks),
                   TierSpec(name="host", capacity_blocks=self.host_blocks)],
        )

    def events(self) -> Iterator[Event]:
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"fault must be one of {', '.join(FAULTS)}; got {self.fault!r}")
        rng = random.Random(self.seed)
        tier: dict[int, str] = {}          # block -> tier of its live copy
        version: dict[int, int] = {}       # block -> version of its live copy
        free_ids: list[int] = []
        next_id = 0
        active: list[_Seq] = []
        next_seq = 0
        faulted = False

        counts = {"device": 0, "host": 0}  # blocks per tier, the leaked ones included

        def used(name: str) -> int:
            return counts[name]

        def place(b: int, name: str | None) -> None:
            """Move block ``b``'s live copy to tier ``name`` (None: it is gone)."""
            old = tier.pop(b, None)
            if old is not None:
                counts[old] -= 1
            if name is not None:
                tier[b] = name
                counts[name] += 1

        for step in range(self.num_steps):
            t = step * _STEP_NS
            out: list[Event] = []

            def emit(cls: type[Event], **kw: object) -> None:
                out.append(cls(t=t + len(out), step=step, **kw))

            def new_block(s: _Seq) -> None:
                nonlocal next_id
                if free_ids:
                    b = free_ids.pop()
                else:
                    b, next_id = next_id, next_id + 1
                place(b, "device")
                version[b] = s.version
                s.blocks.append(b)
                emit(Alloc, block=b, tier="device", seq=s.seq)

            def write(s: _Seq, n: int) -> None:
                while n:
                    if s.length == len(s.blocks) * self.block_size:
                        new_block(s)
                    b = s.blocks[-1]
                    k = min(n, len(s.blocks) * self.block_size - s.length)
                    s.version += k
                    version[b] = s.version
                    emit(Write, block=b, seq=s.seq, pos=s.length, n=k, version=s.version)
                    s.length += k
                    n -= k

            # Admission: a new request whenever its prompt fits on the device.
            if len(active) < self.max_active and rng.random() < 0.5:
                prompt = rng.randint(8, 6 * self.block_size)
                need = math.ceil((prompt + 1) / self.block_size)
                if self.device_blocks - used("device") >= need + 2:
                    s = _Seq(next_seq, prompt, prompt + rng.randint(8, 64))
                    next_seq += 1
                    emit(SeqStart, seq=s.seq, prompt_len=prompt)
                    active.append(s)
            rows: list[tuple[_Seq, int, int]] = []  # (sequence, position, tokens) per batch row
            batch_at = len(out)  # the batch is recorded before its writes, as an engine does
            for s in list(active):
                # Bring the sequence's swapped-out blocks back before attention reads them.
                away = [b for b in s.blocks if tier[b] != "device"]
                room = self.device_blocks - used("device")
                n = s.prompt_len if s.length == 0 else 1
                # Room for its swapped-out blocks and for what this step's tokens add: a prompt may
                # need several blocks, a decode step at most one (one is always kept free for it).
                need = len(away) + max(1, -(-(s.length + n) // self.block_size) - len(s.blocks))
                if need > room:
                    scheduled = {r[0].seq for r in rows}
                    victims = [v for v in active if v is not s and v.seq not in scheduled
                               and any(tier[b] == "device" for b in v.blocks)]
                    if not victims:
                        continue
                    v = victims[0]
                    for b in v.blocks:
                        if tier[b] == "device" and used("host") < self.host_blocks:
                            place(b, "host")
                            emit(SwapOut, block=b, src="device", dst="host", version=version[b])
                    if need > self.device_blocks - used("device"):
                        continue
                for b in away:
                    place(b, "device")
                    served = version[b]
                    if self.fault == "stale-version" and not faulted and step >= self.fault_step:
                        served, faulted = served - 1, True
                    emit(SwapIn, block=b, src="host", dst="device", version=served)
                pos = s.length
                write(s, n)
                emit(Read, seq=s.seq, blocks=list(s.blocks), versions=[version[b] for b in s.blocks])
                rows.append((s, pos, n))
                for layer in range(self.num_layers):
                    nan = self.fault == "attention-nan" and step >= self.fault_step and layer == 1 and not faulted
                    # Entropy stays below log(keys): no query of a healthy model can spread more.
                    entropy = min(2.0 + 0.2 * layer + rng.gauss(0, 0.05), 0.9 * math.log(pos + n))
                    emit(Attn, seq=s.seq, layer=layer, max_logit=8.0 + layer + rng.gauss(0, 0.3),
                         entropy=entropy, sink=0.3 + rng.gauss(0, 0.01),
                         nonfinite=4 if nan else 0)
                    if nan:
                        faulted = True
            if rows:
                when = out[batch_at].t if batch_at < len(out) else t + len(out)
                out.insert(batch_at, Batch(t=when, step=step, rows=[s.seq for s, _, _ in rows],
                                           positions=[p for _, p, _ in rows], n=[n for _, _, n in rows]))
            scheduled = {r[0].seq for r in rows}
            for s in list(active):
                # Now and then a client gives up on a request that sits swapped out (preempted).
                swapped = s.seq not in scheduled and s.blocks and all(tier[b] != "device" for b in s.blocks)
                if s.length >= s.target_len or (swapped and rng.random() < 0.2):
                    active.remove(s)
                    emit(SeqEnd, seq=s.seq, reason="finished" if s.length >= s.target_len else "aborted")
                    for b in s.blocks:
                        if self.fault == "leak-swapped" and tier[b] == "host" and step >= self.fault_step:
                            del tier[b]  # forgotten: never freed, its host slot stays taken
                            continue
                        place(b, None)
                        if not self.fresh_ids:
                            free_ids.append(b)
                        emit(Free, block=b)
            for name, cap in (("device", self.device_blocks), ("host", self.host_blocks)):
                emit(Usage, tier=name, used_blocks=used(name), capacity_blocks=cap,
                     bytes=used(name) * self.bytes_per_block)
            emit(Mem, rss=400_000_000 + step * 50_000, py_heap=60_000_000 + step * 10_000,
                 kv_bytes=(used("device") + used("host")) * self.bytes_per_block, source="synthetic")
            emit(StepEnd, num_tokens=sum(n for _, _, n in rows), duration_ns=_STEP_NS)
            yield from out
