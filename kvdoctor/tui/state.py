"""The TUI's state model: every event and finding folded into what the screens show.

``Monitor`` is fed by the worker thread, one event at a time, and must keep up with
the engine (tens of thousands of events per second), so each event costs a dict
lookup and a few attribute updates; anything proportional to the number of blocks
or layers happens once per step. ``Monitor.snapshot()`` copies the compact state
into an immutable ``Snapshot`` that the UI thread renders from while the worker
keeps going. Rates are measured on the trace's own clock (``t``), so a replay shows
the rates the workload had, and a recorded trace renders the same on every run.

Who owns a block and where it sits is not folded here: the monitor applies the checks'
``Ledger`` updates for those events and draws from its tables, so the map cannot show a
block owned that the leak check counts as orphaned (tests/tui/test_tui_fold.py holds them
together on fuzzed streams).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable

from ..events import (
    TIERS, Alloc, Attn, AttnStep, Batch, ChecksumError, Evict, Free, Header, Mem, Prefetch, Read, Release,
    Recode, Rollback, SeqEnd, SeqStart, Share, StepEnd, SwapIn, SwapOut, TraceEnd, Unknown, Usage, Write,
)
from ..checks import Ledger
from ..findings import Finding
from ..limits import Limits
from .blocks import FREE, LEAKED, STALE, TIER_CODES, UNOWNED, BlockRecord, BlockTable

__all__ = ["Monitor", "Snapshot", "TierView", "LayerView", "SeqRecord", "MEM_SERIES"]

_SPARK_LEN = 240          # samples kept per sparkline (one per step)
_LOG_LEN = 2000           # events kept for the log tail
_MAX_FINDINGS = 5000      # findings kept for the list (the counts keep going)
_RATE_WINDOW_NS = 2_000_000_000
_NO_OWNERS: frozenset = frozenset()  # a free block's owners
_SERIALS = itertools.count(1)  # shared by all monitors: a replay that rebuilds its monitor keeps counting up

# Memory timeline rows: (label, Mem field or "kv:<tier>" for a tier's KV bytes from `usage`).
MEM_SERIES: tuple[tuple[str, str], ...] = (
    ("RSS", "rss"), ("Python heap", "py_heap"), ("torch CPU", "torch_cpu"),
    ("GPU used", "gpu_used"), ("GPU reserved", "gpu_reserved"),
    ("KV device", "kv:device"), ("KV host", "kv:host"), ("KV disk", "kv:disk"), ("KV total", "kv_bytes"),
)
_MEM_FIELDS = tuple(f for _, f in MEM_SERIES if not f.startswith("kv:"))


class SeqRecord:
    """One sequence: when it came and went, what it owns, how far it got."""

    __slots__ = ("seq", "prompt_len", "start_step", "end_step", "reason", "blocks", "length", "version", "stack")

    def __init__(self, seq: Any, prompt_len: int, step: int, stack: list[str] | None, blocks: set[int]) -> None:
        self.seq = seq
        self.prompt_len = prompt_len
        self.start_step = step
        self.end_step: int | None = None
        self.reason: str | None = None
        self.blocks = blocks  # the checks' fold's set: it keeps it, the record shows it (ended too)
        self.length = 0
        self.version = 0
        self.stack = stack


@dataclass(frozen=True)
class TierView:
    name: str
    capacity: int
    used: int            # as the engine counts it (`usage`), else as the events leave it
    owned: int           # blocks with exactly one owner
    shared: int
    leaked: int          # unowned at a step end, or named by a leak finding
    bytes: int | None
    spark: tuple[int, ...]

    @property
    def free(self) -> int:
        return max(self.capacity - self.used, 0)


@dataclass(frozen=True)
class LayerView:
    layer: int
    steps: tuple[int, ...]
    entropy: tuple[float, ...]
    max_logit: tuple[float, ...]
    nonfinite: tuple[int, ...]
    anomalies: frozenset[int]   # steps with an attention finding at this layer


@dataclass(frozen=True)
class TraceView:
    """One trace of a workload on screen: its place in the workload, its name, and who wrote it in words
    (instance, role, ranks), which the selector and the findings list show."""

    index: int
    name: str
    label: str


@dataclass(frozen=True)
class Snapshot:
    """Everything the screens draw, copied out of the monitor at one instant. ``findings``, ``layers``, ``memory``
    and ``log`` are the very tuples of the previous snapshot while they have not changed (a view compares them by
    identity to skip a redraw)."""

    serial: int
    header: Header | None
    step: int
    num_events: int
    tokens_per_s: float
    events_per_s: float
    active_seqs: int
    num_seqs: int
    batch_rows: int
    tiers: tuple[TierView, ...]
    cells: bytes
    cell_ids: tuple[int, ...]
    findings: tuple[Finding, ...]          # oldest first; the list shows them newest first
    num_findings: dict[str, int]
    layers: tuple[LayerView, ...]
    memory: tuple[tuple[str, tuple[int, ...]], ...]
    log: tuple[Any, ...]                   # the newest events, oldest first
    ended: str | None = None               # why the source stopped, once it has
    status: str = ""                       # a line from the feed: following, replaying step …, crashed …
    prefix_hits: int = 0                   # a prefix cache's lookups so far (step_end), in prompt blocks: served
    prefix_lookups: int = 0                # ... and served or computed; 0: no prefix cache seen
    steps_done: int = 0                    # step_end events so far: 0 while a workload loads its model
    output: str = ""                       # the end of the output of a workload kvdoctor started (the demo's answers)
    traces: tuple[TraceView, ...] = ()     # a workload of several traces: each (none: one trace)
    shown: int = 0                         # the place in ``traces`` of the one whose state this is

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.prefix_hits / self.prefix_lookups if self.prefix_lookups else None


class _LayerAcc:
    __slots__ = ("ent_sum", "max_logit", "nonfinite", "n", "steps", "entropy", "maxes", "nonfin")

    def __init__(self) -> None:
        self.ent_sum = 0.0
        self.max_logit = float("-inf")
        self.nonfinite = 0
        self.n = 0
        self.steps: deque[int] = deque(maxlen=_SPARK_LEN)
        self.entropy: deque[float] = deque(maxlen=_SPARK_LEN)
        self.maxes: deque[float] = deque(maxlen=_SPARK_LEN)
        self.nonfin: deque[int] = deque(maxlen=_SPARK_LEN)


class Monitor:
    """Folds events and findings into the state the TUI shows. Not thread-safe: one feeder.

    Everything it keeps is bounded, so a workload watched for hours holds it flat: live blocks and
    sequences by the workload itself, the past by ``limits`` (freed blocks, ended sequences) and by
    the fixed lengths above (sparklines, log, findings list).
    """

    def __init__(self, header: Header | None = None, limits: Limits | None = None) -> None:
        limits = limits or Limits()
        self.header: Header | None = None
        # Who owns each block and where it sits: the checks' own fold, so the map shows what they judge.
        self.fold = Ledger(history=1, freed_kept=0, ended_kept=limits.tui_ended_seqs)
        self._fold_apply = {cls: fn for cls, fn in self.fold.appliers().items() if cls in Ledger.OWNERSHIP}
        self.blocks = BlockTable(max_free=limits.tui_freed_blocks)
        self.max_ended = limits.tui_ended_seqs
        self.seqs: dict[Any, SeqRecord] = {}
        self._ended: OrderedDict[Any, SeqRecord] = OrderedDict()
        self.step = 0
        self.num_events = 0
        self.findings: deque[Finding] = deque(maxlen=_MAX_FINDINGS)
        self.num_findings = {"error": 0, "warning": 0, "info": 0}
        self.log: deque[Any] = deque(maxlen=_LOG_LEN)
        self.ended: str | None = None
        self.batch_rows = 0
        self._capacity: dict[str, int] = {}
        self._usage: dict[str, int] = {}
        self._usage_bytes: dict[str, int] = {}
        self._tier_spark = {t: deque(maxlen=_SPARK_LEN) for t in TIERS}
        self._layers: dict[int, _LayerAcc] = {}
        self._anomalies: dict[int, set[int]] = {}
        self._mem_last: dict[str, int] = {}
        self._mem = {f: deque(maxlen=_SPARK_LEN) for _, f in MEM_SERIES}
        self._mem_seen: set[str] = set()
        self._unowned: set[int] = set()    # blocks left without owner during this step
        self._rate: deque[tuple[int, int, int]] = deque()  # (t, tokens, events) per closed step
        self._step_events = 0
        self._step_tokens = 0
        self._prefix_hits = self._prefix_lookups = 0
        self.steps_done = 0
        self._ids_cache: tuple[int, tuple[int, ...]] = (-1, ())
        # Parts of a snapshot that change only at a step's end or with a finding are copied once and handed out
        # again while unchanged: a snapshot costs the feed less, and a view that is handed the same tuple knows
        # it has nothing to redraw (``Snapshot``).
        self._closes = 0  # steps closed
        self._added = 0   # findings added
        self._copies: dict[str, tuple[Any, Any]] = {}
        self._handlers: dict[type, Callable[[Any], None]] = {
            SeqStart: self._seq_start, SeqEnd: self._seq_end, Alloc: self._alloc, Share: self._owners_change,
            Release: self._owners_change, Free: self._free, Evict: self._free, Write: self._write,
            Read: self._read, SwapOut: self._swap, SwapIn: self._swap, Rollback: self._rollback,
            Batch: self._batch, Attn: self._attn, AttnStep: self._attn_step, Usage: self._usage_ev, Mem: self._mem_ev,
            StepEnd: self._step_end, ChecksumError: self._checksum, Prefetch: _ignore,
            TraceEnd: self._trace_end, Unknown: _ignore, Recode: self._recode,
        }
        if header is not None:
            self.set_header(header)

    # ---- feeding ------------------------------------------------------------------------

    def set_header(self, header: Header) -> None:
        self.header = header
        self._capacity = {t.name: t.capacity_blocks for t in header.tiers}

    def observe(self, ev: Any) -> None:
        """Fold one event in. Events of a later step first close the current one."""
        self.num_events += 1
        self._step_events += 1
        if ev.step != self.step:
            self._close_step(ev.step)
        self.log.append(ev)
        handler = self._handlers.get(type(ev))
        if handler is not None:
            handler(ev)

    def add_finding(self, f: Finding) -> None:
        """A check concluded something: count it, list it, and mark its block or layer."""
        self._added += 1
        self.findings.append(f)
        self.num_findings[f.severity] = self.num_findings.get(f.severity, 0) + 1
        if f.block is not None:
            rec = self.blocks.records.get(f.block)
            if rec is not None and rec.tier != FREE:
                rec.flags |= LEAKED if f.check == "leak" else STALE if f.check == "stale" else 0
                self.blocks.recode(rec)
        if f.layer is not None and f.check == "attention":
            steps = self._anomalies.setdefault(f.layer, set())
            steps.add(self.step if f.step is None else f.step)
            if len(steps) > 2 * _SPARK_LEN:  # only steps still on the sparkline are drawn
                steps -= {s for s in steps if s < self.step - _SPARK_LEN}

    def finish(self, reason: str) -> None:
        """The source is done (trace end, workload exit, crash): close the last step."""
        self._close_step(self.step + 1, advance=False)
        self.ended = reason

    # ---- queries (the UI calls these through the feed, under its lock) ------------------

    def seq(self, seq: Any) -> SeqRecord | None:
        return self.seqs.get(seq) or self._ended.get(seq)

    def find_seq(self, text: str) -> SeqRecord | None:
        """A sequence by id as typed: ids may be ints or strings on the wire."""
        rec = self.seq(text)
        if rec is None and text.lstrip("-").isdigit():
            rec = self.seq(int(text))
        return rec

    # ---- snapshot -----------------------------------------------------------------------

    def snapshot(self, *, status: str = "", ended: str | None = None, output: str = "") -> Snapshot:
        table = self.blocks
        counts = table.tier_counts()
        tiers = []
        for name in TIERS:
            owned, shared, leaked = counts[TIER_CODES[name]]
            ours = owned + shared + leaked
            cap = self._capacity.get(name, 0)
            if not cap and not ours and name not in self._usage:
                continue
            tiers.append(TierView(
                name=name, capacity=cap, used=self._usage.get(name, ours), owned=owned, shared=shared,
                leaked=leaked, bytes=self._usage_bytes.get(name), spark=tuple(self._tier_spark[name]),
            ))
        if self._ids_cache[0] != table.ids_version:
            self._ids_cache = (table.ids_version, tuple(table.ids))
        tokens_s, events_s = self._rates()
        return Snapshot(
            serial=next(_SERIALS), header=self.header, step=self.step, num_events=self.num_events,
            tokens_per_s=tokens_s, events_per_s=events_s, active_seqs=len(self.seqs),
            num_seqs=len(self.seqs) + len(self._ended), batch_rows=self.batch_rows, tiers=tuple(tiers),
            cells=bytes(table.cells), cell_ids=self._ids_cache[1],
            findings=self._copy("findings", self._added, lambda: tuple(self.findings)),
            num_findings=dict(self.num_findings),
            layers=self._copy("layers", (self._closes, self._added), self._layer_views),
            memory=self._copy("memory", (self._closes, len(self._mem_seen)), self._memory_series),
            log=self._copy("log", self.num_events, lambda: tuple(self.log)),
            ended=ended or self.ended, status=status, prefix_hits=self._prefix_hits,
            prefix_lookups=self._prefix_lookups, steps_done=self.steps_done, output=output,
        )

    def _copy(self, part: str, version: Any, make: Callable[[], Any]) -> Any:
        """``make()``, or the copy made for the same ``version`` of ``part`` last time."""
        made = self._copies.get(part)
        if made is None or made[0] != version:
            made = self._copies[part] = (version, make())
        return made[1]

    def _layer_views(self) -> tuple[LayerView, ...]:
        return tuple(
            LayerView(layer=k, steps=tuple(a.steps), entropy=tuple(a.entropy), max_logit=tuple(a.maxes),
                      nonfinite=tuple(a.nonfin), anomalies=frozenset(self._anomalies.get(k, ())))
            for k, a in sorted(self._layers.items())
        )

    def _memory_series(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return tuple((label, tuple(self._mem[f])) for label, f in MEM_SERIES if f in self._mem_seen)

    def _rates(self) -> tuple[float, float]:
        r = self._rate
        if len(r) < 2:
            return 0.0, 0.0
        span = r[-1][0] - r[0][0]
        if span <= 0:
            return 0.0, 0.0
        tokens = sum(x[1] for x in r) - r[0][1]
        events = sum(x[2] for x in r) - r[0][2]
        return tokens * 1e9 / span, events * 1e9 / span

    # ---- steps --------------------------------------------------------------------------

    def _close_step(self, new_step: int, advance: bool = True) -> None:
        self._closes += 1
        table = self.blocks
        for b in self._unowned:
            rec = table.records.get(b)  # None: freed this step and its record already recycled
            if rec is not None and rec.tier != FREE and not rec.owners:
                rec.flags |= UNOWNED
                table.recode(rec)
        self._unowned.clear()
        # The engine's own count when it reports one (`usage`); else what the events leave allocated.
        counts = None
        for name, code in TIER_CODES.items():
            used = self._usage.get(name)
            if used is None:
                if name not in self._capacity:
                    continue  # a tier this cache does not have
                counts = counts or table.tier_counts()
                used = sum(counts[code])
            self._tier_spark[name].append(used)
        for name in self._mem_seen:
            if name.startswith("kv:"):
                self._mem[name].append(self._usage_bytes.get(name[3:], 0))
            else:
                self._mem[name].append(self._mem_last.get(name, 0))
        for acc in self._layers.values():
            if acc.n:
                acc.steps.append(self.step)
                acc.entropy.append(acc.ent_sum / acc.n)
                acc.maxes.append(acc.max_logit)
                acc.nonfin.append(acc.nonfinite)
                acc.ent_sum, acc.max_logit, acc.nonfinite, acc.n = 0.0, float("-inf"), 0, 0
        if advance:
            self.step = new_step

    def _note_rate(self, t: int, tokens: int) -> None:
        r = self._rate
        r.append((t, tokens, self._step_events))
        self._step_events = 0
        while len(r) > 2 and r[-1][0] - r[0][0] > _RATE_WINDOW_NS:
            r.popleft()

    # ---- handlers -----------------------------------------------------------------------

    def _seq_start(self, ev: SeqStart) -> None:
        self._fold_apply[SeqStart](ev)
        self.seqs[ev.seq] = SeqRecord(ev.seq, ev.prompt_len, ev.step, ev.stack, self.fold.seqs[ev.seq].blocks)

    def _seq_end(self, ev: SeqEnd) -> None:
        fold = self.fold
        state = fold.seqs.get(ev.seq)
        held = [b for b in state.blocks if ev.seq in fold.owners.get(b, ())] if state is not None else []
        self._fold_apply[SeqEnd](ev)
        for b in held:
            brec = self.blocks.records.get(b)
            if brec is not None:
                brec.history.append(ev)
                self._sync(brec)
        rec = self.seqs.pop(ev.seq, None)
        if rec is None:
            return
        rec.end_step, rec.reason = ev.step, ev.reason
        self._ended[ev.seq] = rec
        if len(self._ended) > self.max_ended:
            self._ended.popitem(last=False)

    def _alloc(self, ev: Alloc) -> None:
        self._fold_apply[Alloc](ev)
        rec = self.blocks.get(ev.block)
        rec.version = 0
        rec.flags = 0
        rec.codec = ev.codec
        rec.born = ev
        rec.history.append(ev)
        self._sync(rec)

    def _owners_change(self, ev: Share | Release) -> None:
        self._fold_apply[type(ev)](ev)
        rec = self.blocks.get(ev.block)
        rec.history.append(ev)
        self._sync(rec)

    def _free(self, ev: Free | Evict) -> None:
        self._fold_apply[type(ev)](ev)
        rec = self.blocks.get(ev.block)
        rec.history.append(ev)
        rec.flags = 0
        self._sync(rec)

    def _sync(self, rec: BlockRecord) -> None:
        """Show the block as the fold now has it: its tier and owners, and whether it lost its last owner."""
        fold = self.fold
        tier = fold.tier.get(rec.block)
        owners = fold.owners.get(rec.block)
        rec.tier = FREE if tier is None else TIER_CODES.get(tier, 1)  # a tier we do not draw shows as device
        rec.owners = owners if owners is not None else _NO_OWNERS
        if owners:
            rec.flags &= ~UNOWNED  # owned again (a prefix-cache hit, say): the leak check stops counting it too
        elif tier is not None:
            self._unowned.add(rec.block)
        self.blocks.recode(rec)

    def _write(self, ev: Write) -> None:
        rec = self.blocks.records.get(ev.block)
        if rec is not None:
            rec.version = ev.version
            rec.history.append(ev)
        s = self.seqs.get(ev.seq)
        if s is not None:
            s.version = ev.version
            end = ev.pos + ev.n
            if end > s.length:
                s.length = end

    def _read(self, ev: Read) -> None:
        # Reads come per step (or per layer) for every block: remember when, not each one.
        records = self.blocks.records
        for b in ev.blocks:
            rec = records.get(b)
            if rec is not None:
                rec.last_read_step = ev.step

    def _swap(self, ev: SwapOut | SwapIn) -> None:
        self._fold_apply[type(ev)](ev)
        rec = self.blocks.get(ev.block)
        rec.history.append(ev)
        if ev.codec is not None:
            rec.codec = ev.codec
        self._sync(rec)

    def _recode(self, ev: Recode) -> None:
        rec = self.blocks.get(ev.block)
        rec.history.append(ev)
        rec.codec = ev.dst_codec

    def _rollback(self, ev: Rollback) -> None:
        s = self.seqs.get(ev.seq)
        if s is not None:
            s.version = ev.version
            s.length = max(s.length - ev.n, 0)

    def _batch(self, ev: Batch) -> None:
        self.batch_rows = len(ev.rows)

    def _attn_step(self, ev: AttnStep) -> None:
        for row in ev.rows():
            self._attn(row)

    def _attn(self, ev: Attn) -> None:
        acc = self._layers.get(ev.layer)
        if acc is None:
            acc = self._layers[ev.layer] = _LayerAcc()
        acc.ent_sum += ev.entropy
        acc.n += 1
        if ev.max_logit > acc.max_logit or ev.max_logit != ev.max_logit:
            acc.max_logit = ev.max_logit
        acc.nonfinite += ev.nonfinite

    def _usage_ev(self, ev: Usage) -> None:
        self._usage[ev.tier] = ev.used_blocks
        if ev.capacity_blocks:
            self._capacity[ev.tier] = ev.capacity_blocks
        if ev.bytes is not None:
            self._usage_bytes[ev.tier] = ev.bytes
            self._mem_seen.add("kv:" + ev.tier)

    def _mem_ev(self, ev: Mem) -> None:
        for name in _MEM_FIELDS:
            value = getattr(ev, name)
            if value is not None:
                self._mem_last[name] = value
                self._mem_seen.add(name)

    def _step_end(self, ev: StepEnd) -> None:
        self.steps_done += 1
        if ev.prefix_hits is not None:
            self._prefix_hits += ev.prefix_hits
            self._prefix_lookups += ev.prefix_hits + (ev.prefix_misses or 0)
        self._note_rate(ev.t, ev.num_tokens)
        self._close_step(ev.step + 1)

    def _checksum(self, ev: ChecksumError) -> None:
        table = self.blocks
        rec = table.get(ev.block)
        rec.history.append(ev)
        if rec.tier != FREE:
            rec.flags |= STALE
            table.recode(rec)

    def _trace_end(self, ev: TraceEnd) -> None:
        self.ended = f"trace closed ({ev.reason})"


def _ignore(ev: Any) -> None:
    return None
