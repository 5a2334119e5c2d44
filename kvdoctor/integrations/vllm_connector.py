"""K/V handed between instances through vLLM's ``ExampleConnector``: the connector's saves and loads as transfers.

Disaggregated prefill saves a prompt's K/V from one instance and loads it into another. vLLM's
``ExampleConnector`` (shared storage: one file per layer under a folder named by a hash of the prompt's
tokens) does it in two places, and the plugin wraps both, class-level, in every process vLLM starts:

- **the scheduler** (engine core) decides which requests' K/V the workers save (``build_connector_meta``) and
  which requests' first tokens come from the store (``update_state_after_alloc``): the engine core's trace
  records each decision as a ``save`` or ``load`` naming the request, its blocks, the connector's key (the
  folder's name: the same on every instance for the same tokens) and the tokens, and no layers or digests (it
  moves no bytes); with several ranks, one per rank, whose key ends in the rank (``@tp1pp0``): each rank saves
  and loads its share of the heads and layers, so a rank's load pairs with the same rank's save;
- **the worker** moves the bytes inside its forward pass (``save_kv_layer`` per layer, ``wait_for_save`` at
  the end; ``start_load_kv`` before it). A worker runs in a process of its own, so it writes a trace of its
  own (``workload.N.kvtrace`` beside the engine core's), tagged with its instance, its tensor- and
  pipeline-parallel rank and the layers its stage holds: a ``save`` per stored request with the layers it
  saved and a digest per block of the K/V read out of the paged cache, and a ``load`` per loaded request with
  the layers it loaded and the digest of the K/V that landed.

Both digests cover the same rows (the connector's slot mapping) and are sums of per-row digests
(``vllm_digests``: a token's K and V at one layer, keyed by its position and layer) over the block's rows and
the layers, whatever their order, so a save on one instance and a load on another of the same
layers agree exactly when the destination holds what the source saved: ``kvdoctor check`` over the workload
names a load of other K/V (``handoff/digest-mismatch``: a stale or foreign file under the key), a rank that
saved nothing or fewer layers than it holds for a request its scheduler asked it to save
(``handoff/save-missing``, ``handoff/save-layers``), and a load of fewer layers or blocks than the save
(``handoff/partial-load``), with the request from the engine core's record of the same save or load. Every
wrapper runs the connector's method as called; a failure of the bookkeeping stops that trace (one
``observer_error``) and vLLM goes on.

A rank that digests its own writes (``KVDOCTOR_VLLM_RANK_DIGESTS``, ``vllm_ranks``) is handed each save's
per-layer block digests in its process, and records the save in its trace against what its forward passes
wrote: bytes changed between a rank's write and its connector's save are ``integrity/read-mismatch``.
"""

from __future__ import annotations

import atexit
import itertools
import os
import time
from datetime import datetime, timezone
from typing import Any, Callable

from ..events import Header, ObserverError, TierSpec, TransferDone, TransferStart
from ..trace import TraceWriter
from .guard import Guard
from .vllm_digests import MASK, block_sums, cache_rows, linear, row_digests, unsigned
from .vllm_ranks import digesting_rank, pp_rank, stage_layers, tp_rank

__all__ = ["patch_example_connector", "attach", "WorkerTrace"]

_TRACE = "_kvdoctor_trace"  # the attribute a connector's trace hangs on: its scheduler's tracer, or its own
_SEQ = "_kvdoctor_seq"  # the attribute naming the request of a save or load the scheduler orders (it travels along)
_ids = itertools.count()


def attach(tracer: Any, connector: Any) -> None:
    """``connector`` is the scheduler side of ``tracer``'s engine: it records the loads it schedules there."""
    if connector is not None:
        setattr(connector, _TRACE, tracer)


def patch_example_connector(path: str, engine: str, trace_file: Callable[[str], str]) -> None:
    """Wrap ``ExampleConnector`` once per process (a vLLM without it: nothing). A worker-side connector built
    in this process writes its transfers to ``trace_file(path)``."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
    except ImportError:
        return
    if getattr(ExampleConnector, "_kvdoctor_patched", False):
        return
    original_init = ExampleConnector.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        try:
            if _is_worker(self):  # a trace per worker-side connector: per instance, even in one process
                setattr(self, _TRACE, WorkerTrace(self, trace_file(path), engine))
        except Exception as exc:  # the trace could not even start: the connector works untraced
            _say(f"not tracing this vLLM worker's KV connector ({type(exc).__name__}: {exc})")

    ExampleConnector.__init__ = __init__
    for name, after in (("save_kv_layer", _saved_layer), ("wait_for_save", _saves_done),
                        ("start_load_kv", _loaded), ("update_state_after_alloc", _will_load),
                        ("build_connector_meta", _will_save)):
        setattr(ExampleConnector, name, _watched(getattr(ExampleConnector, name), name, after))
    ExampleConnector._kvdoctor_patched = True


def _say(message: str) -> None:
    try:
        import sys

        sys.stderr.write(f"kvdoctor: {message}\n")
    except Exception:
        pass


def _is_worker(connector: Any) -> bool:
    role = getattr(connector, "_role", None)
    return getattr(role, "name", str(role)).upper().endswith("WORKER")


def _watched(original: Callable, name: str, after: Callable[..., None]) -> Callable:
    """``original`` as called; then ``after(trace, connector, result, *args, **kwargs)`` under the guard."""
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        trace = getattr(self, _TRACE, None)
        if trace is not None and trace.writer is not None and trace.guard.live:
            trace.guard.attempt(f"ExampleConnector.{name}", after, trace, self, result, *args, **kwargs)
        return result

    method.__wrapped__ = original  # type: ignore[attr-defined]
    return method


class WorkerTrace:
    """A worker's own trace: the K/V its connector saved and loaded, step by step (one step a forward pass)."""

    def __init__(self, connector: Any, path: str, engine: str) -> None:
        self._t0 = time.perf_counter_ns()
        self.step = 0
        # key -> [request, digests so far, layers so far, {layer: its block digests}] of this forward's saves
        self.pending: dict[str, list] = {}
        self.shard = _shard(connector)  # this rank's share of every key it saves and loads
        self.writer: TraceWriter | None = None
        self.guard = Guard("vllm", self._record_error, lambda: None)
        self.writer = TraceWriter(path, _worker_header(connector, engine, self._t0))
        atexit.register(self.close)

    def _emit(self, cls: type, **fields: Any) -> None:
        if self.writer is not None:
            self.writer.write_many([cls(t=time.perf_counter_ns() - self._t0, step=self.step, **fields)])

    def _record_error(self, event: ObserverError) -> None:
        self._emit(ObserverError, **{f: getattr(event, f) for f in event.__struct_fields__ if f not in ("t", "step")})
        self.close()

    def close(self) -> None:
        try:
            atexit.unregister(self.close)
            if self.writer is not None and not self.writer.closed:
                self.writer.close()
        except Exception as exc:
            _say(f"the worker's trace could not be closed ({type(exc).__name__}: {exc})")


def _worker_header(connector: Any, engine: str, t0_perf: int) -> Header:
    """Who this worker is: its instance (the connector's engine id) and its ranks; a fact it lacks is left out.

    The ranks are named in ``engine``, not as ``tp_rank``/``pp_rank``: a header with those is a rank's view of
    the engine's block table, which the ranks of one engine compare step by step; a connector's saves and loads
    are no such view (beside a rank's own trace in a tensor-parallel worker, it would differ from it at start-up)."""
    fields: dict[str, Any] = {}
    config = getattr(connector, "_vllm_config", None)
    facts: dict[str, Callable[[], Any]] = {
        "num_layers": lambda: config.model_config.get_num_layers(config.parallel_config),
        "model": lambda: str(config.model_config.model),
        "instance": lambda: config.kv_transfer_config.engine_id,
        "dp_rank": lambda: config.parallel_config.data_parallel_rank,
        "dp_size": lambda: config.parallel_config.data_parallel_size,
        "tp_size": lambda: config.parallel_config.tensor_parallel_size,
        "pp_size": lambda: config.parallel_config.pipeline_parallel_size,
        "layers": lambda: stage_layers(config),
        "tp": tp_rank,
        "pp": pp_rank,
    }
    for name, get in facts.items():
        try:
            fields[name] = get()
        except Exception:
            pass
    ranks = "".join(f" {r} {fields.pop(r)}" for r in ("tp", "pp") if r in fields)
    return Header(block_size=connector._block_size, num_layers=fields.pop("num_layers", 0),
                  tiers=[TierSpec(name="device", capacity_blocks=0)], engine=f"{engine} worker{ranks}", pid=os.getpid(),
                  created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  t0=time.time_ns() - (time.perf_counter_ns() - t0_perf),
                  **{k: v for k, v in fields.items() if v is not None})


# ---- the bytes: digests per block ----------------------------------------------------------


def _block_digests(kv_layer: Any, slot_mapping: Any, layer: int, block_size: int) -> list[int]:
    """Per block of the request's slots (its tokens from position 0, a block at a time): the sum of its rows'
    digests in this layer (summed over layers later)."""
    import torch

    slots = slot_mapping.to(kv_layer.device)
    lin = linear(cache_rows(kv_layer, slots, block_size)).cpu()
    digests = row_digests(lin, torch.arange(lin.shape[0], dtype=torch.int64), torch.tensor(layer))
    return unsigned(block_sums(digests, block_size))


def _add(total: list[int] | None, part: list[int]) -> list[int]:
    return part if total is None else [(a + b) & MASK for a, b in zip(total, part)]


def _requests(connector: Any, store: bool) -> list[Any]:
    meta = connector._get_connector_metadata()
    return [r for r in getattr(meta, "requests", ()) if r.is_store == store]


def _key(connector: Any, token_ids: Any, mm_hashes: list[str]) -> str:
    return os.path.basename(connector._generate_foldername_debug(token_ids, mm_hashes, create_folder=False))


def _shards(connector: Any) -> list[str]:
    """What each rank of an engine with several appends to a key: its K/V is its share of the heads and layers,
    so a rank's load pairs with the same rank's save (``@tp0pp0``); nothing with one rank."""
    parallel = connector._vllm_config.parallel_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    return [f"@tp{t}pp{p}" for p in range(pp) for t in range(tp)] if tp * pp > 1 else [""]


def _shard(connector: Any) -> str:
    """This worker's suffix of ``_shards``."""
    parallel = connector._vllm_config.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size == 1:
        return ""
    return f"@tp{tp_rank()}pp{pp_rank()}"


def _blocks(request: Any, block_size: int) -> list[int]:
    return list(dict.fromkeys(int(s) // block_size for s in request.slot_mapping.tolist()))


# ---- the worker: saves and loads with their digests ----------------------------------------


def _layer_index(layer_name: str) -> int:
    """The model layer a vLLM attention layer's name holds ("model.layers.3.self_attn.attn": 3)."""
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer_name)


def _saved_layer(trace: WorkerTrace, connector: Any, _: Any, layer_name: str, kv_layer: Any,
                 *args: Any, **kwargs: Any) -> None:
    """A layer of each stored request was written to its file: add that layer's bytes to its blocks' digests."""
    bs = connector._block_size
    layer = _layer_index(layer_name)
    for request in _requests(connector, store=True):
        digests = _block_digests(kv_layer, request.slot_mapping, layer, bs)
        key = _key(connector, request.token_ids, request.mm_hashes) + trace.shard
        entry = trace.pending.setdefault(key, [request, None, [], {}])
        entry[1] = _add(entry[1], digests)
        entry[2].append(layer)
        entry[3][layer] = digests


def _saves_done(trace: WorkerTrace, connector: Any, *args: Any, **kwargs: Any) -> None:
    """The forward pass ended with every layer saved: one save per stored request; the next step begins."""
    pending, trace.pending = trace.pending, {}
    bs = connector._block_size
    rank = digesting_rank()
    for key, (request, digests, layers, per_layer) in pending.items():
        transfer = f"save:{key[:12]}:{next(_ids)}"
        blocks, seq = _blocks(request, bs), getattr(request, _SEQ, None)
        trace._emit(TransferStart, transfer=transfer, op="save", blocks=blocks, src="device", seq=seq,
                    dst=f"connector:{connector._storage_path}", key=key, num_tokens=len(request.slot_mapping),
                    layers=sorted(set(layers)), digests=digests)
        trace._emit(TransferDone, transfer=transfer)
        if rank is not None and seq is not None:  # the rank judges the bytes saved against those it wrote
            rank.guard.attempt("ExampleConnector.wait_for_save", rank.saved, seq, blocks, per_layer)
    trace.step += 1


def _loaded(trace: WorkerTrace, connector: Any, _: Any, forward_context: Any, *args: Any, **kwargs: Any) -> None:
    """``start_load_kv`` injected each loaded request's K/V into every attention layer of the forward context
    it was handed: digest what landed, over the same rows, and name those layers."""
    if forward_context.attn_metadata is None:
        return  # the connector loaded nothing this time
    bs = connector._block_size
    for request in _requests(connector, store=False):
        digests: list[int] | None = None
        layers = []
        for layer_name, layer in forward_context.no_compile_layers.items():
            kv = getattr(layer, "kv_cache", None)
            if kv is None:
                continue
            kv = kv[0] if isinstance(kv, (list, tuple)) else kv
            layers.append(_layer_index(layer_name))
            digests = _add(digests, _block_digests(kv, request.slot_mapping, layers[-1], bs))
        key = _key(connector, request.token_ids, request.mm_hashes) + trace.shard
        transfer = f"load:{key[:12]}:{next(_ids)}"
        trace._emit(TransferStart, transfer=transfer, op="load", blocks=_blocks(request, bs),
                    seq=getattr(request, _SEQ, None),
                    src=f"connector:{connector._storage_path}", dst="device", key=key,
                    num_tokens=len(request.slot_mapping), layers=sorted(set(layers)))
        trace._emit(TransferDone, transfer=transfer, digests=digests)


# ---- the scheduler: which request a save or a load is for ----------------------------------


def _will_load(tracer: Any, connector: Any, _: Any, request: Any, blocks: Any, num_external_tokens: int,
               *args: Any, **kwargs: Any) -> None:
    """The scheduler gave ``request`` blocks for tokens the connector will load: record that load (its bytes
    land in the worker's next forward, whose trace has their digests) under the same key."""
    if not num_external_tokens:
        return
    import torch

    bs = connector._block_size
    prompt = list(request.prompt_token_ids or [])
    valid = (len(prompt) - 1) // bs * bs  # the tokens the connector keys and moves (make_meta's alignment)
    mm = [f.identifier for f in getattr(request, "mm_features", None) or ()]
    key = _key(connector, torch.tensor(prompt)[:valid], mm)
    ids = [b for b in blocks.get_block_ids()[0][:valid // bs]]
    for shard in _shards(connector):  # every rank loads its share: the request is named on each rank's load
        transfer = f"load:{key[:12]}:{next(_ids)}"
        tracer._emit(TransferStart, transfer=transfer, op="load", blocks=ids, seq=request.request_id,
                     src=f"connector:{connector._storage_path}", dst="device", key=key + shard, num_tokens=valid)
        tracer._emit(TransferDone, transfer=transfer)


def _will_save(tracer: Any, connector: Any, meta: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> None:
    """The scheduler built the workers' orders for this step: each save and load it orders is tagged with its request
    (the workers' traces name it from their own copy of the orders, whatever order the traces are read in), and
    each save is recorded here, one per rank, under the key each rank's worker saves it under (a rank that saves
    nothing is then named)."""
    bs = connector._block_size
    new = {tuple(r.block_ids[0]): r.req_id for r in scheduler_output.scheduled_new_reqs}
    for request in getattr(meta, "requests", ()):
        ids = _blocks(request, bs)
        seq = next((s for blocks, s in new.items() if list(blocks[:len(ids)]) == ids), None)
        setattr(request, _SEQ, seq)
        if not request.is_store:
            continue
        key = _key(connector, request.token_ids, request.mm_hashes)
        for shard in _shards(connector):
            transfer = f"save:{key[:12]}:{next(_ids)}"
            tracer._emit(TransferStart, transfer=transfer, op="save", blocks=ids, seq=seq, src="device",
                         dst=f"connector:{connector._storage_path}", key=key + shard,
                         num_tokens=len(request.slot_mapping))
            tracer._emit(TransferDone, transfer=transfer)
