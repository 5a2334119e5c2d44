"""Weights: K/V served from the prefix cache after the weights that computed them changed.

The RL weight-sync bug (NVIDIA-NeMo/RL #4018, prime-rl #1650, lmdeploy #4917): a trainer updates the
inference engine's weights in place, nobody resets the prefix cache, and the next rollout's prompt hits
blocks computed by weights several updates old. Every token after the hit attends to keys and values
the current model would not produce; nothing crashes and the hit rate looks healthy. A ``weights`` event
marks each change; a block remembers the weights version of its first write, so a hit (``share`` with a
``hash``) on a block written under an older version is stale. A reset of the prefix cache evicts the
cached blocks, so after one no hit can reach old K/V and nothing is reported.

A sequence that goes on reading its own blocks across a change (a transformers cache kept between two
``generate`` calls while the model was trained in between; a vLLM request in flight during a weight sync)
reads K/V of two models at once: a warning, since some RL frameworks accept that on purpose.
"""

from __future__ import annotations

from typing import Sequence

from ..events import PREFIX_CACHE, Evict, Free, Read, SeqEnd, Share, Snapshot, Weights, Write
from ..findings import Finding

from .base import NO_FINDINGS, CheckBase, Rule

__all__ = ["WeightsCheck"]


class WeightsCheck(CheckBase):
    name = "weights"
    RULES = (
        Rule("stale-prefix-hit", "error",
             "a prefix-cache hit took a block computed under older weights, with no reset of the cache since"),
        Rule("stale-read", "warning",
             "a sequence read K/V it computed under weights that changed since (a cache kept across an update)"),
    )

    def __init__(self, ledger=None) -> None:
        super().__init__(ledger)
        self.version = 0
        self.change: Weights | None = None  # the latest change
        self.written_under: dict[int, int] = {}  # block -> weights version of its first write since allocation
        self._stale_hits: dict[object, tuple[int, list[int]]] = {}  # seq -> (weights version, stale blocks it hit)

    def handlers(self):
        return {Weights: self._weights, Write: self._write, Share: self._share, Free: self._gone, Evict: self._gone,
                SeqEnd: self._ended, Read: self._read, Snapshot: self._snapshot}

    def _weights(self, ev: Weights) -> Sequence[Finding]:
        self.version, self.change = ev.version, ev
        return NO_FINDINGS

    def _snapshot(self, ev: Snapshot) -> Sequence[Finding]:
        for b in ev.blocks:  # attached mid-run: what a cache holds was computed by the weights it runs now, or older
            if b.n:
                self.written_under[b.block] = self.version
        return NO_FINDINGS

    def _write(self, ev: Write) -> Sequence[Finding]:
        # the oldest weights among the block's tokens: a block filled across a change holds stale K/V too
        self.written_under.setdefault(ev.block, self.version)
        return NO_FINDINGS

    def _gone(self, ev: Free | Evict) -> Sequence[Finding]:
        self.written_under.pop(ev.block, None)
        return NO_FINDINGS

    def _hit_stale(self, seq: object) -> list[int] | None:
        """The stale blocks ``seq`` hit under the current weights, if its finding is made."""
        hit = self._stale_hits.get(seq)
        return hit[1] if hit is not None and hit[0] == self.version else None

    def _ended(self, ev: SeqEnd) -> Sequence[Finding]:
        self._stale_hits.pop(ev.seq, None)  # its finding keeps the list; memory stays flat
        return NO_FINDINGS

    def _read(self, ev: Read) -> Sequence[Finding]:
        if not self.version or self._hit_stale(ev.seq) is not None:  # never changed; or the hit is the cause
            return NO_FINDINGS
        written = self.written_under
        old = [b for b in ev.blocks if written.get(b, self.version) < self.version]
        if not old or not self.once("stale-read", ev.seq, self.version):
            return NO_FINDINGS
        change = self.change
        return [self.finding(
            "stale-read",
            f"sequence {ev.seq!r} read {len(old)} block(s) ({', '.join(map(str, old[:8]))}) computed under weights "
            f"v{written[old[0]]} at step {ev.step}, but the weights changed at step {change.step} (v{self.version}: "
            f"{change.detail or change.cause}): its K/V mix two models. Start a new cache (or reset) after changing "
            f"the weights",
            seq=ev.seq, block=old[0], step=ev.step, layer=ev.layer, stale_blocks=old, weights_version=self.version,
            changed_at_step=change.step, events=[self.event_dict(change)],
        )]

    def _share(self, ev: Share) -> Sequence[Finding]:
        under = self.written_under.get(ev.block)
        if ev.hash is None or ev.seq == PREFIX_CACHE or under is None or under >= self.version:
            return NO_FINDINGS
        blocks = self._hit_stale(ev.seq)
        if blocks is not None:  # the same request's next stale block: evidence of the one finding, not another
            blocks.append(ev.block)
            return NO_FINDINGS
        if not self.once("stale-prefix-hit", ev.seq, self.version):
            return NO_FINDINGS
        change = self.change
        how = f" ({change.cause}: {change.detail})" if change.detail else f" ({change.cause})"
        blocks = [ev.block]
        self._stale_hits[ev.seq] = (self.version, blocks)
        return [self.finding(
            "stale-prefix-hit",
            f"prefix hit on block {ev.block} by request {ev.seq!r} at step {ev.step}: the block was computed under "
            f"weights v{under}; weights are v{self.version} since step {change.step}{how}, and the prefix cache "
            f"was not reset: its K/V are stale (evidence.stale_blocks lists every such block the request hit). "
            f"Reset the prefix cache after every weight update",
            seq=ev.seq, block=ev.block, step=ev.step, computed_under=under, weights_version=self.version,
            changed_at_step=change.step, cause=change.cause, detail=change.detail, stale_blocks=blocks,
            events=[self.event_dict(ev), self.event_dict(change)], history=self.ledger.block_history(ev.block),
        )]
