"""kvdoctor inside vLLM: a general plugin that writes vLLM v1's KV-cache bookkeeping as a kvdoctor trace.

vLLM loads ``register`` in every process it starts (entry-point group ``vllm.general_plugins``).
With ``KVDOCTOR_TRACE`` set, the plugin patches the v1 ``Scheduler`` so that the process that
builds one (the engine core) wraps that scheduler's block pool and KV cache manager and writes:

- ``seq_start``/``seq_end`` per request (``aborted`` for aborts, ``finished`` otherwise);
- ``alloc`` when the pool hands a block to a request, ``share`` when a prefix-cache hit takes a
  reference, ``release``/``free`` as references return, ``evict`` when a cached block is reused;
- the prefix cache as an owner of its own (``seq="prefix-cache"``): a full block registered under a
  hash stays owned by the cache after its last request ends, so it is never mistaken for a leak;
- one ``batch`` per step with each request's position and token count, the ``write``s those tokens
  make into the request's blocks, the ``read`` of its block table, and ``usage`` of the pool.

Ownership comes from what vLLM does to its reference counts, in the request context the KV cache
manager is in (allocate, free, preempt), so a reference vLLM forgets to drop shows up as a block
still owned when its request ends. Content keys are kvdoctor's own: a chain digest of the token ids
in each full block (with the request's cache salt and LoRA name), computed from the tokens of the
request that registers a block and again from the tokens of each request that hits it, so a hit on
a block whose content is not the hitting request's prefix is visible whatever vLLM's hash says.

Not observed: attention statistics (vLLM's CPU attention kernels give no cheap hook), KV offloading
to CPU (no connector runs here), blocks freed lazily by KV connectors.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import sys
import time
from array import array
from datetime import datetime, timezone
from typing import Any, Callable

from ..events import (
    Alloc, Batch, Evict, Free, Header, Read, Release, SeqEnd, SeqStart, Share, StepEnd, TierSpec, Usage, Write,
)
from ..trace import TraceWriter

__all__ = ["register", "VllmTracer", "PREFIX_CACHE", "SUPPORTED_VERSIONS"]

TRACE_ENV = "KVDOCTOR_TRACE"
PREFIX_CACHE = "prefix-cache"  # the owner a prefix cache holds its registered blocks as
INTERNAL = "vllm"  # the owner of blocks vLLM takes outside any request (copy-on-write copies)
SUPPORTED_VERSIONS = ("0.32.",)

# What the tracer wraps: if an installed vLLM lacks one of these, its internals moved.
_POOL_METHODS = ("get_new_blocks", "touch", "free_blocks", "cache_full_blocks", "_remove_cached_block_hashes",
                 "move_block_hashes", "reset_prefix_cache", "get_num_free_blocks")
_MANAGER_METHODS = ("allocate_slots", "free", "remove_skipped_blocks", "get_block_ids")
_SCHEDULER_METHODS = ("schedule", "update_from_output", "add_request", "_free_request", "_preempt_request")


def _fail(message: str) -> None:
    """One line for the person running vLLM, not a traceback from inside vLLM's start-up."""
    sys.stderr.write(f"kvdoctor: {message}\n")
    sys.stderr.flush()
    raise SystemExit(2)


def register() -> None:
    """vLLM's plugin hook; does nothing unless ``KVDOCTOR_TRACE`` names a trace to write."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    try:
        import vllm
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError as exc:
        _fail(f"cannot trace this vLLM: its v1 KV cache manager is not importable ({exc})")
    version = getattr(vllm, "__version__", "unknown")
    missing = [f"{cls.__name__}.{m}" for cls, names in ((BlockPool, _POOL_METHODS), (KVCacheManager, _MANAGER_METHODS),
                                                        (Scheduler, _SCHEDULER_METHODS))
               for m in names if not hasattr(cls, m)]
    if not version.startswith(SUPPORTED_VERSIONS) or missing:
        why = f"lacks {', '.join(missing)}" if missing else "is not a version kvdoctor has been built against"
        _fail(f"vLLM {version} {why} (supported: {', '.join(v + 'x' for v in SUPPORTED_VERSIONS)}); "
              f"unset {TRACE_ENV} to run it without kvdoctor")
    if getattr(Scheduler, "_kvdoctor_patched", False):
        return
    original_init = Scheduler.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if not getattr(Scheduler, "_kvdoctor_tracing", False):  # one trace per process: the first scheduler
            Scheduler._kvdoctor_tracing = True
            self._kvdoctor = VllmTracer(self, path, engine=f"vllm {version}")

    Scheduler.__init__ = __init__
    Scheduler._kvdoctor_patched = True


class VllmTracer:
    """Writes one scheduler's KV-cache story; every method runs on vLLM's scheduler thread."""

    def __init__(self, scheduler: Any, path: str, *, engine: str) -> None:
        self.scheduler = scheduler
        self.manager = manager = scheduler.kv_cache_manager
        self.pool = pool = manager.block_pool
        groups = scheduler.kv_cache_config.kv_cache_groups
        self.block_size = groups[0].kv_cache_spec.block_size
        self.capacity = pool.num_gpu_blocks - 1  # block 0 is vLLM's null block, never handed out
        self.null_id = pool.null_block.block_id
        model_config = scheduler.vllm_config.model_config
        header = Header(
            block_size=self.block_size, num_layers=model_config.get_num_layers(scheduler.vllm_config.parallel_config),
            tiers=[TierSpec(name="device", capacity_blocks=self.capacity)], model=str(model_config.model),
            engine=engine, created=datetime.now(timezone.utc).isoformat(timespec="seconds"), pid=os.getpid(),
        )
        self.writer = TraceWriter(path, header)
        self._t0 = time.perf_counter_ns()
        self.step = 0
        self._buf: list = []
        self._request: Any = None  # the request whose blocks vLLM is handing out or taking back now
        self._holders: dict[int, list] = {}  # block -> owners holding a reference, one entry per reference
        self._cached: dict[int, str] = {}  # block -> content key it is registered under in the prefix cache
        self._versions: dict[Any, int] = {}  # request -> cache version (tokens written so far, all lives)
        self._block_version: dict[int, int] = {}  # block -> version of the last write into it
        self._keys: dict[Any, list[str]] = {}  # request -> content keys of its full blocks, in order
        self._wrapped: list[tuple[Any, str]] = []
        self._wrap_pool(pool)
        self._wrap_manager(manager)
        self._wrap_scheduler(scheduler)
        atexit.register(self.close)

    def _wrap(self, obj: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        """Shadow ``obj.name`` with ``make(original)`` on this instance only (vLLM calls it through ``self``)."""
        setattr(obj, name, make(getattr(obj, name)))
        self._wrapped.append((obj, name))

    def detach(self) -> None:
        """Stop tracing: vLLM's own methods back in place, the trace closed (vLLM keeps running)."""
        for obj, name in reversed(self._wrapped):
            delattr(obj, name)
        self._wrapped = []
        atexit.unregister(self.close)
        self.close()

    # ---- output ---------------------------------------------------------------------

    def _emit(self, cls: type, **fields: Any) -> None:
        self._buf.append(cls(t=time.perf_counter_ns() - self._t0, step=self.step, **fields))

    def close(self) -> None:
        if not self.writer.closed:
            self.writer.write_many(self._buf)
            self._buf = []
            self.writer.close()

    def _owner(self) -> Any:
        return self._request.request_id if self._request is not None else INTERNAL

    def _content_keys(self, request: Any, num_blocks: int) -> list[str]:
        """Chain digests of ``request``'s first ``num_blocks`` full blocks of token ids."""
        keys = self._keys.setdefault(request.request_id, [])
        if len(keys) < num_blocks:
            tokens = request.all_token_ids
            lora = getattr(request.lora_request, "lora_name", None)
            salt = f"{lora}|{getattr(request, 'cache_salt', None)}".encode()
            bs = self.block_size
            for i in range(len(keys), num_blocks):
                parent = keys[i - 1].encode() if i else salt
                chunk = array("q", tokens[i * bs:(i + 1) * bs]).tobytes()
                keys.append(hashlib.blake2b(parent + chunk, digest_size=8).hexdigest())
        return keys

    # ---- the block pool -------------------------------------------------------------

    def _wrap_pool(self, pool: Any) -> None:
        def get_new_blocks(original: Callable) -> Callable:
            def call(num_blocks: int) -> list:
                blocks = original(num_blocks)
                owner = self._owner()
                for b in blocks:
                    self._holders[b.block_id] = [owner]
                    self._emit(Alloc, block=b.block_id, tier="device", seq=owner)
                return blocks
            return call

        def touch(original: Callable) -> Callable:
            def call(blocks: Any) -> None:
                original(blocks)
                owner, request = self._owner(), self._request
                keys = self._content_keys(request, len(blocks)) if request is not None else None
                for i, b in enumerate(blocks):
                    if b.is_null:
                        continue
                    self._holders.setdefault(b.block_id, []).append(owner)
                    self._emit(Share, block=b.block_id, seq=owner, hash=keys[i] if keys else None)
            return call

        def free_blocks(original: Callable) -> Callable:
            def call(ordered_blocks: Any) -> None:
                blocks = list(ordered_blocks)  # vLLM passes a reversed iterator: walk it once, keep it
                original(blocks)
                owner = self._owner()
                for b in blocks:
                    if b.is_null or b.pool is not pool:
                        continue
                    holders = self._holders.get(b.block_id)
                    if holders:
                        who = owner if owner in holders else holders[-1]
                        holders.remove(who)
                        self._emit(Release, block=b.block_id, seq=who)
                    if b.ref_cnt == 0 and b.block_id not in self._cached:
                        self._holders.pop(b.block_id, None)
                        self._emit(Free, block=b.block_id)
            return call

        def cache_full_blocks(original: Callable) -> Callable:
            def call(request: Any, blocks: list, num_cached_blocks: int, num_full_blocks: int, *args: Any,
                     **kwargs: Any) -> None:
                original(request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)
                keys = self._content_keys(request, num_full_blocks)
                for i in range(num_cached_blocks, num_full_blocks):
                    b = blocks[i]
                    if b.is_null or b.block_hash is None or b.block_id in self._cached:
                        continue
                    self._cached[b.block_id] = keys[i]
                    self._emit(Share, block=b.block_id, seq=PREFIX_CACHE, hash=keys[i])
            return call

        def remove_hashes(original: Callable) -> Callable:
            def call(block: Any) -> Any:
                removed = original(block)
                if removed and self._cached.pop(block.block_id, None) is not None:
                    if block.ref_cnt == 0:  # a cached block nobody holds: its tokens are dropped for reuse
                        self._holders.pop(block.block_id, None)
                        self._emit(Evict, block=block.block_id, tier="device", reason="prefix-cache")
                    else:
                        self._emit(Release, block=block.block_id, seq=PREFIX_CACHE)
                return removed
            return call

        def move_block_hashes(original: Callable) -> Callable:
            def call(src: Any, dst: Any) -> None:
                key = self._cached.get(src.block_id)
                original(src, dst)
                if key is not None and dst.block_hash is not None:
                    self._cached[dst.block_id] = key
                    self._emit(Share, block=dst.block_id, seq=PREFIX_CACHE, hash=key)
            return call

        def reset_prefix_cache(original: Callable) -> Callable:
            def call() -> bool:
                done = original()
                if done:  # vLLM resets only when no request holds a block: every cached block goes
                    for block in self._cached:
                        self._holders.pop(block, None)
                        self._emit(Evict, block=block, tier="device", reason="prefix-cache-reset")
                    self._cached.clear()
                return done
            return call

        for name, make in (("get_new_blocks", get_new_blocks), ("touch", touch), ("free_blocks", free_blocks),
                           ("cache_full_blocks", cache_full_blocks), ("_remove_cached_block_hashes", remove_hashes),
                           ("move_block_hashes", move_block_hashes), ("reset_prefix_cache", reset_prefix_cache)):
            self._wrap(pool, name, make)

    # ---- the request context --------------------------------------------------------

    def _in_request(self, original: Callable, request_of: Callable[[tuple], Any]) -> Callable:
        """``original`` run with the request its arguments name as the owner of what the pool does."""
        def call(*args: Any, **kwargs: Any) -> Any:
            outer, self._request = self._request, request_of(args)
            try:
                return original(*args, **kwargs)
            finally:
                self._request = outer
        return call

    def _wrap_manager(self, manager: Any) -> None:
        requests = self.scheduler.requests
        for name in ("allocate_slots", "free"):
            self._wrap(manager, name, lambda original: self._in_request(original, lambda args: args[0]))
        self._wrap(manager, "remove_skipped_blocks",
              lambda original: self._in_request(original, lambda args: requests.get(args[0])))

    # ---- the scheduler --------------------------------------------------------------

    def _wrap_scheduler(self, scheduler: Any) -> None:
        from vllm.v1.request import RequestStatus

        def add_request(original: Callable) -> Callable:
            def call(request: Any) -> None:
                original(request)
                self._versions[request.request_id] = 0
                self._emit(SeqStart, seq=request.request_id, prompt_len=request.num_prompt_tokens)
            return call

        def free_request(original: Callable) -> Callable:
            inner = self._in_request(original, lambda args: args[0])

            def call(request: Any, *args: Any, **kwargs: Any) -> Any:
                result = inner(request, *args, **kwargs)
                reason = "aborted" if request.status == RequestStatus.FINISHED_ABORTED else "finished"
                self._emit(SeqEnd, seq=request.request_id, reason=reason)
                self._versions.pop(request.request_id, None)
                self._keys.pop(request.request_id, None)
                return result
            return call

        def schedule(original: Callable) -> Callable:
            def call(*args: Any, **kwargs: Any) -> Any:
                output = original(*args, **kwargs)
                self._record_batch(output)
                return output
            return call

        def update_from_output(original: Callable) -> Callable:
            def call(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
                result = original(scheduler_output, *args, **kwargs)
                self._end_step(scheduler_output.total_num_scheduled_tokens)
                return result
            return call

        self._wrap(scheduler, "add_request", add_request)
        self._wrap(scheduler, "_free_request", free_request)
        self._wrap(scheduler, "_preempt_request",
              lambda original: self._in_request(original, lambda args: args[0]))
        self._wrap(scheduler, "schedule", schedule)
        self._wrap(scheduler, "update_from_output", update_from_output)

    def _record_batch(self, output: Any) -> None:
        """The step's rows as the worker will compute them, and what each row writes and reads."""
        rows = [d.req_id for d in output.scheduled_new_reqs]
        positions = [d.num_computed_tokens for d in output.scheduled_new_reqs]
        cached = output.scheduled_cached_reqs
        rows += cached.req_ids
        positions += cached.num_computed_tokens
        counts = [output.num_scheduled_tokens[r] for r in rows]
        if rows:
            self._emit(Batch, rows=rows, positions=positions, n=counts)
        for seq, pos, n in zip(rows, positions, counts):
            self._write_and_read(seq, pos, n)

    def _write_and_read(self, seq: Any, pos: int, n: int) -> None:
        block_ids = self.manager.get_block_ids(seq)[0]
        bs, end = self.block_size, pos + n
        version = self._versions.get(seq, 0)
        while pos < end:
            i = pos // bs
            stop = min(end, (i + 1) * bs)
            version += stop - pos
            block = block_ids[i]
            self._block_version[block] = version
            self._emit(Write, block=block, seq=seq, pos=pos, n=stop - pos, version=version)
            pos = stop
        self._versions[seq] = version
        read = [b for b in block_ids[:-(-end // bs)] if b != self.null_id]
        self._emit(Read, seq=seq, blocks=read, versions=[self._block_version.get(b, 0) for b in read])

    def _end_step(self, num_tokens: int) -> None:
        pool = self.pool
        # vLLM counts a cached block nobody holds as free; the trace counts it as the prefix cache's.
        # Counted over the blocks the trace says the cache holds, judged by vLLM's own state of each.
        blocks = pool.blocks
        cached_idle = sum(1 for b in self._cached if blocks[b].ref_cnt == 0 and blocks[b].block_hash is not None)
        used = self.capacity - pool.get_num_free_blocks() + cached_idle
        self._emit(Usage, tier="device", used_blocks=used, capacity_blocks=self.capacity)
        self._emit(StepEnd, num_tokens=num_tokens)
        self.writer.write_many(self._buf)
        self._buf = []
        self.step += 1
