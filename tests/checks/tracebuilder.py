"""A small producer of hand-written traces for the check tests.

The builder keeps its own notion of each sequence's version and length and each block's
tier and version, so by default it writes a *correct* trace; a test then bends exactly one
fact (an old version, a wrong position, a missing free) to trigger one rule, and the same
trace without the bend is the near miss that must stay silent.
"""

from __future__ import annotations

from kvdoctor.checks import make_suite
from kvdoctor.events import (
    Alloc, Attn, Batch, Evict, Free, Read, Recode, Release, Rollback, SeqEnd, SeqStart, Share, StepEnd,
    SwapIn, SwapOut, Usage, Write,
)


class TraceBuilder:
    def __init__(self, block_size: int = 4) -> None:
        self.block_size = block_size
        self.events: list = []
        self.step = 0
        self.t = 0
        self.seq_version: dict = {}
        self.seq_len: dict = {}
        self.block_version: dict = {}
        self.block_tier: dict = {}

    def _emit(self, cls, **fields):
        self.t += 10
        ev = cls(t=self.t, step=self.step, **fields)
        self.events.append(ev)
        return ev

    # sequences
    def start(self, seq, prompt_len=0, stack=None):
        self.seq_version[seq] = 0
        self.seq_len[seq] = 0
        return self._emit(SeqStart, seq=seq, prompt_len=prompt_len, stack=stack)

    def end(self, seq, reason="finished", stack=None):
        return self._emit(SeqEnd, seq=seq, reason=reason, stack=stack)

    # blocks
    def alloc(self, block, seq, tier="device", codec=None, stack=None):
        self.block_tier[block] = tier
        return self._emit(Alloc, block=block, tier=tier, seq=seq, codec=codec, stack=stack)

    def share(self, block, seq, hash=None):
        return self._emit(Share, block=block, seq=seq, hash=hash)

    def release(self, block, seq):
        return self._emit(Release, block=block, seq=seq)

    def free(self, block):
        self.block_tier.pop(block, None)
        return self._emit(Free, block=block)

    def evict(self, block, tier=None, reason="lru"):
        tier = tier or self.block_tier.pop(block)
        return self._emit(Evict, block=block, tier=tier, reason=reason)

    def write(self, block, seq, n=1, *, pos=None, version=None, **extra):
        pos = self.seq_len.get(seq, 0) if pos is None else pos
        if version is None:
            version = self.seq_version.get(seq, 0) + n
        self.seq_version[seq] = version
        self.seq_len[seq] = pos + n
        self.block_version[block] = version
        return self._emit(Write, block=block, seq=seq, pos=pos, n=n, version=version, **extra)

    def read(self, seq, blocks, versions=None, layer=None, **extra):
        versions = [self.block_version[b] for b in blocks] if versions is None else versions
        return self._emit(Read, seq=seq, blocks=list(blocks), versions=list(versions), layer=layer, **extra)

    def swap_out(self, block, dst="host", *, src=None, version=None, codec=None, **extra):
        return self._move(SwapOut, block, dst, src, version, codec, **extra)

    def swap_in(self, block, dst="device", *, src=None, version=None, codec=None, **extra):
        return self._move(SwapIn, block, dst, src, version, codec, **extra)

    def _move(self, cls, block, dst, src, version, codec, **extra):
        src = src or self.block_tier[block]
        self.block_tier[block] = dst
        version = self.block_version.get(block, 0) if version is None else version
        return self._emit(cls, block=block, src=src, dst=dst, version=version, codec=codec, **extra)

    def recode(self, block, src_codec, dst_codec, *, tier=None, version=None, **extra):
        tier = tier or self.block_tier.get(block, "device")
        version = self.block_version.get(block, 0) if version is None else version
        return self._emit(Recode, block=block, tier=tier, src_codec=src_codec, dst_codec=dst_codec, version=version,
                          **extra)

    def rollback(self, seq, n, *, version=None):
        version = self.seq_version[seq] + 1 if version is None else version
        self.seq_version[seq] = version
        self.seq_len[seq] -= n
        return self._emit(Rollback, seq=seq, n=n, version=version)

    def batch(self, rows, n=None, *, positions=None, shape=None):
        n = [1] * len(rows) if n is None else n
        positions = [self.seq_len.get(r, 0) for r in rows] if positions is None else positions
        return self._emit(Batch, rows=list(rows), positions=list(positions), n=list(n), shape=shape)

    def attn(self, seq, layer, max_logit=5.0, entropy=2.0, sink=0.3, nonfinite=0):
        return self._emit(Attn, seq=seq, layer=layer, max_logit=max_logit, entropy=entropy, sink=sink,
                          nonfinite=nonfinite)

    def usage(self, tier, used, capacity=64):
        return self._emit(Usage, tier=tier, used_blocks=used, capacity_blocks=capacity)

    def end_step(self):
        ev = self._emit(StepEnd, num_tokens=1)
        self.step += 1
        return ev

    def next_step(self):
        """Advance the step without a StepEnd (a producer that only bumps ``step``)."""
        self.step += 1

    # running
    def run(self, **suite_args):
        suite = make_suite(**suite_args)
        for ev in self.events:
            suite.observe(ev)
        suite.finish()
        return suite.findings

    def sequence_with_blocks(self, seq, num_blocks, tier="device", first_block=None):
        """Start ``seq`` and fill ``num_blocks`` full blocks of it (ids from ``first_block``)."""
        first = first_block if first_block is not None else 10 * (len(self.seq_len) + 1)
        self.start(seq, prompt_len=num_blocks * self.block_size)
        blocks = list(range(first, first + num_blocks))
        for b in blocks:
            self.alloc(b, seq, tier)
            self.write(b, seq, self.block_size)
        return blocks


def rules(findings) -> list[str]:
    return sorted(f"{f.check}/{f.rule}" for f in findings)

