"""kvdoctor on transformers' own caches: ``with kvdoctor.observe(model, trace="run.kvtrace"): model.generate(...)``.

Nothing is replaced. For the block's duration the observer
- hooks the model's forward (before: the inputs, the cache and its length; after: the events),
- wraps ``prepare_inputs_for_generation`` on the model instance, to see the whole token ids
  ``generate`` holds for each row (so it can tell which sequence a cache row really continues),
- shadows, on the first attention layer of each cache it meets (an instance attribute), the
  methods transformers changes rows with: ``reorder_cache``, ``batch_select_indices``,
  ``batch_repeat_interleave``, ``crop``, ``reset`` (per layer, so an op applied twice is seen twice),
- registers a wrapper around the model's current attention function with ``AttentionInterface``
  and switches the model to it, for statistics of each row's newest query every step.
On exit everything is put back and every sequence still in a cache ends with its blocks freed.
Every hook runs transformers' code exactly as called and keeps the observer's own work in a guard: a
failure of kvdoctor's bookkeeping is one ``observer_error`` in the trace, the hooks come off, and
``generate`` goes on as if the observer had never been there.

The row bookkeeping and the events are ``transformers_rows``'s; the statistics ``transformers_attention``'s.
Without ``trace=`` the observer writes to ``KVDOCTOR_TRACE`` (one trace per process, shared by every
observe block and closed at exit), so ``kvdoctor check -- python script.py`` works; with neither, it
records nothing.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from datetime import datetime, timezone
from typing import Any, Callable

import msgspec

from .. import callsite, knobs
from ..events import Attn, Batch, Event, Header, ObserverError, Padding, StepEnd, TierSpec, Truncate, Weights
from ..trace import TraceWriter
from ..trace_names import claim
from .guard import Call, Guard
from .weights import weights_digest
from .transformers_attention import AttentionTap, tap_name
from .transformers_rows import CacheRows, Row, Versions

__all__ = ["observe", "Observer", "BLOCK_SIZE"]
BLOCK_SIZE = 16  # tokens per logical block in the trace (transformers' caches have no blocks)
_LAYER_OPS = ("reorder_cache", "batch_select_indices", "batch_repeat_interleave", "crop", "reset")


class _Trace:
    """A trace being written: the writer, its clock, its step and the ids already handed out."""

    def __init__(self, writer: TraceWriter) -> None:
        self.writer = writer
        self.t0 = time.perf_counter_ns()
        self.step = 0
        self.ids = Versions()
        self.buf: list[Event] = []
        self._stack: tuple[int, list[str] | None] = (-1, None)

    def stack(self) -> list[str] | None:
        """The user's frames behind this step's sequences and blocks: walked once per step, as every row
        of a pass was started, allocated or ended by the same call in the user's code."""
        step, frames = self._stack
        if step != self.step:
            frames = callsite.user_stack()
            self._stack = (self.step, frames)
        return frames

    def emit(self, cls: type, **fields: Any) -> None:
        self.buf.append(cls(t=time.perf_counter_ns() - self.t0, step=self.step, **fields))

    def flush(self) -> None:
        if self.buf and not self.writer.closed:
            self.writer.write_many(self.buf)
        self.buf = []

    def close(self, reason: str = "closed") -> None:
        self.flush()
        self.writer.close(reason)


_shared: dict[str, _Trace] = {}  # KVDOCTOR_TRACE path -> the process's one trace there


def _header(model: Any) -> Header:
    import transformers

    config = model.config
    return Header(block_size=BLOCK_SIZE, num_layers=int(getattr(config, "num_hidden_layers", 0) or 0),
                  tiers=[TierSpec(name="device", capacity_blocks=0)],  # 0: transformers grows its caches as it goes
                  model=str(getattr(config, "_name_or_path", "") or type(model).__name__),
                  engine=f"transformers {transformers.__version__}",
                  created=datetime.now(timezone.utc).isoformat(timespec="seconds"), pid=os.getpid(),
                  t0=time.time_ns())  # wall clock at t = 0 (the trace starts now): orders it among a workload's


def _shared_trace(path: str, model: Any) -> _Trace:
    trace = _shared.get(path)
    if trace is None or trace.writer.closed:  # a file of its own beside the run's other traces (trace_names)
        trace = _shared[path] = _Trace(TraceWriter(claim(path)[0], _header(model)))
        atexit.register(trace.close)
    return trace


def observe(model: Any, trace: str | os.PathLike[str] | None = None, *, stats: bool = True) -> "Observer":
    """A context manager that records what ``model`` does to transformers' own caches as a kvdoctor trace.

    ``trace``: the file to write (closed when the block ends); None follows ``KVDOCTOR_TRACE``.
    ``stats``: attention statistics of each row's newest query at every layer and step.
    """
    if not hasattr(model, "register_forward_pre_hook") or not hasattr(model, "config"):
        raise TypeError(f"kvdoctor.observe needs a transformers model, not {type(model).__name__}")
    if trace is not None:
        return Observer(model, _Trace(TraceWriter(trace, _header(model))), owns_trace=True, stats=stats)
    path = knobs.get(knobs.TRACE)
    return Observer(model, _shared_trace(path, model) if path else None, owns_trace=False, stats=stats)


class _Seen:
    """A cache the observer has met: its rows, and the layer whose methods it shadows."""

    def __init__(self, cache: Any, rows: CacheRows) -> None:
        self.ref = weakref.ref(cache)
        self.rows = rows
        self.layer: Any = None
        self.layer_index: int | None = None
        self.cut = False  # a crop or reset since the last pass: slots the cache holds past ``rows.num_slots`` are stale
        self.dirty = False  # rows were moved or cut since the last pass: check what each row continues
        self.broken = False  # a pass the cache could not take (batch size changed): start it over


class Observer:
    """Hooks one model for the duration of a ``with`` block; see the module docstring."""

    def __init__(self, model: Any, trace: _Trace | None, *, owns_trace: bool, stats: bool) -> None:
        self.model = model
        self.trace = trace
        self.owns_trace = owns_trace
        self.tap = AttentionTap(BLOCK_SIZE)
        self.tap.stats = stats
        self._caches: dict[int, _Seen] = {}
        self._handles: list[Any] = []
        self._original_attn: str | None = None
        self._pending: tuple | None = None  # (cache, full ids, 2D mask, first iteration) from generate
        self._ctx: tuple | None = None  # what the pre-hook saw for the pass under way
        self._num_caches = 0
        self._weights: tuple | None = None  # the parameters' version counters and sampled digest when last looked
        self._weights_version = 0
        self.guard = Guard("transformers", self._record_error, self._uninstall)
        self.tap.on_error = self.guard.lost

    # ---- installing -----------------------------------------------------------------

    def __enter__(self) -> "Observer":
        if self.trace is None:
            return self
        model = self.model
        name = type(model).__name__
        self._handles = [
            model.register_forward_pre_hook(self.guard.hook(f"{name}.forward", self._before), with_kwargs=True),
            model.register_forward_hook(self.guard.hook(f"{name}.forward", self._after), with_kwargs=True)]
        if hasattr(model, "prepare_inputs_for_generation"):
            model.prepare_inputs_for_generation = self.guard.wrap(
                model.prepare_inputs_for_generation, f"{name}.prepare_inputs_for_generation", before=self._prepare)
        self._install_tap()
        return self

    def _install_tap(self) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        original = getattr(self.model.config, "_attn_implementation", None)
        if not original or original not in ALL_MASK_ATTENTION_FUNCTIONS:
            sys.stderr.write(f"kvdoctor: no attention statistics for attention implementation {original!r}\n")
            return
        name = tap_name(original)
        AttentionInterface.register(name, self.tap.wrap(original))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
        try:
            self.model.set_attn_implementation(name)
        except (ValueError, KeyError, AttributeError) as exc:
            sys.stderr.write(f"kvdoctor: no attention statistics: {exc}\n")
            return
        self._original_attn = original

    def __exit__(self, kind: Any, *exc: Any) -> None:
        if self.trace is None:
            return
        if self.guard.live:
            self._uninstall()
            self.guard.attempt("exit", self._end_all)
        if self.owns_trace:
            self.trace.close("closed" if kind is None else "error")
        else:
            self.trace.flush()

    def _uninstall(self) -> None:
        """Everything put back as it was; also the guard's stop, so it must not raise."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        vars(self.model).pop("prepare_inputs_for_generation", None)
        if self._original_attn is not None:
            try:
                self.model.set_attn_implementation(self._original_attn)
            except Exception:  # the model keeps the tap, which now only calls the original attention
                pass
            self._original_attn = None
        self.tap.active = False
        for seen in self._caches.values():
            self._unshadow(seen)

    def _end_all(self) -> None:
        for seen in self._caches.values():
            seen.rows.end_all("finished")
        self._caches.clear()
        self.trace.emit(StepEnd)
        self.trace.step += 1

    def _record_error(self, event: ObserverError) -> None:
        """The guard's record: the error goes out with what this pass gathered."""
        trace = self.trace
        trace.buf.append(msgspec.structs.replace(event, t=time.perf_counter_ns() - trace.t0, step=trace.step))
        trace.flush()

    def _prepare(self, call: Call) -> None:
        kwargs = call.kwargs
        mask = kwargs.get("attention_mask")
        self._pending = (kwargs.get("cache", kwargs.get("past_key_values")), call["input_ids"],
                         mask if mask is not None and mask.dim() == 2 else None, bool(kwargs.get("is_first_iteration")))

    # ---- the caches -----------------------------------------------------------------

    def _seen(self, cache: Any) -> _Seen:
        seen = self._caches.get(id(cache))
        if seen is not None and seen.ref() is cache:
            return seen
        for key, other in list(self._caches.items()):  # caches dropped since: their sequences are over
            if other.ref() is None:
                other.rows.end_all("finished")
                del self._caches[key]
        self._num_caches += 1
        seen = _Seen(cache, CacheRows(f"c{self._num_caches}", BLOCK_SIZE, self.trace.ids, self.trace.emit,
                                         self.trace.stack))
        self._caches[id(cache)] = seen
        return seen

    def _shadow(self, seen: _Seen, cache: Any) -> None:
        """Shadow the row-changing methods of the cache's first attention layer (once per op, per call)."""
        layer = next((l for l in getattr(cache, "layers", ()) if hasattr(l, "keys") and hasattr(l, "crop")), None)
        if layer is None or seen.layer is layer:
            return
        self._unshadow(seen)
        seen.layer = layer
        seen.layer_index = next(i for i, l in enumerate(cache.layers) if l is layer)
        for name in _LAYER_OPS:
            if hasattr(layer, name):
                setattr(layer, name, self.guard.wrap(getattr(layer, name), f"{type(layer).__name__}.{name}",
                                                     **self._layer_op(seen, name)))

    @staticmethod
    def _unshadow(seen: _Seen) -> None:
        if seen.layer is not None:
            for name in _LAYER_OPS:
                vars(seen.layer).pop(name, None)
            seen.layer = None

    def _layer_op(self, seen: _Seen, name: str) -> dict[str, Callable]:
        """The bookkeeping around a layer method that moves or cuts rows (the method itself runs as called)."""
        rows = seen.rows

        def crop_before(call: Call) -> None:
            length = int(call.first())
            if length > rows.num_slots:  # the old form, crop(max_length): a length longer than written cannot be honoured
                for row in rows.rows:
                    rows.rollback(row, -(length - rows.num_slots))

        def crop_after(call: Call, _: Any, __: Any) -> None:
            tokens_to_remove = int(call.first())
            if tokens_to_remove < 0 and rows.rows:
                rows.crop(-tokens_to_remove)
                seen.dirty = True
            self._cut(seen, "crop", f"crop({tokens_to_remove})")

        def after(call: Call, _: Any, __: Any) -> None:
            if name == "reset":
                rows.end_all("finished")
                self._cut(seen, "reset", "reset()")
            elif rows.num_slots:
                arg = call.first()
                if name == "batch_repeat_interleave":
                    sources = [i for i in range(len(rows.rows)) for _ in range(int(arg))]
                else:
                    sources = _row_indices(arg)
                rows.remap(sources)
                seen.dirty = True

        return {"before": crop_before, "after": crop_after} if name == "crop" else {"after": after}

    def _cut(self, seen: _Seen, op: str, asked: str) -> None:
        """A ``truncate``: what the cut should leave, and what the layer it ran on reports now (transformers #47433,
        #48509: a crop or reset that leaves slots behind). The next pass treats slots past it as never written."""
        layer = seen.layer
        length = int(layer.get_seq_length()) if getattr(layer, "is_initialized", True) else 0
        self.trace.emit(Truncate, op=op, keep=seen.rows.num_slots, length=length, layer=seen.layer_index,
                        cache=seen.rows.label, asked=asked)
        seen.cut = True

    # ---- a forward pass -------------------------------------------------------------

    def _before(self, module: Any, args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        ids = kwargs.get("input_ids", args[0] if args else None)
        first = ids if ids is not None else kwargs.get("inputs_embeds")
        if first is None:
            return
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is not cache:
            pending = None
        if pending is None or pending[3]:  # a generate call starts (or a hand-written pass): did the weights change?
            self._look_at_weights()
        past = int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0
        self._ctx = (cache, past, ids, first.shape[0], first.shape[1], kwargs.get("attention_mask"),
                     kwargs.get("position_ids"), pending)
        self.tap.begin(self._padding_written(past, first.shape[1], kwargs.get("attention_mask"), pending))
        if cache is not None and past:
            seen = self._seen(cache)
            if seen.rows.rows and first.shape[0] != len(seen.rows.rows):
                self._batch_mismatch(seen, cache)

    @staticmethod
    def _padding_written(past: int, new: int, mask: Any, pending: tuple | None) -> tuple[int, Any] | None:
        """(first new slot, (B, new) bool of the new slots that are padding) when the pass writes padding: only a
        pass of several tokens (a padded prefill) is looked at, so a decode step pays nothing."""
        mask2d = pending[2] if pending is not None else (mask if mask is not None and mask.dim() == 2 else None)
        if new < 2 or mask2d is None or mask2d.shape[-1] < new:
            return None
        pad = mask2d[:, -new:] == 0
        return (past, pad) if bool(pad.any()) else None

    def _look_at_weights(self) -> None:
        """A ``weights`` event when the model's parameters changed since the last pass that looked: K/V a
        cache kept from before are then stale. Version counters catch in-place updates (an optimizer step,
        ``load_state_dict``); a sampled digest catches writes through ``.data``. Once per generate call."""
        params = list(self.model.parameters())
        now = (sum(p._version for p in params), weights_digest(self.model))
        if self._weights is not None and now != self._weights:
            self._weights_version += 1
            self.trace.emit(Weights, version=self._weights_version, cause="update", digest=now[1],
                            detail=f"{type(self.model).__name__}'s parameters changed since the last generate call")
        self._weights = now

    def _batch_mismatch(self, seen: _Seen, cache: Any) -> None:
        """The pass computes another number of rows than the cache holds (transformers fails in ``torch.cat``
        next): a batch whose rows cannot fit the cache's K shape, written now, before the exception."""
        _, past, ids, batch, new, mask, positions, pending = self._ctx
        rows = seen.rows
        writers, firsts = [], []
        for b in range(batch):
            held = self._continues(rows, pending, b, past) if pending is not None else None
            if held is None:
                held = rows.rows[b].holder if b < len(rows.rows) else rows.start_seq(new)
            writers.append(held)
            firsts.append(int(positions[min(b, positions.shape[0] - 1), 0]) if positions is not None else past)
        keys = seen.layer.keys if seen.layer is not None else None
        shape = list(keys.shape) if keys is not None and keys.dim() == 4 else [len(rows.rows), 0, past + new, 0]
        shape[2] = past + new
        self.trace.emit(Batch, rows=writers, positions=firsts, n=[new] * batch, shape=shape)
        seen.broken = True
        self.trace.flush()

    @staticmethod
    def _continues(rows: CacheRows, pending: tuple, b: int, past: int) -> Any | None:
        """The holder of the row whose tokens are the first ``past`` ids generate holds for row ``b``."""
        return rows.find_holder(pending[1][b, :past].tolist())

    def _after(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None) or ctx[0]
        if cache is None or not hasattr(cache, "get_seq_length"):
            self.tap.finish()
            return
        _, past, ids, batch, new, mask, positions, pending = ctx
        trace = self.trace
        seen = self._seen(cache)
        self._shadow(seen, cache)
        rows = seen.rows
        stale = past - rows.num_slots if seen.cut and past > rows.num_slots else 0
        seen.cut = False
        if seen.broken or (rows.rows and (len(rows.rows) != batch or rows.num_slots + stale != past)):
            rows.end_all("aborted")  # changed where the observer could not see it: start it over
            seen.broken = stale = False
        full_ids = pending[1] if pending is not None else None
        mask2d = pending[2] if pending is not None else (mask if mask is not None and mask.dim() == 2 else None)
        real = (mask2d[:, -new:] != 0).tolist() if mask2d is not None and mask2d.shape[-1] >= new else [[True] * new] * batch
        tokens = ids.tolist() if ids is not None else [[None] * new] * batch
        if positions is not None:
            pos = positions.tolist()
            pos = pos * batch if len(pos) == 1 else pos
        else:
            pos = [list(range(past, past + new))] * batch
        if stale:  # slots a cut left behind: the rows hold them, nobody wrote them (since the cut)
            if not rows.rows:
                rows.new_rows([past - stale + sum(r) for r in real])
            rows.stale(stale)
        if not rows.rows:
            self._start(rows, pending, mask2d, batch, past, real)
        elif pending is not None and (pending[3] or seen.dirty):
            for b, row in enumerate(rows.rows):
                self._assign(rows, row, full_ids, b, past, real)
        elif pending is None and mask2d is not None and mask2d.shape[-1] < past + new:
            self._restarted(rows, real)
        seen.dirty = False
        firsts, counts = [], []
        for b, row in enumerate(rows.rows):
            n = sum(real[b])
            counts.append(n)
            firsts.append(pos[b][real[b].index(True)] if n and not row.unwritten else row.num_real)
        rows.batch(firsts, counts, self.tap.shape)
        for b, row in enumerate(rows.rows):
            rows.write(row, tokens[b], real[b], pos[b])
        rows.num_slots = past + new
        self._reads(rows, cache)
        self._padding(rows, past, real)
        stats = self.tap.finish()
        if stats:  # layers x rows events: built directly, with one time for the step's statistics
            t, step, writers = time.perf_counter_ns() - trace.t0, trace.step, [row.writer for row in rows.rows]
            trace.buf.extend(Attn(t=t, step=step, seq=seq, layer=layer, max_logit=max_logit, entropy=entropy,
                                  sink=sink, nonfinite=int(nonfinite))
                             for layer, per_row in stats
                             for seq, (max_logit, entropy, sink, nonfinite) in zip(writers, per_row))
        trace.emit(StepEnd, num_tokens=sum(counts))
        trace.flush()
        trace.step += 1

    def _padding(self, rows: CacheRows, past: int, real: list[list[bool]]) -> None:
        """A ``padding`` event for each row whose padding slots this pass wrote, with the non-finite K/V there."""
        written = self.tap.padding()
        if written is None:
            return
        for row, is_real, (nonfinite, layer) in zip(rows.rows, real, written):
            slots = [past + i for i, r in enumerate(is_real) if not r]
            if slots:
                self.trace.emit(Padding, seq=row.writer, slots=slots, nonfinite=int(nonfinite), layer=layer,
                                cache=rows.label)

    def _start(self, rows: CacheRows, pending: tuple | None, mask2d: Any, batch: int, past: int,
               real: list[list[bool]]) -> None:
        """A cache seen for the first time (or again after a reset): one sequence per row; what it already
        held from before the observer (``past`` slots) is written by that sequence first."""
        if past:
            before = (mask2d[:, :past] != 0).tolist() if mask2d is not None and mask2d.shape[-1] >= past + len(real[0]) \
                else [[True] * past] * batch
            rows.new_rows([sum(r) + sum(n) for r, n in zip(before, real)])
            held = pending[1][:, :past].tolist() if pending is not None else [[None] * past] * batch
            for b, row in enumerate(rows.rows):
                real_before = [sum(before[b][:s]) for s in range(past)]  # a real slot's position: the real tokens before it
                rows.write(row, held[b], before[b], real_before)
            rows.num_slots = past
        else:
            rows.new_rows([sum(r) for r in real])

    def _assign(self, rows: CacheRows, row: Row, full_ids: Any, b: int, past: int, real: list[list[bool]]) -> None:
        """Which sequence row ``b`` computes now: its holder when its slots hold the ids generate has for the
        row; else the holder of the row that does hold them (rows swapped, a reorder applied twice); else a
        new sequence (an unrelated prompt on a used cache). The last two write and read blocks they do not own."""
        prefix = full_ids[b, :past].tolist()
        if row.tokens == prefix or None in row.tokens:
            row.writer = row.holder
            return
        held = rows.find_holder(prefix)
        row.writer = held if held is not None else rows.start_seq(len(full_ids[b]))

    @staticmethod
    def _restarted(rows: CacheRows, real: list[list[bool]]) -> None:
        """A hand-written call whose 2D attention mask covers fewer slots than the cache holds plus the new ones:
        the caller's rows are not the sequences the cache holds (typically a tokenizer's output for a new prompt,
        its mask only as long as the prompt, fed to a used cache). Each row computes a new sequence from here on;
        it writes into and reads blocks it does not own. (transformers accepts such a mask and attends wrongly.)"""
        for b, row in enumerate(rows.rows):
            if row.writer == row.holder:
                row.writer = rows.start_seq(sum(real[b]))

    def _reads(self, rows: CacheRows, cache: Any) -> None:
        """One read per row and per kind of layer (full, or each sliding window), named by its first layer."""
        kinds: dict[Any, int] = {}
        for i, layer in enumerate(getattr(cache, "layers", ())):
            if hasattr(layer, "keys"):
                kinds.setdefault((bool(getattr(layer, "is_sliding", False)), getattr(layer, "sliding_window", None)), i)
        for first in sorted(kinds.values()) or [0]:
            seen_len = self.tap.kv_len.get(first)
            rows.read(first, max(0, rows.num_slots - seen_len) if seen_len is not None else 0)


def _row_indices(index: Any) -> list[int]:
    """The rows a reorder or select keeps, in their new order (indices, or a mask of rows to keep)."""
    import torch

    if isinstance(index, torch.Tensor):
        return (index.nonzero().flatten() if index.dtype == torch.bool else index).tolist()
    return [int(i) for i in index]
