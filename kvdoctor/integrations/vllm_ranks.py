"""Tensor- and pipeline-parallel ranks: each vLLM worker's own view of the KV cache, in a trace of its own.

vLLM schedules once per engine (in the engine core) and sends every worker the same scheduler output; each
worker keeps its own copy of every request's block table, computes its own slot mapping from it, and its
attention writes and reads K/V through those. A rank that drops a request's slots (its tokens written
nowhere) or holds another block table than its peers computes wrong K/V while the engine core's trace looks
healthy (vLLM PR #50653, LMCache #1807). With ranks to compare (tensor or pipeline parallel size above 1)
the plugin wraps the model runner, class-level, in every worker process, and each rank writes a trace of its
own beside the engine core's (``run.N.kvtrace``), tagged with its instance, data/tensor/pipeline rank and
the layers its stage holds:

- ``seq_start`` when a request first enters the rank's batch, ``seq_end`` when the scheduler says it ended;
- the blocks as the rank's cache holds them: a block first seen is ``alloc``ated to the request whose row
  holds it and shared by the rank's cache (``seq="vllm"``), which never frees it (a worker cannot tell a
  prefix-cache hit from a reuse, which the engine core's trace judges); a later request ``share``s the
  blocks in its row of the rank's block table, and each ``release``s them when it leaves the row;
- per forward pass the ``batch`` the rank computes, a ``write`` per block its slot mapping fills (a slot of
  -1 writes nothing, so nothing is recorded), and the ``read`` of the request's block-table row with the
  positions it attends to (``span``: the request's tokens so far, from the first block a sliding window kept),
  so ``slots/unwritten-read`` names a position this rank never wrote; tokens a KV connector loaded, which no
  forward pass computes, are ``write``s before the batch into the blocks that do not already hold them.

With ``KVDOCTOR_VLLM_RANK_DIGESTS`` a rank also digests what each forward pass writes (each attention layer's
cache update hands over its key and value; ``vllm_digests``): every ``write`` carries its block's content digest
after it, and a KV connector's save in this process (``vllm_connector``) is recorded as the request ``read``ing
the saved blocks with the digest of what was saved and the first layer that differs, so bytes changed between
the rank's write and the save (a block overwritten or reused first) are ``integrity/read-mismatch``. The step's
events then reach the file when the forward pass has run.

Every rank of an engine must record the same story; ``ranks/divergence`` compares them step by step (a step
is a forward pass: every rank runs one per scheduler output). Every wrapper runs vLLM's method as called; a
failure of the bookkeeping records one ``observer_error`` and stops this rank's trace, and vLLM goes on.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from datetime import datetime, timezone
from typing import Any, Callable

from .. import knobs
from ..events import Alloc, Batch, Header, Read, Release, Rollback, SeqEnd, SeqStart, Share, StepEnd, TierSpec, Write
from ..trace_names import claim
from .guard import Call, Guard, positions
from .vllm_trace import BufferedTrace, warn

__all__ = ["patch_model_runner", "RankTrace", "RANK_CACHE", "claim_locked", "stage_layers", "tp_rank", "pp_rank",
           "digesting_rank"]

RANK_CACHE = "vllm"  # the owner a rank's cache holds every block it has seen as
_TRACE = "_kvdoctor_rank"  # the attribute a model runner's trace hangs on


def patch_model_runner(path: str, engine: str) -> None:
    """Wrap vLLM's ``GPUModelRunner`` (the CPU runner inherits it) once per process that builds a worker (vLLM
    loads plugins there before it imports the worker's class; other processes skip the import). A runner of an
    engine with several ranks starts its rank's trace beside ``path`` at its first forward pass; one rank alone,
    nothing."""
    if "vllm.v1.worker.worker_base" not in sys.modules:  # no worker is built here: the runner is not imported
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_kvdoctor_patched", False):
        return
    for name, after in (("_update_states", _updated), ("_prepare_inputs", _prepared), ("execute_model", _executed)):
        setattr(GPUModelRunner, name, _watched(getattr(GPUModelRunner, name), name, after, path, engine))
    GPUModelRunner._kvdoctor_patched = True


def _watched(original: Callable, name: str, after: Callable[..., None], path: str, engine: str) -> Callable:
    arguments = positions(original)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        trace = self.__dict__.get(_TRACE)
        if trace is None:
            trace = self.__dict__[_TRACE] = _start(self, path, engine)
        if trace and trace.guard.live:
            trace.guard.attempt(f"GPUModelRunner.{name}", after, trace, self, Call(arguments, (self, *args), kwargs))
        return result

    method.__wrapped__ = original  # type: ignore[attr-defined]
    return method


def _start(runner: Any, path: str, engine: str) -> RankTrace | bool:
    """This runner's rank trace, or False where there are no ranks to compare (or the trace cannot start)."""
    try:
        parallel = runner.vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size < 2:
            return False
        trace = RankTrace(runner, claim_locked(path), engine)
        if knobs.get(knobs.VLLM_RANK_DIGESTS):
            trace.guard.attempt("rank digests", _digest_writes, trace, runner)
        return trace
    except Exception as exc:  # the trace could not even start: the rank runs untraced
        warn(f"not tracing this vLLM rank ({type(exc).__name__}: {exc})")
        return False


def claim_locked(path: str, first: int = 2) -> str:
    """The next free ``run.N.kvtrace`` (N ≥ ``first``), created under a lock on its folder: ranks, their KV
    connectors and the engine core start at the same moment, and two claiming the same name would write one file."""
    folder = os.path.dirname(os.path.abspath(path))
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        mine = claim(path, first)[0]
        open(mine, "wb").close()  # written since the run began: the next rank's claim passes it by
        return mine
    finally:
        os.close(fd)  # closing the folder releases the lock


class RankTrace(BufferedTrace):
    """One rank's view of the KV cache, forward pass by forward pass (runs on the worker's thread)."""

    def __init__(self, runner: Any, path: str, engine: str) -> None:
        super().__init__()
        self.block_size = runner.cache_config.block_size
        self._seen: set[int] = set()  # blocks this rank has seen (its cache holds them from then on)
        self._rows: dict[str, list[int]] = {}  # request -> the blocks it holds in this rank's block table
        self._versions: dict[str, int] = {}  # request -> tokens written for it, all lives (the write versions)
        self._length: dict[str, int] = {}  # request -> where its writes end
        self._block_version: dict[int, int] = {}  # block -> version of the last write into it
        self._extent: dict[int, tuple[int, int]] = {}  # block -> the positions [lo, hi) its current life's writes hold
        self.digests: Any = None  # vllm_digests.RankDigests where this rank digests its writes
        self._forward: int | None = None  # the tokens of a forward pass whose step waits for it to run
        self.guard = Guard("vllm", self._record_error, lambda: None)
        self._open(path, _rank_header(runner, engine, self._t0))

    def ran(self) -> None:
        """The forward pass that a step waited for has run: its writes get their digests, the step ends."""
        if self._forward is not None:
            num_tokens, self._forward = self._forward, None
            self.digests.fold(self._buf)
            self.flush(num_tokens)

    def saved(self, seq: str, blocks: list[int], per_layer: dict[int, list[int]]) -> None:
        """A KV connector in this process saved ``seq``'s ``blocks`` (``per_layer``: each layer's digest per block):
        the request read them out, with the digest of what was saved and the first layer that differs from what
        this rank's forward passes wrote."""
        self.digests.fold(self._buf)  # the pass saving them has written every layer: its rows count
        digests, layers = self.digests.judge(blocks, per_layer)
        versions = self._block_version
        self._emit(Read, seq=seq, blocks=list(blocks), versions=[versions.get(b, 0) for b in blocks],
                   digests=digests, digest_layers=layers)

    def flush(self, num_tokens: int = 0) -> None:
        """The step ends: what it recorded goes to the file (a killed worker loses at most its last step)."""
        self._emit(StepEnd, num_tokens=num_tokens)
        self._write_step()

    # ---- the rows ------------------------------------------------------------------------

    def hold(self, seq: str, row: list[int]) -> None:
        """``seq``'s row of the block table now holds ``row``: blocks new to it shared, blocks gone released."""
        held = self._rows.setdefault(seq, [])
        if held == row:  # a decode step within its blocks: nothing changed
            return
        if held == row[:len(held)]:
            new = row[len(held):]
        else:  # a row replaced (a resumed request): what it no longer holds goes back first
            kept = set(row)
            for b in held:
                if b not in kept:
                    self._emit(Release, block=b, seq=seq)
            new = [b for b in row if b not in set(held)]
        for b in new:
            if b in self._seen:
                self._emit(Share, block=b, seq=seq)
            else:  # first sight: the request's, and the rank's cache's from now on
                self._seen.add(b)
                self._emit(Alloc, block=b, tier="device", seq=seq)
                self._emit(Share, block=b, seq=RANK_CACHE)
        self._rows[seq] = list(row)

    def leave(self, seq: str) -> None:
        """The scheduler ended ``seq``: the rank's row goes, its blocks stay its cache's."""
        for b in self._rows.pop(seq, ()):
            self._emit(Release, block=b, seq=seq)
        if seq in self._versions:
            self._emit(SeqEnd, seq=seq, reason="finished")
        for table in (self._versions, self._length):
            table.pop(seq, None)

    def _write(self, block: int, seq: str, pos: int, n: int, version: int, t: int, loaded: bool = False) -> None:
        """``n`` tokens of ``seq`` from ``pos`` landed in ``block``: a write whose positions the block holds from now
        (a write that does not continue what the block holds starts its next life: a freed block reused)."""
        self._block_version[block] = version
        extent = self._extent.get(block)
        lo, hi = extent or (pos, pos)
        self._extent[block] = (min(lo, pos), max(hi, pos + n)) if lo <= pos <= hi else (pos, pos + n)
        if self.digests is not None:
            life = "new" if extent is None or not lo <= pos <= hi else "append" if pos == hi else "rewrite"
            self.digests.wrote(len(self._buf), block, seq, "loaded" if loaded else life)
        self._buf.append(Write(t=t, step=self.step, block=block, seq=seq, pos=pos, n=n, version=version))

    def compute(self, seq: str, pos: int, slots: list[int], row: list[int], lead: int, t: int) -> None:
        """``seq``'s tokens from ``pos`` go to ``slots`` (one a token, -1: nowhere); then it reads its row, whose
        first ``lead`` entries (a sliding window's dropped blocks, vLLM's null block) ``row`` leaves out: the read
        spans the positions from the first block kept to the last token computed. Every row of a forward pass is
        stamped with its time ``t`` (it runs once a step per row: its events are built directly)."""
        length = self._length.get(seq, 0)
        if pos < length:  # vLLM counted tokens back (rejected drafts, a preemption): so does the trace
            version = self._versions[seq] = self._versions[seq] + 1
            self._emit(Rollback, seq=seq, n=length - pos, version=version)
        bs, n = self.block_size, len(slots)
        version = self._versions[seq]
        start = 0
        while start < n:  # one write per run of slots in one block (a decode step: one slot, one write)
            block = slots[start] // bs  # -1 (nowhere) stays negative
            stop = start + 1
            while stop < n and slots[stop] // bs == block:
                stop += 1
            if block >= 0:
                version += stop - start
                self._write(block, seq, pos + start, stop - start, version, t)
            start = stop
        self._versions[seq] = version
        end = self._length[seq] = pos + n
        read = row[:-(-end // bs) - lead] if lead else row[:-(-end // bs)]
        versions = self._block_version
        self._buf.append(Read(t=t, step=self.step, seq=seq, blocks=read, versions=[versions.get(b, 0) for b in read],
                              span=[min(lead * bs, end), end]))

    def arrived(self, seq: str, pos: int, row: list[int]) -> None:
        """``seq``'s row starts at ``pos``: tokens before it that no forward pass of this rank computed were loaded
        by a KV connector (the engine core's trace writes them likewise), before the batch that starts past them,
        unless the block already holds those positions: a prefix hit's (a cached block holds the same positions
        of the same prefix)."""
        start, end = self._length.get(seq, 0), pos
        if end <= start:
            return
        bs = self.block_size
        version = self._versions[seq]
        for i in range(start // bs, min(len(row), -(-end // bs))):
            first, stop = max(start, i * bs), min(end, (i + 1) * bs)
            lo, hi = self._extent.get(row[i], (0, 0))
            if not lo <= first < stop <= hi:
                version += stop - first
                self._write(row[i], seq, first, stop - first, version, time.perf_counter_ns() - self._t0, loaded=True)
        self._versions[seq] = version
        self._length[seq] = end


def _updated(trace: RankTrace, runner: Any, call: Call) -> None:
    """The runner took the scheduler output in: ended requests leave, new ones start."""
    trace.ran()  # a step still waiting for its forward pass (one that raised): it ends without digests
    output = call["scheduler_output"]
    for seq in sorted(output.finished_req_ids):  # a set: each process iterates it in its own hash order
        trace.leave(seq)
    for new in output.scheduled_new_reqs:
        if new.req_id not in trace._versions:
            trace._versions[new.req_id] = 0
            trace._emit(SeqStart, seq=new.req_id, prompt_len=len(new.prompt_token_ids or ()))
    if not output.total_num_scheduled_tokens:  # nothing to compute: no forward pass, the step ends here
        trace.flush()


def _prepared(trace: RankTrace, runner: Any, call: Call) -> None:
    """The runner built this forward's inputs: its batch, the slots each row writes, the rows it reads; the
    step ends."""
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    rows = batch.req_ids[:num_reqs]
    counts = call["num_scheduled_tokens"][:num_reqs].tolist()
    positions = batch.num_computed_tokens_cpu[:num_reqs].tolist()
    table = batch.block_table[0]
    total = sum(counts)
    slots = table.slot_mapping.np[:total].tolist()  # one conversion a step: the rows below read plain ints
    # the blocks first, as the scheduler handed them out before the step (a prefix hit's blocks before its
    # batch row starts past them), then the batch and what each row writes and reads
    per_row = table.num_blocks_per_row[:num_reqs].tolist()
    # one conversion a step, as for the slots, as wide as the longest row (a table is max_model_len wide)
    tables = table.block_table.np[:num_reqs, :max(per_row, default=0)].tolist()
    raw = [r[:k] for r, k in zip(tables, per_row)]
    # block 0 is vLLM's null block: the blocks a sliding window dropped, at the start of a row
    held = [r if 0 not in r else [b for b in r if b] for r in raw]
    for seq, row, pos in zip(rows, held, positions):
        trace.hold(seq, row)
        trace.arrived(seq, pos, row)
    t = time.perf_counter_ns() - trace._t0
    trace._buf.append(Batch(t=t, step=trace.step, rows=list(rows), positions=positions, n=counts))
    start = 0
    for i, seq in enumerate(rows):
        trace.compute(seq, positions[i], slots[start:start + counts[i]], held[i], len(raw[i]) - len(held[i]), t)
        start += counts[i]
    if trace.digests is None:
        trace.flush(total)
    else:  # the step ends once the pass has run and its writes' digests are known (``_executed``)
        trace.digests.begin(slots, positions, counts)
        trace._forward = total


def _executed(trace: RankTrace, runner: Any, call: Call) -> None:
    """The runner's forward pass ran (its K/V written, its connector's saves done)."""
    trace.ran()


_digesting: RankTrace | None = None  # this process's rank trace that digests its writes
_TOKEN_LAYOUTS = ("vec", "vec16")  # the CPU attention kernels whose cache layout cache_rows reads token by token


def digesting_rank() -> RankTrace | None:
    """The rank trace of this process that digests its writes, while it traces (a connector hands it its saves)."""
    trace = _digesting
    return trace if trace is not None and trace.guard.live else None


def _digest_writes(trace: RankTrace, runner: Any) -> None:
    """``trace`` digests what each forward pass writes: every attention layer's cache update of its stage hands
    its key and value over (the layer's own method, shadowed on that layer's object). Only layers whose cache
    layout ``vllm_digests.cache_rows`` reads token by token (vLLM's CPU ``vec`` kernels) are watched: a pass
    without every layer seen leaves its blocks unjudged."""
    global _digesting
    from vllm.model_executor.models.utils import extract_layer_index

    from .vllm_digests import RankDigests

    layers = stage_layers(runner.vllm_config)
    for name, module in runner.compilation_config.static_forward_context.items():
        impl = getattr(module, "impl", None)
        if (impl is not None and hasattr(impl, "do_kv_cache_update") and extract_layer_index(name) in layers
                and getattr(module, "isa", None) in _TOKEN_LAYOUTS):
            impl.do_kv_cache_update = _layer_watched(trace, impl.do_kv_cache_update, extract_layer_index(name))
    trace.digests = RankDigests(layers, trace.block_size)
    _digesting = trace


def _layer_watched(trace: RankTrace, original: Callable, layer: int) -> Callable:
    arguments = positions(original)

    def do_kv_cache_update(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if trace.guard.live and trace.digests is not None:
            call = Call(arguments, args, kwargs)
            trace.guard.attempt("do_kv_cache_update", lambda: trace.digests.layer(
                layer, call["key"], call["value"], call["kv_cache"]))
        return result

    do_kv_cache_update.__wrapped__ = original  # type: ignore[attr-defined]
    return do_kv_cache_update


def _rank_header(runner: Any, engine: str, t0_perf: int) -> Header:
    """Who this rank is and what its cache holds; a fact this vLLM does not offer is left out."""
    config = runner.vllm_config
    parallel = config.parallel_config
    facts: dict[str, Callable[[], Any]] = {
        "num_layers": lambda: config.model_config.get_total_num_hidden_layers(),
        "model": lambda: str(config.model_config.model),
        "instance": lambda: config.kv_transfer_config.engine_id,
        "dp_rank": lambda: parallel.data_parallel_rank,
        "dp_size": lambda: parallel.data_parallel_size,
        "tp_size": lambda: parallel.tensor_parallel_size,
        "pp_size": lambda: parallel.pipeline_parallel_size,
        "tp_rank": tp_rank,
        "pp_rank": pp_rank,
        "layers": lambda: stage_layers(config),
        "capacity": lambda: runner.kv_cache_config.num_blocks - 1,  # block 0 is vLLM's null block
        "kv_layout": lambda: _layout(runner.kv_cache_config.kv_cache_groups[0].kv_cache_spec),
    }
    fields: dict[str, Any] = {}
    for name, get in facts.items():
        try:
            fields[name] = get()
        except Exception:
            pass
    return Header(block_size=runner.cache_config.block_size, num_layers=fields.pop("num_layers", 0),
                  tiers=[TierSpec(name="device", capacity_blocks=fields.pop("capacity", 0))],
                  engine=f"{engine} rank", pid=os.getpid(),
                  created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  t0=time.time_ns() - (time.perf_counter_ns() - t0_perf),
                  **{k: v for k, v in fields.items() if v is not None})


def _layout(spec: Any) -> str:
    return f"{type(spec).__name__}(kv_heads={spec.num_kv_heads}, head_size={spec.head_size}, dtype={spec.dtype})"


def stage_layers(config: Any) -> list[int]:
    """The model layers whose K/V this process's pipeline stage holds (every layer with one stage)."""
    from vllm.distributed.utils import get_pp_indices

    total = config.model_config.get_total_num_hidden_layers()
    start, end = get_pp_indices(total, pp_rank(), config.parallel_config.pipeline_parallel_size)
    return list(range(start, end))


def tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def pp_rank() -> int:
    from vllm.distributed.parallel_state import get_pp_group

    return get_pp_group().rank_in_group
