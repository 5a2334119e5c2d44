"""K/V digests that add up: a block's digest is the sum of its rows', whoever computed them and when.

A KV connector saves and loads whole blocks, but a tensor-parallel rank's forward pass writes a few rows of a
block at a time (a decode step: one). To tell whether the bytes a connector saved are the bytes the rank's
forward passes wrote (a block overwritten or reused before its save: "copies and frees racing reuse", vLLM
#45704, #52360, PR #56104), both sides digest the same unit, one token's K and V at one layer (a *row*), and a
block's digest is the sum of its rows' modulo 2^64: the rank sums its writes as they happen, the connector sums
the rows it saves, and equal bytes give equal sums.

A row's digest: its bytes as 64-bit words, weighted by fixed odd constants and summed (any change to one word
changes the sum), then mixed with a key of its layer and token position (the same bytes at another position or
layer are another row) by a 64-bit finaliser. All of it runs in torch over every row of a layer at once; int64
arithmetic wraps modulo 2^64, which is the sum wanted. Rows are read in one canonical shape, (kv heads, K|V,
head size), from the cache layouts vLLM's backends use and from the key and value a forward pass writes.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MASK", "cache_rows", "written_rows", "linear", "mix", "row_digests", "block_sums", "unsigned",
           "RankDigests"]

MASK = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it."""
    value &= MASK
    return value - (1 << 64) if value >> 63 else value


_GOLDEN, _M1, _M2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
_LAYER = _signed(0xD6E8FEB86659FD93)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 (torch shifts arithmetically)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, elementwise: every input bit reaches every output bit."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


_weights: dict[int, torch.Tensor] = {}


def _weights_for(num_words: int) -> torch.Tensor:
    """``num_words`` fixed odd 64-bit constants, the same in every process."""
    w = _weights.get(num_words)
    if w is None:
        w = _weights[num_words] = mix(torch.arange(1, num_words + 1, dtype=torch.int64) * _GOLDEN) | 1
    return w


def cache_rows(kv_layer: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """The rows of ``slots`` in one layer's paged cache, (tokens, kv heads, 2, head size): K then V per head.

    vLLM's CPU backend holds a layer as (blocks, kv heads, block size, 2 × head size): per block and head its
    keys transposed, (head size, block size), then its values, (block size, head size), as its ``vec`` and
    ``vec16`` kernels write them (``amx`` packs bf16 pairs otherwise: its rows here are not tokens', so only
    whole blocks compare). The flash layout is (2, blocks, block size, kv heads, head size); MLA one latent row
    per slot, (slots, width)."""
    if kv_layer.dim() == 2:
        return kv_layer[slots]
    blocks, offsets = slots // block_size, slots % block_size
    if kv_layer.dim() == 5 and kv_layer.shape[0] == 2:
        return kv_layer[:, blocks, offsets].permute(1, 2, 0, 3)
    num_blocks, heads, size, width = kv_layer.shape
    planes = kv_layer.view(num_blocks, heads, 2, size * (width // 2))
    keys = planes[:, :, 0].view(num_blocks, heads, width // 2, size)[blocks, :, :, offsets]  # (tokens, heads, D)
    values = planes[:, :, 1].view(num_blocks, heads, size, width // 2)[blocks, :, offsets]  # (tokens, heads, D)
    return torch.stack((keys, values), dim=2)


def written_rows(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The rows a forward pass writes, in ``cache_rows``' shape: key and value are (tokens, kv heads, head size)."""
    return torch.stack((key, value), dim=2)


def linear(rows: torch.Tensor) -> torch.Tensor:
    """Per row, its words weighted and summed (tokens,): the part of a row's digest that reads its bytes."""
    data = rows.reshape(rows.shape[0], -1).contiguous().view(torch.uint8)
    pad = -data.shape[1] % 8
    if pad:
        data = torch.nn.functional.pad(data, (0, pad))
    return (data.view(torch.int64) * _weights_for(data.shape[1] // 8)).sum(dim=1)


def row_digests(lin: torch.Tensor, positions: torch.Tensor, layers: torch.Tensor) -> torch.Tensor:
    """Rows' digests from their ``linear`` parts, token positions and layers (broadcast together)."""
    return mix(lin ^ mix(positions * _GOLDEN + layers * _LAYER))


def block_sums(digests: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per block of ``block_size`` consecutive rows (the last may be short), the sum of their digests."""
    pad = -digests.shape[-1] % block_size
    if pad:
        digests = torch.nn.functional.pad(digests, (0, pad))
    return digests.view(*digests.shape[:-1], -1, block_size).sum(dim=-1)


def unsigned(values: Any) -> list[int]:
    """int64 digests as the trace writes them: 0 … 2^64 − 1."""
    return [v & MASK for v in values.tolist()]


class RankDigests:
    """What a rank's forward passes wrote: per block and layer, the sum of its rows' digests in the block's life.

    A step's writes are announced as the rank records them (``wrote``), the forward pass's rows as it starts
    (``begin``); each attention layer's cache update hands over the key and value it writes (``layer``); when
    the pass has run (``fold``) the rows join their blocks' sums and each write of the step gets its block's
    digest after it. A block is *known* from a write that starts its life until one that brings rows this rank did
    not compute (rows a connector loaded, rows written again after a rollback, a pass whose layers were not all
    seen or whose cache stores another dtype than the forward computes): only a known block's writes carry a
    digest, and only a save of known blocks is judged."""

    def __init__(self, layers: list[int], block_size: int) -> None:
        self.layers = layers
        self.block_size = block_size
        self._index = {layer: i for i, layer in enumerate(layers)}
        self._layer_ids = torch.tensor(layers, dtype=torch.int64)[:, None]  # (layers, 1)
        self.sums = torch.zeros((0, len(layers)), dtype=torch.int64)  # (blocks, layers)
        self.known: set[int] = set()
        self._writer: dict[int, Any] = {}  # block -> the request whose rows its current life holds
        self._writes: list[tuple[int, int, str]] = []  # this step's writes: (buffer index, block, life)
        self._slots: torch.Tensor | None = None  # this pass's slot per token
        self._positions: torch.Tensor | None = None  # this pass's token position per token
        self._lin: torch.Tensor | None = None  # (layers, tokens): the ``linear`` part of each row written
        self._seen: list[bool] = []

    def wrote(self, index: int, block: int, seq: Any, life: str) -> None:
        """The rank's buffer holds at ``index`` a write of ``seq`` into ``block`` that starts its life (``new``),
        adds rows to it (``append``), writes rows it held again (``rewrite``) or brings rows no forward pass
        computes (``loaded``). A block written by another request than its last writer was freed and handed on:
        a new life, wherever its rows start."""
        if self._writer.get(block) != seq:
            self._writer[block] = seq
            if life != "loaded":
                life = "new"
        self._writes.append((index, block, life))

    def begin(self, slots: list[int], positions: list[int], counts: list[int]) -> None:
        """The pass about to run writes ``slots`` (one a token), row by row, row ``i`` from token ``positions[i]``."""
        self._slots = torch.tensor(slots, dtype=torch.int64)
        starts = torch.tensor(counts, dtype=torch.int64).cumsum(0) - torch.tensor(counts, dtype=torch.int64)
        shift = torch.tensor(positions, dtype=torch.int64) - starts
        self._positions = torch.arange(len(slots), dtype=torch.int64) + shift.repeat_interleave(torch.tensor(counts))
        self._lin = torch.zeros((len(self.layers), len(slots)), dtype=torch.int64)
        self._seen = [False] * len(self.layers)

    def layer(self, layer: int, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """An attention layer wrote this pass's ``key`` and ``value`` (tokens first, padded past them) to its cache."""
        i = self._index.get(layer)
        if self._lin is None or i is None or key.dtype != kv_cache.dtype:  # a quantised cache holds other bytes
            return
        tokens = self._lin.shape[1]
        self._lin[i] = linear(written_rows(key[:tokens], value[:tokens])).cpu()
        self._seen[i] = True

    def fold(self, buf: list) -> None:
        """The pass has run: its rows join their blocks' sums, and the step's writes in ``buf`` get their digests."""
        import msgspec

        writes, self._writes = self._writes, []
        lin, self._lin = self._lin, None
        complete = lin is not None and all(self._seen)
        if writes:
            top = max(block for _, block, _ in writes) + 1
            if top > self.sums.shape[0]:
                grown = torch.zeros((max(top, 2 * self.sums.shape[0]), len(self.layers)), dtype=torch.int64)
                grown[:self.sums.shape[0]] = self.sums
                self.sums = grown
        for _, block, life in writes:
            if life == "new":
                self.sums[block] = 0
                self.known.add(block)
            if life in ("rewrite", "loaded") or not complete:
                self.known.discard(block)
        if complete and lin.shape[1]:
            digests = row_digests(lin, self._positions[None, :], self._layer_ids)  # (layers, tokens)
            written = self._slots >= 0
            self.sums.index_add_(0, self._slots[written] // self.block_size, digests[:, written].T)
        known = [(index, block) for index, block, _ in writes if block in self.known]
        if known:
            totals = unsigned(self.sums[[block for _, block in known]].sum(dim=1))
            for (index, _), total in zip(known, totals):
                buf[index] = msgspec.structs.replace(buf[index], digest=total)

    def judge(self, blocks: list[int], saved: dict[int, list[int]]) -> tuple[list[int | None], list[int | None]]:
        """A save of ``blocks`` with ``saved[layer]`` the digest per block at each layer: per block the digest of
        what was saved over this rank's layers and the first layer where it differs from what the rank wrote
        (None: equal). A block not known, or a save without every layer of the rank, is not judged (None)."""
        if sorted(saved) != sorted(self.layers):
            return [None] * len(blocks), [None] * len(blocks)
        digests: list[int | None] = []
        layers: list[int | None] = []
        for i, block in enumerate(blocks):
            if block not in self.known:
                digests.append(None)
                layers.append(None)
                continue
            mine = unsigned(self.sums[block])
            theirs = [saved[layer][i] for layer in self.layers]
            digests.append(sum(theirs) & MASK)
            layers.append(next((layer for layer, a, b in zip(self.layers, mine, theirs) if a != b), None))
        return digests, layers
