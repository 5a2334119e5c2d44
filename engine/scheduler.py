"""Continuous batching: which sequences run each step, and which wait, swapped out, for room.

Requests arrive and leave at any step. Each step the scheduler ranks every live
request by priority (higher first), then arrival, and runs as many as fit the
device tier's blocks and the batch limits; a request it does not pick that still
holds device blocks is preempted when the picked ones need the room: its blocks
are swapped out to host (or disk when host is full), or, when no slower tier has
room, dropped and recomputed from its tokens later. A preempted request resumes,
its blocks swapped back in, as soon as it ranks among those that fit again.

Everything is recorded by the cache and runner: ``batch``, ``write``, ``read``,
``attn``, ``swap_out``/``swap_in``, ``rollback`` and the lifecycle events.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..events import SeqId
from .config import Tier
from .errors import ChecksumMismatch
from .runner import Generation, Runner, SamplingParams, sample

__all__ = ["Request", "Scheduler", "StepResult"]


@dataclass
class Request:
    """One generation request. ``priority``: larger runs first and is preempted last."""

    prompt_ids: list[int]
    max_new_tokens: int = 32
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # run to max_new_tokens even past the model's end-of-sequence token (benchmarks)
    seq: SeqId | None = None  # the id in events; assigned by the scheduler when None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("Request.prompt_ids: must hold at least one token")
        if self.max_new_tokens < 1:
            raise ValueError(f"Request.max_new_tokens={self.max_new_tokens}: must be >= 1")


@dataclass
class _Live:
    request: Request
    seq: SeqId
    order: int  # arrival order, the tie-breaker after priority
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    generator: torch.Generator | None = None
    state: str = "waiting"  # waiting (no KV yet), running (KV on device), swapped (KV away), dropped (recompute)

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.generated

    @property
    def rank(self) -> tuple[int, int]:
        return (-self.request.priority, self.order)


@dataclass
class StepResult:
    """What one step did."""

    step: int
    rows: list[SeqId]
    num_tokens: int
    new_tokens: dict[SeqId, int]
    finished: list[Generation]
    preempted: list[SeqId]


class Scheduler:
    """Continuous batching over one ``Runner``.

    ``max_batch``: rows per step. ``max_step_tokens``: tokens per step; a longer prompt is
    prefilled in chunks. ``keep_logits`` keeps each generated token's fp32 logits (tests).
    ``on_token(seq, token)`` is called for every generated token (streaming).
    """

    def __init__(self, runner: Runner, *, max_batch: int = 8, max_step_tokens: int = 2048,
                 keep_logits: bool = False, on_token: Callable[[SeqId, int], None] | None = None) -> None:
        if max_batch < 1 or max_step_tokens < 1:
            raise ValueError(f"max_batch={max_batch}, max_step_tokens={max_step_tokens}: both must be >= 1")
        self.runner = runner
        self.cache = runner.cache
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.keep_logits = keep_logits
        self.on_token = on_token
        self.live: dict[SeqId, _Live] = {}
        self.done: dict[SeqId, Generation] = {}
        self._order = itertools.count()
        self._ids = itertools.count()
        self._eos = frozenset(runner.eos_token_ids)
        self.capacity = self.cache.config.capacity(Tier.DEVICE)
        # long context: a sequence may hold blocks in every tier
        self.total_capacity = sum(self.cache.config.capacity(t) for t in self.cache.config.tiers)

    # ---- requests in and out ----
    def submit(self, request: Request) -> SeqId:
        """Queue a request; it is admitted at the next step that has room. Returns its sequence id."""
        seq = request.seq
        if seq is None:
            seq = next(self._ids)
            while seq in self.live or seq in self.done or seq in self.cache.seqs:
                seq = next(self._ids)
        elif seq in self.live or seq in self.done or seq in self.cache.seqs:
            raise ValueError(f"sequence id {seq!r} is already in use")
        live = _Live(request, seq, next(self._order))
        if not request.sampling.greedy:
            live.generator = torch.Generator(device="cpu")
            live.generator.manual_seed(request.sampling.seed if request.sampling.seed is not None else hash(seq) & 0xFFFF_FFFF)
        self.live[seq] = live
        return seq

    def abort(self, seq: SeqId) -> Generation:
        """Stop a request now; its blocks are released and it finishes as "aborted"."""
        return self._finish(self._live(seq), "aborted")

    def rollback(self, seq: SeqId, n: int) -> None:
        """Discard the last ``n`` generated tokens (rejected speculation); decoding resumes before them."""
        live = self._live(seq)
        if not 1 <= n <= len(live.generated):
            raise ValueError(f"rollback of {n} tokens for {seq!r}: must be in [1, {len(live.generated)}] (generated)")
        if live.state in ("running", "swapped"):
            # The newest generated token has not been fed back yet, so the cache holds one token
            # fewer than prompt + generated and drops exactly n.
            self.cache.rollback(seq, n)
        del live.generated[-n:]
        del live.logits[len(live.generated):]

    def state(self, seq: SeqId) -> str:
        """``waiting`` (no KV yet), ``running``, ``swapped`` (KV on a slower tier) or ``dropped`` (to recompute)."""
        return self._live(seq).state

    def has_work(self) -> bool:
        return bool(self.live)

    def run(self, max_steps: int | None = None) -> dict[SeqId, Generation]:
        """Step until every request has finished (or ``max_steps``); returns all finished requests."""
        steps = 0
        while self.live and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1
        return self.done

    # ---- one step ----
    def step(self) -> StepResult:
        cache = self.cache
        step = cache.bus.step
        chosen, preempt = self._plan()
        preempted = self._make_room(chosen, preempt)
        rows, ends = [], []
        budget = self.max_step_tokens
        for live in chosen:
            if live.state == "waiting":
                cache.add_sequence(live.seq, prompt_len=len(live.request.prompt_ids), priority=live.request.priority)
            live.state = "running"
            done = cache.seq_len(live.seq)
            todo = live.tokens[done:]
            take = todo[: max(1, min(len(todo), budget))] if len(todo) > 1 else todo
            limit = cache.max_step_tokens(live.seq)  # long context: a prompt longer than the device goes in chunks
            if limit is not None:
                take = take[:limit]
            budget -= len(take)
            rows.append((live.seq, take))
            ends.append(len(take) == len(todo))  # the row reaches the end of its tokens: sample after it
        new_tokens: dict[SeqId, int] = {}
        finished: list[Generation] = []
        if rows:
            logits = self.runner.forward(rows)
            greedy = logits.argmax(dim=-1).tolist()
            for i, (live, end) in enumerate(zip(chosen, ends)):
                if not end:
                    continue
                params = live.request.sampling
                tok = greedy[i] if params.greedy else sample(logits[i], params, live.generator)
                live.generated.append(tok)
                if self.keep_logits:
                    live.logits.append(logits[i].clone())
                new_tokens[live.seq] = tok
                if self.on_token is not None:
                    self.on_token(live.seq, tok)
                if (tok in self._eos and not live.request.ignore_eos) or tok in live.request.stop_token_ids:
                    finished.append(self._finish(live, "stop"))
                elif len(live.generated) >= live.request.max_new_tokens:
                    finished.append(self._finish(live, "length"))
        self._prefetch_next(chosen)
        num_tokens = sum(len(t) for _, t in rows)
        cache.end_step(num_tokens)
        return StepResult(step, [s for s, _ in rows], num_tokens, new_tokens, finished, preempted)

    def _plan(self) -> tuple[list[_Live], list[_Live]]:
        """The requests to run this step (best rank first, as many as fit) and the resident ones left out."""
        chosen: list[_Live] = []
        left: list[_Live] = []
        room = self.capacity
        tokens = self.max_step_tokens
        for live in sorted(self.live.values(), key=lambda lv: lv.rank):
            need = self._blocks_after_step(live)
            whole = -(-len(live.tokens) // self.cache.block_size)
            if whole > (self.total_capacity if self.cache.staging is not None else self.capacity):
                # Longer than the whole device tier (every tier, with long context): it can never run.
                self._finish(live, "aborted")
                continue
            todo = len(live.tokens) - (self.cache.seq_len(live.seq) if live.seq in self.cache.seqs else 0)
            fits = need <= room and len(chosen) < self.max_batch and (tokens > 0 or todo <= 1)
            if fits:
                chosen.append(live)
                room -= need
                tokens -= todo
            elif live.state == "running":
                left.append(live)
        return chosen, left

    def _prefetch_next(self, chosen: list[_Live]) -> None:
        """Start bringing the next request to resume, when it is a swapped-out one, back up in the
        background: up to ``prefetch_depth`` blocks per step, into device room that the requests
        running now will not need at their next token, never demoting anything for it. Its
        ``ensure_resident`` then finds them there (prefetch hits) instead of copying while the step waits."""
        running = [lv for lv in chosen if lv.seq in self.live]
        ids = {lv.seq for lv in chosen}
        rest = [lv for lv in self.live.values() if lv.seq not in ids]
        if not rest:
            return
        nxt = min(rest, key=lambda lv: lv.rank)
        if nxt.state != "swapped":
            return
        growth = sum(max(self._blocks_after_step(lv) - self._device_blocks(lv.seq), 0) for lv in running)
        room = self.cache.pool.tiers[Tier.DEVICE].num_free - growth
        if room > 0:
            self.cache.prefetch(nxt.seq, max_blocks=room)

    def _blocks_after_step(self, live: _Live) -> int:
        """Device blocks ``live`` holds once this step's tokens are in (a generous bound for chunked prefill).
        Long context: at most the device, which streams the rest (``_plan`` checks the total against every tier)."""
        blocks = -(-len(live.tokens) // self.cache.block_size)
        if self.cache.staging is not None:
            return min(blocks, self.capacity)
        return blocks

    def _device_blocks(self, seq: SeqId) -> int:
        """Device blocks ``seq`` holds, counting those a prefetch is bringing up (their slots are taken)."""
        s = self.cache.seqs.get(seq)
        if s is None:
            return 0
        return sum(1 for b in s.blocks if b.tier == Tier.DEVICE or (b.inflight is not None and b.inflight.dst == Tier.DEVICE))

    def _reclaimable(self, chosen: list[_Live]) -> int:
        """Device blocks that prefetches brought up for requests not running this step: their copies
        are landed (waited for if still in flight) so the cache can demote them again for the room."""
        ids = {lv.seq for lv in chosen}
        n = 0
        for lv in self.live.values():
            s = self.cache.seqs.get(lv.seq)
            if lv.state != "swapped" or lv.seq in ids or s is None:
                continue
            for b in s.blocks:
                if b.inflight is not None:
                    try:
                        self.cache.tiers.settle(b)
                    except ChecksumMismatch:
                        continue  # the bad copy was discarded; the block stays away, its slot is free again
                n += b.tier == Tier.DEVICE
        return n

    def _make_room(self, chosen: list[_Live], left: list[_Live]) -> list[SeqId]:
        """Preempt the lowest-ranked resident requests left out until the chosen ones fit."""
        tiers = self.cache.stats()["tiers"]
        free = tiers[Tier.DEVICE]["free_blocks"]
        need = sum(self._blocks_after_step(lv) - self._device_blocks(lv.seq) for lv in chosen)
        if need > free:
            free = self._reclaimable(chosen) + self.cache.pool.tiers[Tier.DEVICE].num_free
        preempted = []
        for live in sorted(left, key=lambda lv: lv.rank, reverse=True):
            if need <= free:
                break
            free += self._preempt(live, tiers)
            preempted.append(live.seq)
        return preempted

    def _preempt(self, live: _Live, tiers: dict[str, Any]) -> int:
        """Move ``live``'s blocks off the device: swap to host, else disk, else drop for recompute."""
        s = self.cache.seqs[live.seq]
        on_device = [b.id for b in s.blocks if b.tier == Tier.DEVICE]
        for dst in (Tier.HOST, Tier.DISK):
            t = tiers.get(dst)
            if t is not None and t["free_blocks"] >= len(on_device):
                self.cache.swap_out(on_device, dst=dst)
                t["free_blocks"] -= len(on_device)
                live.state = "swapped"
                return len(on_device)
        # Nowhere to keep the K/V: drop it and recompute from the tokens when the request resumes.
        if s.length:
            self.cache.rollback(live.seq, s.length)
        live.state = "dropped"
        return len(on_device)

    def _live(self, seq: SeqId) -> _Live:
        try:
            return self.live[seq]
        except KeyError:
            raise KeyError(f"no live request with sequence id {seq!r}") from None

    def _finish(self, live: _Live, reason: str) -> Generation:
        del self.live[live.seq]
        if live.seq in self.cache.seqs:
            self.cache.remove_sequence(live.seq, reason="aborted" if reason == "aborted" else "finished")
        gen = Generation(live.seq, list(live.request.prompt_ids), list(live.generated), reason,
                         logits=live.logits)
        if self.runner.tokenizer is not None:
            gen.text = self.runner.decode(live.generated)
        self.done[live.seq] = gen
        return gen
