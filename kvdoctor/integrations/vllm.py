"""kvdoctor inside vLLM: a general plugin that writes vLLM v1's KV-cache bookkeeping as a kvdoctor trace.

vLLM loads ``register`` in every process it starts (entry-point group ``vllm.general_plugins``).
With ``KVDOCTOR_TRACE`` set, the plugin patches the v1 ``Scheduler`` so that the process that
builds one (the engine core) wraps that scheduler's block pool and KV cache manager and writes:

- ``seq_start``/``seq_end`` per request (``aborted`` for aborts, ``finished`` otherwise); a request whose
  blocks a KV connector still sends ends when vLLM frees them, not when it finishes. ``seq_start`` names what
  vLLM's prefix key holds besides the tokens, each part apart: adapter, cache salt, images' identifiers;
- ``alloc`` when the pool hands a block to a request, ``share`` when a prefix-cache hit takes a
  reference, ``release``/``free`` as references return, ``evict`` when a cached block is reused;
- the prefix cache as an owner of its own (``seq="prefix-cache"``): a full block registered under a
  hash stays owned by the cache after its last request ends, so it is never mistaken for a leak;
  blocks whose free vLLM defers (until the step that may still write them is done) are held by ``vllm``;
- one ``batch`` per step with each request's position and token count, the ``write``s those tokens
  make into the request's blocks, the ``read`` of its block table with its ``span`` (the positions attention
  covers: every computed token), and ``usage`` of the pool.

Ownership comes from what vLLM does to its reference counts, in the request context the KV cache
manager is in (allocate, free, preempt), so a reference vLLM forgets to drop shows up as a block
still owned when its request ends. Content keys are kvdoctor's own: a chain digest of the token ids in each
full block (with the request's cache salt and LoRA name, and the images whose placeholders it holds), computed
from the tokens of the request that registers a block and again from the tokens of each request that hits it,
so a hit on a block whose content is not the hitting request's prefix is visible whatever vLLM's hash says.

The plugin never harms vLLM: every wrapper runs vLLM's method exactly as called (``guard.Guard``), and
a failure of kvdoctor's own bookkeeping records one ``observer_error``, stops tracing and lets vLLM go
on. Versions: ``vllm_versions`` (an unknown one is traced with a warning, never refused).

Not observed: attention statistics (vLLM's CPU attention kernels give no cheap hook), KV offloading
to CPU, the bytes a KV connector moves.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
import weakref
from array import array
from datetime import datetime, timezone
from typing import Any, Callable

from .. import knobs
from .. import callsite
from ..events import (
    Alloc, Batch, Evict, Free, Header, Read, Release, Rollback, SeqEnd, SeqStart, Share, StepEnd,
    TierSpec, TransferDone, TransferFailed, TransferStart, Usage, Weights, Write,
)
from ..trace_names import claim
from . import vllm_connector, vllm_ranks, vllm_stacks
from .guard import Call, Guard
from .vllm_versions import POLICY, SUPPORTED, Methods, is_supported, methods_for
from .vllm_lora import watch_adapters
from .vllm_trace import BufferedTrace, warn
from .vllm_weights import patch_engine_core

__all__ = ["register", "VllmTracer", "PREFIX_CACHE", "SUPPORTED"]

PREFIX_CACHE = "prefix-cache"  # the owner a prefix cache holds its registered blocks as
INTERNAL = "vllm"  # the owner of blocks vLLM holds outside any request (copy-on-write copies, deferred frees)




def _pool_of(block: Any) -> Any:
    """The pool a block belongs to (vLLM 0.34 keeps it as a weak reference)."""
    pool = block.pool
    return pool() if isinstance(pool, weakref.ref) else pool


def _mm_items(request: Any) -> list[tuple[str, int, int]]:
    """(identifier, first placeholder position, placeholder count) of each multimodal item of ``request``: vLLM
    keys a block holding an item's placeholder tokens by its identifier too (``_gen_mm_extra_hash_keys``)."""
    return [(f.identifier, f.mm_position.offset, f.mm_position.length) for f in getattr(request, "mm_features", None) or ()]


def register() -> None:
    """vLLM's plugin hook; does nothing unless ``KVDOCTOR_TRACE`` names a trace to write. Never raises."""
    try:
        path = knobs.get(knobs.TRACE)
        if path:
            _patch_scheduler(path)
    except Exception as exc:
        warn(f"not tracing vLLM ({type(exc).__name__}: {exc}); vLLM runs without kvdoctor")


def _patch_scheduler(path: str) -> None:
    try:
        import vllm
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError as exc:
        warn(f"not tracing vLLM: its v1 scheduler is not importable ({exc})")
        return
    vllm_stacks.carry_stacks()  # in the process that adds requests: their user's frames go with them
    version = getattr(vllm, "__version__", "unknown")
    if not is_supported(version):
        warn(f"vLLM {version} is not a release kvdoctor was built against (supported: "
              f"{', '.join(SUPPORTED.values())}: {POLICY}); tracing what still matches")
    # a worker in this process (any process vLLM starts) records its connector's saves and loads, in a trace
    # numbered from 2: the path itself stays the engine core's, which a user checking one file wants
    try:
        vllm_connector.patch_example_connector(path, f"vllm {version}", vllm_ranks.claim_locked)
    except Exception as exc:
        warn(f"not tracing vLLM's KV connector ({type(exc).__name__}: {exc})")
    # a worker of an engine with several ranks writes its rank's view of the cache, in a trace numbered likewise
    try:
        vllm_ranks.patch_model_runner(path, f"vllm {version}")
    except Exception as exc:
        warn(f"not tracing vLLM's tensor- and pipeline-parallel ranks ({type(exc).__name__}: {exc})")
    if getattr(Scheduler, "_kvdoctor_patched", False):
        return
    original_init = Scheduler.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if getattr(Scheduler, "_kvdoctor_tracing", False):  # one trace per process: the first scheduler
            return
        Scheduler._kvdoctor_tracing = True
        try:
            self._kvdoctor = VllmTracer(self, path, engine=f"vllm {version}", methods=methods_for(version))
            from vllm.v1.engine.core import EngineCore  # the process building a scheduler is the engine core

            patch_engine_core(EngineCore)
            watch_adapters(self._kvdoctor, EngineCore)
        except Exception as exc:  # the trace could not even start (an unwritable path): vLLM goes on
            warn(f"not tracing vLLM ({type(exc).__name__}: {exc})")

    Scheduler.__init__ = __init__
    Scheduler._kvdoctor_patched = True


def _kv_spec(scheduler: Any) -> Any:
    return scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec


def _role(scheduler: Any) -> str | None:
    role = scheduler.vllm_config.kv_transfer_config.kv_role
    return {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}.get(role, role)


# Header facts, each read on its own so that one this vLLM lacks leaves only itself out.
_HEADER_FACTS: dict[str, Callable[[Any], Any]] = {
    "block_size": lambda s: _kv_spec(s).block_size,
    "capacity": lambda s: s.kv_cache_manager.block_pool.num_gpu_blocks - 1,
    "num_layers": lambda s: s.vllm_config.model_config.get_num_layers(s.vllm_config.parallel_config),
    "model": lambda s: str(s.vllm_config.model_config.model),
    # a KV connector's engine id names the instance both ends of a handoff agree on
    "instance": lambda s: s.vllm_config.kv_transfer_config.engine_id,
    "role": _role,
    "dp_rank": lambda s: s.vllm_config.parallel_config.data_parallel_rank,
    "dp_size": lambda s: s.vllm_config.parallel_config.data_parallel_size,
    "tp_size": lambda s: s.vllm_config.parallel_config.tensor_parallel_size,
    "pp_size": lambda s: s.vllm_config.parallel_config.pipeline_parallel_size,
    # what a block holds, as the cache spec says: two instances handing K/V over must agree on it
    "kv_layout": lambda s: (f"{type(_kv_spec(s)).__name__}(kv_heads={_kv_spec(s).num_kv_heads}, "
                            f"head_size={_kv_spec(s).head_size}, dtype={_kv_spec(s).dtype})"),
}


class VllmTracer(BufferedTrace):
    """Writes one scheduler's KV-cache story; every method runs on vLLM's scheduler thread."""

    def __init__(self, scheduler: Any, path: str, *, engine: str, methods: Methods = Methods()) -> None:
        super().__init__()
        self.scheduler = scheduler
        self._wrapped: list[tuple[Any, str]] = []
        self.guard = Guard("vllm", self._record_error, self._stop)
        self.header = self._header(scheduler, engine)
        self._open(vllm_ranks.claim_locked(path, 1), self.header)
        self.guard.attempt("start-up", self._start, scheduler, methods)
        if self.guard.live:
            vllm_connector.attach(self, getattr(scheduler, "connector", None))  # it records the loads it schedules

    def _header(self, scheduler: Any, engine: str) -> Header:
        """What the trace can say about the cache and who wrote it; a fact this vLLM does not offer is left out.

        The scheduler is the engine's (one per data-parallel engine), not a tensor- or pipeline-parallel
        rank's: the header names its data-parallel rank and the engine's parallel sizes, no tp/pp rank."""
        fields: dict[str, Any] = {}
        for name, get in _HEADER_FACTS.items():
            try:
                fields[name] = get(scheduler)
            except Exception:
                pass
        return Header(block_size=fields.pop("block_size", 0), num_layers=fields.pop("num_layers", 0),
                      tiers=[TierSpec(name="device", capacity_blocks=fields.pop("capacity", 0))],
                      engine=engine, pid=os.getpid(), created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      t0=time.time_ns() - (time.perf_counter_ns() - self._t0),
                      **{k: v for k, v in fields.items() if v is not None})

    def _start(self, scheduler: Any, methods: Methods) -> None:
        self.manager = manager = scheduler.kv_cache_manager
        self.pool = pool = manager.block_pool
        self.block_size = self.header.block_size
        self.capacity = pool.num_gpu_blocks - 1  # block 0 is vLLM's null block, never handed out
        self.null_id = pool.null_block.block_id
        # every row of every step reads its request's block table: from vLLM's own table where this vLLM has one
        # (one dict lookup), not through get_block_ids' chain of calls and copies
        try:
            self._tables: Any = manager.coordinator.single_type_managers[0].req_to_blocks
        except (AttributeError, IndexError, TypeError):
            self._tables = None
        self._request: Any = None  # the request whose blocks vLLM is handing out or taking back now
        self._holders: dict[int, list] = {}  # block -> owners holding a reference, one entry per reference
        self._cached: dict[int, str] = {}  # block -> content key it is registered under in the prefix cache
        self._versions: dict[Any, int] = {}  # request -> cache version (tokens written so far, all lives)
        self._block_version: dict[int, int] = {}  # block -> version of the last write into it
        self._keys: dict[Any, list[str]] = {}  # request -> content keys of its full blocks, in order
        self._ending: dict[Any, str] = {}  # request -> seq_end reason, while a connector still holds its blocks
        self._written: dict[Any, int] = {}  # request -> where this step's writes end (drafts included)
        self._length: dict[Any, int] = {}  # request -> tokens the trace has written for it (its cached length)
        self._transfers: dict[Any, str] = {}  # request -> its open transfer (a connector's load or send)
        self._transfer_ids = itertools.count()
        self._weights: str | None = None  # digest of the weights' sample when last looked (vllm_weights)
        self.weights_version = 0
        hooks = {**self._pool_hooks(pool), **self._manager_hooks(), **self._scheduler_hooks()}
        missing = [f"{type(obj).__name__}.{name}" for obj, names in
                   ((pool, methods.pool), (manager, methods.manager), (scheduler, methods.scheduler))
                   for name in names if not hasattr(obj, name)]
        lacking = [m for m in missing if m in methods.essential]
        if lacking:
            raise AttributeError(f"this vLLM lacks {', '.join(lacking)}: block ownership cannot be traced")
        for obj, names in ((pool, methods.pool), (manager, methods.manager), (scheduler, methods.scheduler)):
            for name in names:
                if hasattr(obj, name):
                    self._wrap(obj, name, **hooks[name])

    def _wrap(self, obj: Any, name: str, **hooks: Any) -> None:
        """Shadow ``obj.name`` on this instance only (vLLM calls it through ``self``), guarded."""
        setattr(obj, name, self.guard.wrap(getattr(obj, name), f"{type(obj).__name__}.{name}", **hooks))
        self._wrapped.append((obj, name))

    def detach(self) -> None:
        """Stop tracing: vLLM's own methods back in place, the trace closed (vLLM keeps running)."""
        self._stop()
        self.close()

    def _stop(self) -> None:
        for obj, name in reversed(self._wrapped):
            obj.__dict__.pop(name, None)
        self._wrapped = []

    # ---- output ---------------------------------------------------------------------

    def _owner(self) -> Any:
        return self._request.request_id if self._request is not None else INTERNAL

    def _content_keys(self, request: Any, num_blocks: int) -> list[str]:
        """Chain digests of ``request``'s first ``num_blocks`` full blocks of token ids, each with the multimodal
        items whose placeholder tokens it holds (an image's tokens are placeholders: its identifier is its content)."""
        keys = self._keys.setdefault(request.request_id, [])
        if len(keys) < num_blocks:
            tokens = request.all_token_ids
            # each part tagged, so a cache salt equal to an adapter's name keys other blocks (vllm #44701)
            lora = getattr(request.lora_request, "lora_name", None)
            salt = repr((("lora", lora), ("cache_salt", getattr(request, "cache_salt", None)))).encode()
            items = _mm_items(request)
            bs = self.block_size
            for i in range(len(keys), num_blocks):
                parent = keys[i - 1].encode() if i else salt
                start, end = i * bs, (i + 1) * bs
                chunk = array("q", tokens[start:end]).tobytes()
                held = [("mm", ident, offset - start) for ident, offset, length in items
                        if offset < end and offset + length > start]
                if held:
                    chunk += repr(held).encode()
                keys.append(hashlib.blake2b(parent + chunk, digest_size=8).hexdigest())
        return keys

    # ---- the block pool -------------------------------------------------------------

    def _pool_hooks(self, pool: Any) -> dict[str, dict[str, Callable]]:
        def get_new_blocks(call: Call, blocks: list, _: Any) -> None:
            owner = self._owner()
            for b in blocks:
                self._holders[b.block_id] = [owner]
                self._emit(Alloc, block=b.block_id, tier="device", seq=owner)

        def touch(call: Call, _: Any, __: Any) -> None:
            blocks, owner, request = call["blocks"], self._owner(), self._request
            keys = self._content_keys(request, len(blocks)) if request is not None else None
            for i, b in enumerate(blocks):
                if b.is_null:
                    continue
                self._holders.setdefault(b.block_id, []).append(owner)
                self._emit(Share, block=b.block_id, seq=owner, hash=keys[i] if keys else None)

        def read_blocks_once(call: Call) -> None:
            # vLLM may pass a one-shot iterator (reversed(...)), which vLLM reads into a list itself first
            blocks = call["ordered_blocks"]
            if not isinstance(blocks, (list, tuple)):
                call.replace("ordered_blocks", list(blocks))

        def free_blocks(call: Call, _: Any, __: Any) -> None:
            owner = self._owner()
            for b in call["ordered_blocks"]:
                if b.is_null or _pool_of(b) is not pool:
                    continue
                holders = self._holders.get(b.block_id)
                if holders:
                    who = owner if owner in holders else holders[-1]
                    holders.remove(who)
                    self._emit(Release, block=b.block_id, seq=who)
                if b.ref_cnt == 0 and b.block_id not in self._cached:
                    self._holders.pop(b.block_id, None)
                    self._emit(Free, block=b.block_id)

        def cache_full_blocks(call: Call, _: Any, __: Any) -> None:
            blocks, num_full = call["blocks"], call["num_full_blocks"]
            keys = self._content_keys(call["request"], num_full)
            for i in range(call["num_cached_blocks"], num_full):
                b = blocks[i]
                if b.is_null or b.block_hash is None or b.block_id in self._cached:
                    continue
                self._cached[b.block_id] = keys[i]
                self._emit(Share, block=b.block_id, seq=PREFIX_CACHE, hash=keys[i])

        def remove_hashes(call: Call, removed: Any, _: Any) -> None:
            block = call["block"]
            if removed and self._cached.pop(block.block_id, None) is not None:
                if block.ref_cnt == 0:  # a cached block nobody holds: its tokens are dropped for reuse
                    self._holders.pop(block.block_id, None)
                    self._emit(Evict, block=block.block_id, tier="device", reason="prefix-cache")
                else:
                    self._emit(Release, block=block.block_id, seq=PREFIX_CACHE)

        def move_key(call: Call) -> str | None:
            return self._cached.get(call["src_block"].block_id)

        def move_block_hashes(call: Call, _: Any, key: str | None) -> None:
            dst = call["dst_block"]
            if key is not None and dst.block_hash is not None:
                self._cached[dst.block_id] = key
                self._emit(Share, block=dst.block_id, seq=PREFIX_CACHE, hash=key)

        def reset_prefix_cache(call: Call, done: bool, _: Any) -> None:
            if done:  # vLLM resets only when no request holds a block: every cached block goes
                for block in self._cached:
                    self._holders.pop(block, None)
                    self._emit(Evict, block=block, tier="device", reason="prefix-cache-reset")
                self._cached.clear()

        return {"get_new_blocks": {"after": get_new_blocks}, "touch": {"after": touch},
                "free_blocks": {"before": read_blocks_once, "after": free_blocks},
                "cache_full_blocks": {"after": cache_full_blocks},
                "_remove_cached_block_hashes": {"after": remove_hashes},
                "move_block_hashes": {"before": move_key, "after": move_block_hashes},
                "reset_prefix_cache": {"after": reset_prefix_cache}}

    # ---- the request context --------------------------------------------------------

    def _in_request(self, request_of: Callable[[Call], Any], after: Callable | None = None,
                    first: Callable[[Any], None] | None = None) -> dict[str, Callable]:
        """Hooks that make the request ``request_of(call)`` names the owner of what the pool does inside
        (``first(request)`` runs before, ``after`` after)."""
        def enter(call: Call) -> Any:
            request = request_of(call)
            if first is not None:
                first(request)
            outer, self._request = self._request, request
            return outer

        def leave(outer: Any) -> None:
            self._request = outer

        hooks = {"before": enter, "restore": leave}
        return {**hooks, "after": after} if after is not None else hooks

    def _manager_hooks(self) -> dict[str, dict[str, Callable]]:
        requests = self.scheduler.requests

        def deferred(call: Call, blocks: list, _: Any) -> None:
            # vLLM takes the blocks back from the request now and frees them a step later: held by vLLM meanwhile
            seq = call["request"].request_id
            for b in blocks:
                holders = self._holders.get(b.block_id)
                if b.is_null or not holders or seq not in holders:
                    continue
                holders[holders.index(seq)] = INTERNAL
                self._emit(Share, block=b.block_id, seq=INTERNAL)
                self._emit(Release, block=b.block_id, seq=seq)

        def loaded(call: Call, blocks: Any, _: Any) -> None:
            # tokens a KV connector brings from outside are written into the request's new blocks, after its
            # local prefix hits: the batch that follows starts past them
            external = call["num_external_computed_tokens"]
            if blocks is not None and external:
                request = call["request"]
                start = request.num_computed_tokens + call["num_new_computed_tokens"]
                ids = self._write(request.request_id, start, external)
                if call["delay_cache_blocks"]:  # loaded asynchronously: the bytes land in a later step
                    bs = self.block_size
                    self._transfer_start(request.request_id, "load", ids[start // bs:-(-(start + external) // bs)])

        by_request = self._in_request(lambda call: call["request"])
        return {"allocate_slots": self._in_request(lambda call: call["request"], loaded), "free": by_request,
                "remove_skipped_blocks": self._in_request(lambda call: requests.get(call["request_id"])),
                "pop_blocks_for_free": {"after": deferred}}

    # ---- the scheduler --------------------------------------------------------------

    def _scheduler_hooks(self) -> dict[str, dict[str, Callable]]:
        from vllm.v1.request import RequestStatus

        requests = self.scheduler.requests

        def add_request(call: Call, _: Any, __: Any) -> None:
            request = call["request"]
            if request.request_id in self._versions:  # a streaming update of a live request, not a new one
                return
            self._versions[request.request_id] = 0
            # the user's frames travel with the request from the process that added it (vllm_stacks)
            stack = vllm_stacks.stack_of(request) or callsite.user_stack()
            lora = request.lora_request
            self._emit(SeqStart, seq=request.request_id, prompt_len=request.num_prompt_tokens, stack=stack,
                       # what vLLM's prefix key holds besides the tokens, each part apart (adapters/key-collision)
                       adapter=getattr(lora, "lora_name", None), adapter_id=getattr(lora, "lora_int_id", None),
                       salt=getattr(request, "cache_salt", None) or None,
                       extra_keys=[ident for ident, _, _ in _mm_items(request)] or None)

        def free_request(call: Call, _: Any, __: Any) -> None:
            request = call["request"]
            reason = "aborted" if request.status == RequestStatus.FINISHED_ABORTED else "finished"
            if requests.get(request.request_id) is request:  # a KV connector still holds its blocks
                self._ending[request.request_id] = reason
                self._transfer_start(request.request_id, "save", self.manager.get_block_ids(request.request_id)[0])
            else:
                self._end(request.request_id, reason)

        def free_blocks(call: Call, _: Any, __: Any) -> None:
            seq = call["request"].request_id
            if seq in self._ending:
                self._end(seq, self._ending.pop(seq))

        def received(request: Any) -> None:  # before vLLM caches or frees what the load brought
            failed = request.request_id in self.scheduler.failed_recving_kv_req_ids
            self._transfer_end(request.request_id, "vLLM reported the load failed" if failed else None)

        def transfers_finished(call: Call) -> None:
            # the workers' word that transfers ended, before vLLM frees what they held: a send, and a load of a
            # request that ended meanwhile (a live request's load ends when vLLM takes it in, failed or not)
            output = call["kv_connector_output"]
            for seq in output.finished_sending or ():
                self._transfer_end(seq)
            for seq in output.finished_recving or ():
                request = requests.get(seq)
                if request is not None and request.is_finished():
                    self._transfer_end(seq)

        def after_receipt(call: Call, _: Any, __: Any) -> None:
            request = call["request"]
            self._count_back(request.request_id, request.num_computed_tokens)

        def schedule(call: Call, output: Any, _: Any) -> None:
            self._record_batch(output)

        def update_from_output(call: Call, _: Any, __: Any) -> None:
            self._roll_back_rejected()
            self._end_step(call["scheduler_output"].total_num_scheduled_tokens)

        by_request = self._in_request(lambda call: call["request"])
        return {"add_request": {"after": add_request},
                "_free_request": self._in_request(lambda call: call["request"], free_request),
                "_free_blocks": self._in_request(lambda call: call["request"], free_blocks),
                "_update_from_kv_xfer_finished": {"before": transfers_finished},
                "_update_waiting_for_remote_kv": self._in_request(lambda call: call["request"], after_receipt, received),
                "_preempt_request": by_request,
                "schedule": {"after": schedule}, "update_from_output": {"after": update_from_output}}

    # ---- the weights (vllm_weights wraps the engine core's utilities) ------------------

    def weights_baseline(self, digest: Callable[[], str]) -> str:
        """The weights' digest before a utility runs (taken once: later ones start from the last seen)."""
        if self._weights is None:
            self._weights = digest()
        return self._weights

    def weights_after(self, digest: Callable[[], str], cause: str, detail: Callable[[], str]) -> None:
        """After a utility: a digest that moved is a new weights version, K/V before it stale for hits."""
        new = digest()
        if new != self._weights:
            self._weights = new
            self.weights_version += 1
            self._emit(Weights, version=self.weights_version, cause=cause, detail=detail(), digest=new)

    def _end(self, seq: Any, reason: str) -> None:
        self._emit(SeqEnd, seq=seq, reason=reason, stack=callsite.user_stack())
        for table in (self._versions, self._keys, self._length):
            table.pop(seq, None)

    def _record_batch(self, output: Any) -> None:
        """The step's rows as the worker will compute them, and what each row writes and reads (one time stamp for
        the step's rows: this runs for every row of every step, so their events are built directly)."""
        rows = [d.req_id for d in output.scheduled_new_reqs]
        positions = [d.num_computed_tokens for d in output.scheduled_new_reqs]
        cached = output.scheduled_cached_reqs
        rows += cached.req_ids
        positions += cached.num_computed_tokens
        counts = [output.num_scheduled_tokens[r] for r in rows]
        t = time.perf_counter_ns() - self._t0
        if rows:
            self._buf.append(Batch(t=t, step=self.step, rows=rows, positions=positions, n=counts))
        for seq, pos, n in zip(rows, positions, counts):
            self._write_and_read(seq, pos, n, t)

    def _write(self, seq: Any, pos: int, n: int, t: int | None = None) -> list[int]:
        """``write``s of tokens ``pos … pos+n-1`` into ``seq``'s blocks, at time ``t`` (None: now); returns its
        block ids."""
        tables = self._tables
        block_ids = ([b.block_id for b in tables.get(seq) or ()] if tables is not None
                     else self.manager.get_block_ids(seq)[0])
        bs, end, step, buf = self.block_size, pos + n, self.step, self._buf
        t = time.perf_counter_ns() - self._t0 if t is None else t
        version = self._versions.get(seq, 0)
        while pos < end:
            i = pos // bs
            stop = min(end, (i + 1) * bs)
            version += stop - pos
            block = block_ids[i]
            self._block_version[block] = version
            buf.append(Write(t=t, step=step, block=block, seq=seq, pos=pos, n=stop - pos, version=version))
            pos = stop
        self._versions[seq] = version
        self._written[seq] = self._length[seq] = end
        return block_ids

    def _write_and_read(self, seq: Any, pos: int, n: int, t: int) -> None:
        """The row's writes, then its read: attention covers the request's computed tokens and this step's,
        ``[0, pos + n)``, over its block table. A block a sliding window dropped is vLLM's null block, which
        attention skips: the span starts at the first block the table still holds."""
        block_ids = self._write(seq, pos, n, t)
        end, null = pos + n, self.null_id
        table = block_ids[:-(-end // self.block_size)]
        if null not in table:  # the usual row: every block real
            read, first = table, 0
        else:
            read = [b for b in table if b != null]
            first = next((i for i, b in enumerate(table) if b != null), len(table))
        versions = self._block_version
        self._buf.append(Read(t=t, step=self.step, seq=seq, blocks=read, versions=[versions.get(b, 0) for b in read],
                              span=[min(first * self.block_size, end), end]))

    def _roll_back_rejected(self) -> None:
        """Draft tokens the model rejected: vLLM counts its computed tokens back; the trace rolls them back."""
        requests = self.scheduler.requests
        for seq, end in self._written.items():
            request = requests.get(seq)
            if request is not None and request.num_computed_tokens < end:  # most rows: every token kept
                self._count_back(seq, request.num_computed_tokens, end)
        self._written.clear()

    def _count_back(self, seq: Any, computed: int, end: int | None = None) -> None:
        """A ``rollback`` of what the trace wrote for ``seq`` past vLLM's count of its computed tokens."""
        end = self._length.get(seq, 0) if end is None else end
        if computed < end:
            version = self._versions.get(seq, 0) + 1
            self._versions[seq] = version
            self._length[seq] = computed
            self._emit(Rollback, seq=seq, n=end - computed, version=version)

    # ---- asynchronous transfers (a KV connector's loads and sends) ----------------------

    def _transfer_start(self, seq: Any, op: str, block_ids: list[int]) -> None:
        blocks = [b for b in block_ids if b != self.null_id]
        if seq in self._transfers or not blocks:
            return
        transfer = self._transfers[seq] = f"{op}:{seq}:{next(self._transfer_ids)}"
        src, dst = ("connector", "device") if op == "load" else ("device", "connector")
        self._emit(TransferStart, transfer=transfer, op=op, blocks=blocks, seq=seq, src=src, dst=dst)

    def _transfer_end(self, seq: Any, failed: str | None = None) -> None:
        transfer = self._transfers.pop(seq, None)
        if transfer is not None:
            if failed:
                self._emit(TransferFailed, transfer=transfer, reason=failed)
            else:
                self._emit(TransferDone, transfer=transfer)

    def _end_step(self, num_tokens: int) -> None:
        pool = self.pool
        # vLLM counts a cached block nobody holds as free; the trace counts it as the prefix cache's.
        # Counted over the blocks the trace says the cache holds, judged by vLLM's own state of each.
        blocks = pool.blocks
        cached_idle = sum(1 for b in self._cached if blocks[b].ref_cnt == 0 and blocks[b].block_hash is not None)
        used = self.capacity - pool.get_num_free_blocks() + cached_idle
        self._emit(Usage, tier="device", used_blocks=used, capacity_blocks=self.capacity)
        self._emit(StepEnd, num_tokens=num_tokens)
        self._write_step()
