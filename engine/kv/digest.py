"""Content digests of blocks: what the engine meant to write, checked against the bytes it holds.

Checksums on swaps (``tiers``) prove that a copy equals the bytes that left; they say
nothing about whether those bytes were ever right. A block's bytes can be wrong while
every event is honest: another request's K/V copied over it, a reused slot whose row
was never written, a wrong scale stored beside the codes, a flipped bit, a kernel that
wrote one row off. The digest makes those visible.

*Units.* A block's stored bytes are split into units: one per token position (that
token's K and V in every head, and its per-token scales), plus, for nf4, one per key
group (the group's key codes and channel ranges, which a later token re-encodes). A
unit's sum is a weighted wrapping sum of its elements as integers (each element times
a fixed odd 64-bit weight of its head and index), so one flipped bit or a changed
scale always changes it. The engine keeps one record per block, ``(L, U)`` unit sums
(layers x units), taken from the values it *meant* to store — the encoded K/V that
``store`` got, before they were scattered into the arena — so a write that landed
elsewhere, or never landed, leaves the stored bytes different from the record.
Updating a record costs the rows just written: the units of one step's tokens are
computed for all layers at once at ``commit``.

*Digest.* The block's digest is ``sum(units[l, u] * M[l, u])`` over the units written
so far, modulo 2^64, with fixed odd weights ``M`` per layer and unit: order- and
layer-dependent, so the same bytes one row off give another digest. ``write`` events
carry the digest of the record; ``read``, ``swap_in``, ``swap_out`` and ``recode``
carry the digest recomputed over the stored bytes (and, on a mismatch, the first layer
that differs). ``checks/integrity`` compares the two; it needs no torch and no engine
internals, so another engine that emits digests of its own definition gets the same check.

*Cost and latency.* Records are kept only while someone listens on the bus (a block written while
nobody listened has no record, and is not verified). Reads are verified in full (``verify="full"``, CI),
on a bounded sweep (``"sample"``, the default), or not at all (``"off"``); swaps and re-encodes are
verified whenever records are kept, so a block swapped in is verified as it arrives.

The sweep bounds how long corrupt bytes can be read unseen, whatever a sequence's length: each
sequence earns ``blocks read / N`` verifications a read (``N`` = ``verify_every``; integer credit on
``SeqState.reads``, its first due read staggered by the sequence's id) and spends them on the blocks of
its read verified longest ago, so each block a sequence reads is verified at least once in every ``N``
of its reads: within ``N`` steps while it decodes. On top, and without credit, the reads where
corruption is likeliest are verified at once: a sequence's first read verifies every block it holds
(its prefill, blocks a prefix-cache hit or a fork handed it), and a block with a record never verified
(a fresh block, in a slot another block used before) is verified on its first read. The cost is about
``blocks read / N`` block verifications a step: 1/N of what attention itself reads.

A read of the compiled decode layers is verified inside their attention, over the bytes it reads
(``PagedKVCache.sample_reads``): every pick of every row, so the bound is the same on both paths. Only a
mismatch is looked at again here, to name the layer.
"""

from __future__ import annotations

import ctypes
import functools
import heapq
import zlib
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from ... import knobs
from ..config import VERIFY_MODES
from ..kernels import native, pool

__all__ = ["VERIFY_MODES", "MASK64", "resolve_verify", "BlockRecord", "DigestBook"]

MASK64 = (1 << 64) - 1  # digests and the swap checksums (tiers) are 64-bit wrapping sums
_SEED = 0x6B76646F63746F72  # "kvdoctor": the weights are fixed, so every run and producer agrees
_STAGE_PARTS_MAX = 64  # tokens per store kept as tensors until commit; larger stores are summed at once
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_NP_INT = {2: np.int16, 4: np.int32}


def resolve_verify(mode: str | None) -> str:
    """The verification mode in force: ``mode`` if given, else ``$KVDOCTOR_VERIFY``, else ``"sample"``."""
    chosen = mode or knobs.get(knobs.VERIFY)  # the knob validates the variable's value
    if chosen not in VERIFY_MODES:
        raise ValueError(f"verify={chosen!r}: must be one of {', '.join(VERIFY_MODES)}")
    return chosen


@dataclass(frozen=True)
class _Region:
    """Part of a ``(layer, head)`` row: ``count`` units (positions or key groups) of ``width`` integers."""

    name: str
    offset: int  # bytes into the row
    count: int
    width: int
    itemsize: int
    group: bool  # units are key groups (nf4), not token positions


def _regions(codec: Any) -> list[_Region]:
    """The row layout of ``codec`` as units (the same layout ``codecs`` writes)."""
    bs, D = codec.block_size, codec.head_dim
    if codec.native:
        isz = codec.arena_dtype.itemsize
        return [_Region("k", 0, bs, D, isz, False), _Region("v", bs * D * isz, bs, D, isz, False)]
    regs = codec._regions
    if codec.name == "int8":
        return [_Region("k", regs["k"][0], bs, D, 1, False), _Region("v", regs["v"][0], bs, D, 1, False),
                _Region("vs", regs["vs"][0], bs, 1, 2, False)]
    groups = codec.key_groups
    return [_Region("k", regs["k"][0], groups, regs["k"][1] // groups, 1, True),
            _Region("kr", regs["kr"][0], groups, regs["kr"][1] // groups // 2, 2, True),
            _Region("v", regs["v"][0], bs, D // 2, 1, False),
            _Region("vs", regs["vs"][0], bs, regs["vs"][1] // bs // 2, 2, False)]


def _odd_weights(shape: tuple[int, ...], salt: int) -> np.ndarray:
    """Fixed odd int64 weights: an odd multiplier maps every nonzero change to a nonzero change mod 2^64."""
    g = torch.Generator().manual_seed((_SEED + salt) & 0x7FFFFFFFFFFFFFFF)
    w = torch.randint(-(1 << 62), 1 << 62, shape, generator=g, dtype=torch.int64)
    return (w * 2 + 1).numpy()


def _as_ints(x: torch.Tensor) -> np.ndarray:
    """The stored elements as a numpy integer array on the host (a float's bit pattern, not its value)."""
    if x.dtype.is_floating_point:
        x = x.view(_INT_VIEW[x.element_size()])
    return x.cpu().numpy()


class _Layout:
    """One codec's units and weights, and the unit sums of stored rows or of values about to be stored.

    Sums on CPU are one call of the compiled kernel (``digest.c``) per region, reading a block's rows in
    place: 0.28 ms a SmolLM2 batch-8 step verifying sampled reads, against 0.42 ms by numpy ``einsum`` over
    integer views (elsewhere, or with no compiler). A decode step's K and V cost the same either way
    (0.4 ms after a step at batch 1, most of it stacking the 60 tensors while the step's weights have left
    them out of the CPU's caches). Products and sums wrap modulo 2^64 alike on both paths and sides, so the
    write side's sums equal the read side's.
    """

    def __init__(self, codec: Any, num_layers: int, num_heads: int) -> None:
        self.codec = codec
        self.num_layers = num_layers
        self.regions = _regions(codec)
        self.num_pos = codec.block_size
        self.num_groups = next((r.count for r in self.regions if r.group), 0)
        self.tokens_per_group = codec.block_size // self.num_groups if self.num_groups else 0
        self._w = {r.name: _odd_weights((num_heads, r.width), i) for i, r in enumerate(self.regions)}

    def stored_units(self, rows: Sequence[torch.Tensor]) -> np.ndarray:
        """``(n, L, U)`` unit sums of stored blocks, each ``(L, H, R)`` in the arena dtype (views of the
        arena: one block at a time, read in place)."""
        out = np.zeros((len(rows), self.num_layers, self.num_pos + self.num_groups), dtype=np.int64)
        kernel = _sums_kernel()
        for i, row in enumerate(rows):
            raw = row.view(torch.uint8)  # (L, H, R bytes)
            L, H = raw.shape[:2]
            for r in self.regions:
                first = self.num_pos if r.group else 0
                if kernel is not None and raw.device.type == "cpu" and raw.stride(1) % r.itemsize == 0:
                    kernel(raw.data_ptr() + r.offset, raw.stride(0), L, H, r.count, r.width, raw.stride(1) // r.itemsize,
                           r.width, r.itemsize, self._w[r.name].ctypes.data, out[i].ctypes.data + 8 * first,
                           out.shape[2], pool.team())
                    continue
                part = _as_ints(raw)[..., r.offset: r.offset + r.count * r.width * r.itemsize]
                if r.itemsize > 1:
                    part = part.view(_NP_INT[r.itemsize])
                out[i, :, first: first + r.count] += np.einsum(
                    "lhcw,hw->lc", part.reshape(L, H, r.count, r.width), self._w[r.name])
        return out

    @property
    def kv_weights(self) -> tuple[np.ndarray, np.ndarray]:
        """A native codec's weights of K and of V, ``(H, D)`` int64 each: a token's unit sums K and V by them."""
        return self._w["k"], self._w["v"]

    def kv_units(self, k: torch.Tensor, v: torch.Tensor) -> np.ndarray:
        """``(L, N)`` token sums of a native codec's K and V, each ``(L, N, H, D)`` (D contiguous: read in place)."""
        dt = self.codec.arena_dtype
        k, v = k.to(dt), v.to(dt)  # what the arena holds: K/V rounded to its dtype
        kernel = _sums_kernel()
        if kernel is None or k.device.type != "cpu" or k.stride(-1) != 1 or v.stride(-1) != 1:
            return (np.einsum("lnhd,hd->ln", _as_ints(k), self._w["k"])
                    + np.einsum("lnhd,hd->ln", _as_ints(v), self._w["v"]))
        L, N, H, D = k.shape
        out = np.zeros((L, N), dtype=np.int64)
        size = k.element_size()
        for x, w in ((k, self._w["k"]), (v, self._w["v"])):
            kernel(x.data_ptr(), x.stride(0) * size, L, H, N, D, x.stride(2), x.stride(1), size, w.ctypes.data,
                   out.ctypes.data, N, pool.team())
        return out

    def part_units(self, parts: dict[str, torch.Tensor]) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Unit sums of values about to be stored: ``parts[name]`` is ``(..., N, H, width)`` per token, or
        ``(..., G, H, width)`` per key group; returns ``(..., N)`` token sums and ``(..., G)`` group sums."""
        pos = grp = None
        for r in self.regions:
            x = parts.get(r.name)
            if x is None:
                continue
            if self.codec.native:
                x = x.to(self.codec.arena_dtype)  # what the arena holds: K/V rounded to its dtype
            sums = np.einsum("...hw,hw->...", _as_ints(x), self._w[r.name])
            if r.group:
                grp = sums if grp is None else grp + sums
            else:
                pos = sums if pos is None else pos + sums
        return pos, grp


@functools.cache
def _sums_kernel() -> Callable[..., None] | None:
    c = ctypes
    return native.function(native.source("digest.c"), "kvdoctor_unit_sums",
                           (c.c_void_p,) + (c.c_int64,) * 8 + (c.c_void_p, c.c_void_p, c.c_int64, c.c_int))


class BlockRecord:
    """What the engine meant a block to hold: ``(L, U)`` unit sums in ``codec``'s layout, for the token
    positions below ``filled`` (and the key groups they touch).

    ``shares``: each column's share of the digest (``sum over l of units[l, c] * M[l, c]``, mod 2^64), or
    None while unknown. With them a decode step books a token by its share, which the compiled layers hand
    over, and its column lazily (``book``): no numpy call per block on the hot path, where each costs
    ~15 us against caches the step's weights have just flushed."""

    __slots__ = ("_units", "_pending", "filled", "codec", "shares", "verified")

    def __init__(self, units: np.ndarray, filled: int, codec: str, shares: list[int] | None = None,
                 verified: int = 0) -> None:
        self._units, self.filled, self.codec, self.shares = units, filled, codec, shares
        self._pending: dict[int, tuple[np.ndarray, int]] = {}
        self.verified = verified  # the book's stamp when these bytes were last verified (0: never)

    @property
    def units(self) -> np.ndarray:
        """The unit sums, with the columns booked since the last look copied in."""
        if self._pending:
            for c, (arr, col) in self._pending.items():
                self._units[:, c] = arr[:, col]
            self._pending.clear()
        return self._units

    def book(self, column: int, sums: np.ndarray, col: int) -> None:
        """Column ``column`` holds ``sums[:, col]`` (a step's ``(L, N)`` token sums: read only, never changed)."""
        self._pending[column] = (sums, col)

    def digest_by_shares(self) -> int | None:
        """The digest as the sum of its written columns' shares (a record of token columns), or None."""
        return None if self.shares is None else sum(self.shares[: self.filled]) & MASK64

    def copy(self) -> BlockRecord:
        return BlockRecord(self.units.copy(), self.filled, self.codec, None if self.shares is None else list(self.shares),
                           self.verified)


class _Sums(NamedTuple):
    """A store's unit sums, taken at once (a prefill: holding every layer's K/V until commit costs memory)."""

    pos: np.ndarray | None
    grp: np.ndarray | None


@dataclass
class _Staged:
    """One store call's tokens (the same slots in every layer): per layer, its K and V as a tuple (native
    codecs, the hot path), the parts ``codec.write`` stored (a dict), or their unit sums (``_Sums``)."""

    codec: str
    slots: torch.Tensor  # (N,) flat tier slots ``slot * block_size + offset`` the tokens were meant for
    groups: torch.Tensor | None  # (G,) ``slot * num_groups + group`` of the key groups re-encoded
    layers: dict[int, Any]
    units: np.ndarray | None = None  # (L, N) token sums of every layer, when staged at once (``stage_units``)
    shares: np.ndarray | None = None  # (N, U) each token's digest share at every column of a record, with them


class DigestBook:
    """Records of blocks (kept on ``Block.digest``), staged writes, and the read sampler."""

    def __init__(self, config: Any, codecs: dict[str, Any]) -> None:
        self.mode = resolve_verify(config.verify)  # may be changed later (benchmarks switch it between runs)
        self.every = config.verify_every
        self.num_layers = config.num_layers
        self.block_size = config.block_size
        self.layouts = {name: _Layout(c, config.num_layers, config.num_kv_heads) for name, c in codecs.items()}
        self._mix: dict[int, np.ndarray] = {}  # units per block -> (L, U) weights of the digest
        self._staged: dict[tuple, _Staged] = {}
        self._folded = False
        # flat slot -> (unit sums (L, N), column, the token's digest share at each record column or None)
        self._pos: dict[int, tuple[np.ndarray, int, list[int] | None]] = {}
        self._grp: dict[int, tuple[np.ndarray, int, None]] = {}
        self._clock = 0  # advances with every verification: the records' ``verified`` stamps

    @property
    def recording(self) -> bool:
        return self.mode != "off"

    def end_step(self) -> None:
        """Forget the step's staged writes: a slot's units must never outlive the step that stored them."""
        if not (self._staged or self._folded):
            return
        self._staged.clear()
        self._pos.clear()
        self._grp.clear()
        self._folded = False

    # ---- writes ----
    def stage(self, key: Any, layer: int, codec: str, slots: torch.Tensor,
              parts: dict[str, torch.Tensor] | tuple[torch.Tensor, torch.Tensor],
              groups: torch.Tensor | None = None) -> None:
        """Values ``store`` is about to write at layer ``layer``, meant for flat tier ``slots`` (and key
        ``groups``): ``(k, v)`` of a native codec, or the parts ``codec.write`` returned. ``key`` names
        the store call across layers."""
        if self._folded:  # a new round of stores after the last commit
            self.end_step()
        st = self._staged.get(key)
        if st is None:
            st = self._staged[key] = _Staged(codec, slots, groups, {})
        if slots.numel() > _STAGE_PARTS_MAX:  # a prefill: sum now rather than hold every layer's K/V
            layout = self.layouts[codec]
            if isinstance(parts, tuple):
                parts = _Sums(layout.kv_units(parts[0][None], parts[1][None])[0], None)  # (N,)
            else:
                parts = _Sums(*layout.part_units(parts))
        st.layers[layer] = parts

    def stage_units(self, key: Any, codec: str, slots: torch.Tensor, units: np.ndarray,
                    shares: np.ndarray | None = None) -> None:
        """``stage`` of every layer at once, as the ``(L, N)`` token sums a caller took of a native codec's K
        and V (the compiled decode layers, by ``weights(codec)``, while the rows were in its caches), and
        with ``shares`` ``(N, U)`` each token's share of a record's digest at every column (same weights)."""
        if self._folded:
            self.end_step()
        self._staged[key] = _Staged(codec, slots, None, {}, units, shares)

    def weights(self, codec: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A native codec's weights of K and of V ``(H, D)``, and the digest's ``(L, U)`` weights of a
        record's columns: what a caller that sums a step's K/V itself needs for ``stage_units``."""
        layout = self.layouts[codec]
        return (*layout.kv_weights, self._mix_of(self.num_layers, layout.num_pos + layout.num_groups))

    def _mix_of(self, num_layers: int, num_units: int) -> np.ndarray:
        mix = self._mix.get(num_units)
        if mix is None:
            mix = self._mix[num_units] = _odd_weights((num_layers, num_units), 1 << 20)
        return mix

    def _fold(self) -> None:
        """Unit sums of every staged token, all layers at once (the hot path: one stack per region)."""
        self._folded = True
        for st in self._staged.values():
            sums = self._layer_sums(st)
            if sums is None:
                continue  # not every layer was stored: these tokens get no record
            pos, grp = sums
            shares = st.shares.tolist() if st.shares is not None else None  # one row of U shares a token
            for sums, ids, table in ((pos, st.slots, self._pos), (grp, st.groups, self._grp)):
                if sums is None or ids is None:
                    continue
                rows = shares if table is self._pos else None
                for col, flat in enumerate(ids.tolist()):  # a later store to the same slot wins, as in the arena
                    table[flat] = (sums, col, rows[col] if rows is not None else None)

    def _layer_sums(self, st: _Staged) -> tuple[np.ndarray | None, np.ndarray | None] | None:
        """``(L, N)`` token and ``(L, G)`` group sums of one store's every layer; None if a layer is missing."""
        if st.units is not None:
            return st.units, None
        L = self.num_layers
        if sorted(st.layers) != list(range(L)):
            return None
        first = st.layers[0]
        if isinstance(first, _Sums):
            return (np.stack([st.layers[i].pos for i in range(L)]) if first.pos is not None else None,
                    np.stack([st.layers[i].grp for i in range(L)]) if first.grp is not None else None)
        if isinstance(first, tuple):  # native K, V: one stack each and one sum for every layer
            return self.layouts[st.codec].kv_units(*(torch.stack([st.layers[i][j] for i in range(L)]) for j in (0, 1))), None
        stacked = {name: torch.stack([st.layers[i][name] for i in range(L)]) for name in first}
        return self.layouts[st.codec].part_units(stacked)  # (L, N), (L, G)

    def record_write(self, b: Any, pos: int, n: int) -> int | None:
        """Book tokens ``pos … pos+n-1`` committed into block ``b`` (at its device slot); its new digest,
        or None when the block has no complete record (written while nobody listened)."""
        if not self._folded:
            self._fold()
        bs = self.block_size
        off = pos % bs
        layout = self.layouts[b.codec]
        rec: BlockRecord | None = b.digest
        if rec is None or rec.codec != b.codec:
            if off != 0:
                b.digest = None
                return None
            U = layout.num_pos + layout.num_groups
            rec = BlockRecord(np.zeros((self.num_layers, U), np.int64), 0, b.codec, None if layout.num_groups else [0] * U)
        base = b.slot * bs + off
        for j in range(n):
            got = self._pos.get(base + j)
            if got is None:
                b.digest = None
                return None
            arr, col, shares = got
            rec.book(off + j, arr, col)
            if shares is None:
                rec.shares = None
            elif rec.shares is None and not layout.num_groups:  # a record from a prefill: its shares, once
                rec.shares = self._shares(rec)
            if rec.shares is not None:
                rec.shares[off + j] = shares[off + j]
        if layout.num_groups:
            tg = layout.tokens_per_group
            for g in range(off // tg, (off + n - 1) // tg + 1):
                got = self._grp.get(b.slot * layout.num_groups + g)
                if got is None:
                    b.digest = None
                    return None
                rec.book(layout.num_pos + g, got[0], got[1])
        rec.filled = max(rec.filled, off + n)
        b.digest = rec
        by_shares = rec.digest_by_shares()
        return by_shares if by_shares is not None else self._digest(rec.units, rec.filled, layout)

    def _shares(self, rec: BlockRecord) -> list[int]:
        """Each column's share of ``rec``'s digest, from its units (columns never written hold zeros)."""
        units = rec.units
        return (units * self._mix_of(*units.shape)).sum(axis=0).tolist()  # numpy wraps the products and sums

    # ---- the digest ----
    def recorded(self, rec: BlockRecord) -> int:
        """``rec``'s digest, for a reader that took the digest of its bytes itself (the compiled layers' attention)
        and compares: the record is stamped verified. By its columns' shares: a record without them (a prefill's)
        gets them here, once, so the next look at it is a sum of ints."""
        self._stamp(rec)
        layout = self.layouts[rec.codec]
        if rec.shares is None and not layout.num_groups:
            rec.shares = self._shares(rec)
        by_shares = rec.digest_by_shares()
        return by_shares if by_shares is not None else self._digest(rec.units, rec.filled, layout)

    def _digest(self, units: np.ndarray, filled: int, layout: _Layout) -> int:
        mix = self._mix_of(*units.shape)
        total = int((units[:, :filled] * mix[:, :filled]).sum())  # numpy wraps the products and the sum
        if layout.num_groups:
            g = layout.num_pos + (filled - 1) // layout.tokens_per_group + 1
            total += int((units[:, layout.num_pos: g] * mix[:, layout.num_pos: g]).sum())
        return total & MASK64

    def _valid(self, rec: BlockRecord, layout: _Layout) -> np.ndarray:
        """Columns of the record that hold written units."""
        cols = list(range(rec.filled))
        if layout.num_groups:
            cols += range(layout.num_pos, layout.num_pos + (rec.filled - 1) // layout.tokens_per_group + 1)
        return np.asarray(cols, dtype=np.int64)

    # ---- verification ----
    def _stamp(self, rec: BlockRecord | None = None) -> int:
        """A new stamp, later than every other (given ``rec``, it is stamped: its bytes were just verified)."""
        self._clock += 1
        if rec is not None:
            rec.verified = self._clock
        return self._clock

    def sample(self, blocks: Sequence[Any], seq: Any) -> list[int]:
        """Indices of ``blocks`` (one read of ``seq``, a ``SeqState``) to verify under the mode: in the sweep,
        the read's blocks verified longest ago that its credit pays for, then any never verified; every block
        on the sequence's first read (module docstring). The picks are stamped when verified (``verify``,
        ``recorded``), not here."""
        if self.mode == "full":
            return list(range(len(blocks)))
        if self.mode == "off" or not blocks:
            return []
        held = [(b.digest.verified, i) for i, b in enumerate(blocks) if b is not None and b.digest is not None]
        if seq.reads < 0:  # the first read: whatever it was handed, verified before it is trusted
            seq.reads = zlib.crc32(repr(seq.id).encode()) % self.every
            return [i for _, i in held]
        due, seq.reads = divmod(seq.reads + len(blocks), self.every)
        never = [i for stamp, i in held if not stamp]  # verified at once, paid by no credit
        picks = [i for _, i in heapq.nsmallest(due, (h for h in held if h[0]))] if due else []
        return picks + never

    def verify(self, blocks: Sequence[Any], rows: Sequence[torch.Tensor | None]
               ) -> tuple[list[int | None], list[int | None]]:
        """Digests recomputed over each block's stored ``rows`` ``(L, H, R)`` (None: nothing to check), and for
        each that differs from the block's record, the first layer that differs."""
        digests: list[int | None] = [None] * len(blocks)
        layers: list[int | None] = [None] * len(blocks)
        todo: dict[str, list[int]] = {}
        for i, (b, r) in enumerate(zip(blocks, rows)):
            rec = b.digest
            if r is not None and rec is not None and rec.codec == b.codec:
                todo.setdefault(b.codec, []).append(i)
        for codec, idx in todo.items():
            layout = self.layouts[codec]
            units = layout.stored_units([rows[i] for i in idx])  # (n, L, U)
            for i, u in zip(idx, units):
                rec = blocks[i].digest
                self._stamp(rec)
                digests[i] = self._digest(u, rec.filled, layout)
                if digests[i] == rec.digest_by_shares():
                    continue  # the bytes are what was meant: no layer to find, no booked column to copy in
                cols = self._valid(rec, layout)
                bad = np.nonzero((u[:, cols] != rec.units[:, cols]).any(axis=1))[0]
                layers[i] = int(bad[0]) if bad.size else None
        return digests, layers

    def retake(self, blocks: Sequence[Any], rows: Sequence[torch.Tensor]) -> list[int | None]:
        """After a re-encode: each block's record becomes the unit sums of its new stored ``rows`` (in the
        block's new codec); returns the new digests (None for a block without a record)."""
        out: list[int | None] = [None] * len(blocks)
        idx = [i for i, b in enumerate(blocks) if b.digest is not None]
        if not idx:
            return out
        by_codec: dict[str, list[int]] = {}
        for i in idx:
            by_codec.setdefault(blocks[i].codec, []).append(i)
        for codec, group in by_codec.items():
            layout = self.layouts[codec]
            units = layout.stored_units([rows[i] for i in group])
            for i, u in zip(group, units):
                b = blocks[i]
                b.digest = BlockRecord(u.copy(), b.digest.filled, codec, verified=self._stamp())  # just read
                out[i] = self._digest(b.digest.units, b.digest.filled, layout)
        return out
