"""Automatic prefix caching: full blocks found again by a chain of content keys, so a request whose
prompt starts like an earlier one's computes only the rest.

A full block's key covers its parent block's key, its token ids and a *salt* naming everything
else that decides the K/V a token gets: the model and a digest of its weights, the KV codec, the
rope scaling, and the adapter a request runs under. A key without the salt lets a request take
K/V computed under another model, codec or adapter, which no reference count can show.

The cache holds each registered block as an owner of its own, ``PREFIX_CACHE``, exactly as the
vLLM integration writes vLLM's prefix cache: ``share(block, seq="prefix-cache", hash=key)``
registers it, ``share(block, seq=request, hash=key)`` is a hit, and a block nobody but the cache
holds is ``evict``ed with reason ``"prefix-cache"`` when its tier needs room (least recently used
first). So the prefix check judges both engines with the same rules. Only full blocks are ever
registered: a request appends to a block of its own, and one that appends to (or rolls back into)
a registered block copies it first, the way any shared block is written (copy-on-write).

Per sequence the cache keeps its committed token ids and the keys of its full blocks; the keys in
events are always the true ones, computed from the sequence's own tokens, while the keys the cache
looks blocks up by may be wrong (the ``prefix-unsalted`` fault), as a buggy cache's would be.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import dataclass, field
from typing import Any, Collection, Sequence

from ...events import PREFIX_CACHE
from ..faults import Faults
from .pool import Block, BlockPool

__all__ = ["PREFIX_CACHE", "PrefixCache", "content_key", "cache_salt", "model_salt"]


def content_key(parent: str, tokens: Sequence[int]) -> str:
    """The key of a full block: a digest of its parent's key (the salt for the first block) and its token ids
    (the vLLM integration's chain, so keys read alike in both engines' traces)."""
    return hashlib.blake2b(parent.encode() + array("q", tokens).tobytes(), digest_size=8).hexdigest()


def cache_salt(**parts: Any) -> str:
    """A salt from named parts (model, weights, codec, rope scaling, adapter), order-independent."""
    return hashlib.blake2b(json.dumps(parts, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()


def model_salt(model: Any) -> dict[str, Any]:
    """What of ``model`` changes the K/V of a token: its name, its rope settings and a digest of its weights.

    The weights digest reads every parameter's name, shape and dtype and up to 4096 evenly spaced
    values of each (a full hash of a large model would cost seconds at start-up; a retrained or
    fine-tuned model changes values everywhere, so a sample sees it)."""
    import torch

    h = hashlib.blake2b(digest_size=8)
    for name, p in model.state_dict().items():
        flat = p.detach().reshape(-1)
        step = max(flat.numel() // 4096, 1)
        sample = flat[::step][:4096].to("cpu", torch.float32)
        h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        h.update(sample.numpy().tobytes())
    cfg = model.config
    return {
        "model": getattr(cfg, "_name_or_path", "") or type(model).__name__,
        "weights": h.hexdigest(),
        "rope_theta": getattr(cfg, "rope_theta", None),
        "rope_scaling": getattr(cfg, "rope_scaling", None),
    }


@dataclass
class _Chain:
    """One sequence's view of its prefix: committed tokens and the keys of its full blocks."""

    salt: str  # the true salt: the cache's, with the sequence's adapter
    lookup_salt: str  # what the cache keys its map with (the true salt unless a fault drops it)
    tokens: list[int] | None = field(default_factory=list)  # None: unknown (a commit without tokens)
    keys: list[str] = field(default_factory=list)
    lookup: list[str] = field(default_factory=list)

    def extend(self, upto: int, block_size: int) -> None:
        """Keys of the full blocks among the first ``upto`` blocks' tokens."""
        toks = self.tokens
        assert toks is not None
        for i in range(len(self.keys), min(upto, len(toks) // block_size)):
            chunk = toks[i * block_size:(i + 1) * block_size]
            self.keys.append(content_key(self.keys[-1] if i else self.salt, chunk))
            self.lookup.append(content_key(self.lookup[-1] if i else self.lookup_salt, chunk))


class PrefixCache:
    """The map from content keys to cached blocks, and each sequence's chain of keys.

    The cache (``cache.PagedKVCache``) calls it at the points of a sequence's life that matter:
    ``lookup`` when a request starts, ``committed`` after each write, ``rolled_back``, ``ended``;
    and ``forget`` whenever a block goes. It counts hits and misses in blocks, per step and in total.
    """

    def __init__(self, pool: BlockPool, block_size: int, salt: dict[str, Any], faults: Faults) -> None:
        self.pool = pool
        self.block_size = block_size
        self.salt_parts = salt
        self.faults = faults
        self.blocks: dict[str, Block] = {}  # lookup key -> the registered block
        self.keys: dict[int, str] = {}  # registered block id -> its lookup key
        self.registrar: dict[int, Any] = {}  # registered block id -> the sequence that computed it
        self.chains: dict[Any, _Chain] = {}
        self.step_hits = self.step_misses = 0
        self.hits = self.misses = 0  # blocks, since the cache started
        self.hit_tokens = self.prompt_tokens = 0  # prompt tokens served from the cache, and looked up

    def resalt(self, **parts: Any) -> None:
        """Requests that begin from now on key their blocks with ``parts`` too (new weights: their digest), so they
        never hit blocks computed before; requests already begun keep their keys."""
        self.salt_parts = {**self.salt_parts, **parts}

    def _salt(self, adapter: str | None) -> str:
        return cache_salt(**self.salt_parts, adapter=adapter)

    def begin(self, seq: Any, adapter: str | None) -> None:
        salt = self._salt(adapter)
        # the fault: a cache keyed by tokens alone, whatever model, codec or adapter computed them
        self.chains[seq] = _Chain(salt, "" if self.faults.prefix_unsalted else salt)

    def lookup(self, seq: Any, prompt: Sequence[int]) -> list[Block]:
        """The cached blocks of ``prompt``'s longest cached prefix, in order, each shared with ``seq`` (a hit,
        carrying the true key of ``seq``'s own tokens). At least one prompt token is always left to compute:
        its logits give the first new token."""
        chain = self.chains[seq]
        bs = self.block_size
        chain.tokens = list(prompt)
        wanted = (len(prompt) - 1) // bs
        chain.extend(wanted, bs)
        hits: list[Block] = []
        for key, true in zip(chain.lookup, chain.keys):
            b = self.blocks.get(key)
            if b is None:
                break
            hits.append(b)
            self.pool.share(b, seq, hash=true)
        self.step_hits += len(hits)
        self.step_misses += wanted - len(hits)
        self.hit_tokens += len(hits) * bs
        self.prompt_tokens += len(prompt)
        del chain.tokens[len(hits) * bs:]  # the rest is recorded as it is committed
        del chain.keys[len(hits):], chain.lookup[len(hits):]
        return hits

    def committed(self, seq: Any, blocks: list[Block], tokens: Sequence[int] | None) -> None:
        """``seq`` committed ``tokens``: register each block that became full and whose key is new."""
        chain = self.chains.get(seq)
        if chain is None or chain.tokens is None:
            return
        if tokens is None:
            chain.tokens = None  # what the blocks hold is unknown from here on: register none of them
            return
        chain.tokens.extend(tokens)
        first = len(chain.keys)
        chain.extend(len(chain.tokens) // self.block_size, self.block_size)
        if first == len(chain.keys):
            return
        by_index = {b.index: b for b in blocks[-(len(chain.keys) - first + 1):]}
        for i in range(first, len(chain.keys)):
            b = by_index.get(i)
            key = chain.lookup[i]
            if b is None or b.id in self.keys or key in self.blocks:
                continue  # evicted, already cached, or another request cached the same tokens first
            self.blocks[key] = b
            self.keys[b.id] = key
            self.registrar[b.id] = seq
            self.pool.share(b, PREFIX_CACHE, hash=chain.keys[i])

    def rolled_back(self, seq: Any, length: int) -> None:
        chain = self.chains.get(seq)
        if chain is None:
            return
        if chain.tokens is not None:
            del chain.tokens[length:]
        del chain.keys[length // self.block_size:], chain.lookup[length // self.block_size:]

    def forked(self, parent: Any, child: Any) -> None:
        """``child`` starts as a copy of ``parent``'s committed tokens: it continues the same chain."""
        p = self.chains[parent]
        self.chains[child] = _Chain(p.salt, p.lookup_salt, None if p.tokens is None else list(p.tokens),
                                    list(p.keys), list(p.lookup))

    def ended(self, seq: Any) -> None:
        self.chains.pop(seq, None)

    def forget(self, b: Block) -> None:
        """``b`` is going (evicted or freed): its key no longer names anything."""
        key = self.keys.pop(b.id, None)
        self.registrar.pop(b.id, None)
        if key is not None and self.blocks.get(key) is b:
            del self.blocks[key]

    def registered_by(self, b: Block) -> Any:
        """The sequence whose tokens filled ``b`` when it was cached (None: not cached)."""
        return self.registrar.get(b.id)

    def idle(self, tier: str, exclude: Collection[int] = ()) -> list[Block]:
        """Registered blocks in ``tier`` that nobody but the cache holds, least recently used first."""
        out = [b for b in self.blocks.values() if b.tier == tier and b.inflight is None and b.id not in exclude
               and len(b.owners) == 1 and b.owners[0] == PREFIX_CACHE]
        out.sort(key=lambda b: (b.last_access, -b.index, b.id))
        return out

    def end_step(self) -> tuple[int, int]:
        """This step's hits and misses (blocks); the counts start again."""
        counts = (self.step_hits, self.step_misses)
        self.hits += self.step_hits
        self.misses += self.step_misses
        self.step_hits = self.step_misses = 0
        return counts

    def stats(self) -> dict[str, Any]:
        looked = self.hits + self.misses + self.step_hits + self.step_misses
        return {
            "cached_blocks": len(self.blocks),
            "hit_blocks": self.hits + self.step_hits,
            "miss_blocks": self.misses + self.step_misses,
            "hit_rate": (self.hits + self.step_hits) / looked if looked else 0.0,
            "hit_tokens": self.hit_tokens,
            "prompt_tokens": self.prompt_tokens,
            "token_hit_rate": self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
        }
