"""NaN and Inf written into a real slot, found at the write that stored them.

A non-finite key or value in a token's own row is read by every later query of its sequence (and of every
sequence sharing the block): a NaN key turns that layer's scores NaN, a NaN value the weighted sum, an Inf
either once it meets a zero. Attention statistics see it only where the scores go non-finite, a layer or a
step later, and name where it surfaced, not where it was written. So each commit looks at the bytes just
stored: the K and V rows of the committed tokens, every layer, as they sit in the device arena (what the
compiled layers or ``store`` wrote, whichever wrote them), and the ``write`` event names the positions and
the first layer (``Write.nonfinite``, ``nonfinite_layer``, the writer's frames in ``stack``;
``checks/slots`` reports it).

*Cost.* One call of a compiled loop (``digest.c``) over the step's new rows (``L x 2 x tokens x H_kv`` rows
of ``head_dim``), for every sequence the step reserved at once, at its first commit: the rows a decode step
wrote, not the blocks (a gather and ``isfinite`` by torch where nothing compiles, or off the CPU). Only
while someone listens, and only for the device's own native codec in one arena (int8/nf4 codes hold no NaN;
their scales are not looked at).
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..kernels import native

if TYPE_CHECKING:
    from .cache import PagedKVCache
    from .sequences import SeqState

__all__ = ["NonFiniteScan"]


class NonFiniteScan:
    """The step's committed tokens whose stored K or V is non-finite, looked up by each sequence's commit."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        # seq -> (its pending writes list as scanned, their number, {flat slot: first non-finite layer})
        self._found: dict[Any, tuple[list, int, dict[int, int]]] = {}

    def of(self, s: SeqState) -> dict[int, int]:
        """``{flat device slot: first layer}`` of ``s``'s pending writes (``s.writes``) whose K or V there is
        non-finite at some layer; empty when every value is finite or the arena is not rows of the dtype."""
        got = self._found.pop(s.id, None)
        if got is not None and got[0] is s.writes and got[1] == len(s.writes):
            return got[2]
        c = self.cache
        # every sequence the step reserved and has not committed yet: one gather for the step, not one a row
        todo = [q for q in (c.seqs.get(seq) for seq in c.step.reserved) if q is not None and q.writes and q is not s]
        todo.append(s)
        flats = [[b.slot * c.block_size + pos % c.block_size + j for b, pos, m in q.writes for j in range(m)]
                 for q in todo]
        bad = self._scan([f for fs in flats for f in fs])
        self._found = {q.id: (q.writes, len(q.writes), {f: bad[f] for f in fs if f in bad})
                       for q, fs in zip(todo, flats)}
        return self._found.pop(s.id)[2]

    def _scan(self, flats: list[int]) -> dict[int, int]:
        """``{flat slot: first layer}`` of ``flats`` whose K or V row of some head is non-finite."""
        c = self.cache
        strides = c.layout.row_strides() if c.codec.native and c.single_codec() else None
        if not flats or strides is None:
            return {}
        data = c.dev.data  # (slots, L, H, R): each layer's arena view is a slice of it (RowLayout)
        D, L, H = c.config.head_dim, c.config.num_layers, c.config.num_kv_heads
        s_blk, s_head, s_kv, s_pos = strides
        bs, s_layer, n = c.block_size, data.stride(1) // D, len(flats)
        kernel = _rows_kernel()
        if kernel is not None and data.device.type == "cpu" and data.dtype in _KIND:
            got, first = (ctypes.c_int64 * n)(*flats), (ctypes.c_int64 * (n + 1))()  # first[n]: how many
            kernel(data.data_ptr(), ctypes.addressof(got), n, bs, s_blk, s_pos, s_layer, s_kv, s_head, L, H, D,
                   _KIND[data.dtype], ctypes.addressof(first))
            if not first[n]:
                return {}
            return {flat: first[i] for i, flat in enumerate(flats) if first[i] >= 0}
        f = torch.tensor(flats, dtype=torch.long, device=data.device)
        at = (f // bs) * s_blk + (f % bs) * s_pos  # (N,) row of each token's first head's key at layer 0
        rows = (torch.arange(L, device=data.device)[:, None, None, None] * s_layer
                + torch.tensor([0, s_kv], device=data.device)[None, :, None, None] + at[None, None, :, None]
                + torch.arange(H, device=data.device) * s_head)  # (L, 2, N, H) rows of D elements
        bad = ~torch.isfinite(data.view(-1, D).index_select(0, rows.view(-1)))
        if not bool(bad.any()):
            return {}
        per = bad.view(L, 2, n, H * D).any(-1).any(1)  # (L, N)
        first_layer = per.to(torch.int8).argmax(0)  # (N,) the first layer with one (0 where none: skipped below)
        return {flat: int(first_layer[i]) for i, flat in enumerate(flats) if bool(per[:, i].any())}


_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # digest.c's kvdoctor_nonfinite_rows


@functools.cache
def _rows_kernel() -> Callable[..., None] | None:
    c = ctypes
    return native.function(native.source("digest.c"), "kvdoctor_nonfinite_rows",
                           (c.c_void_p, c.c_void_p) + (c.c_int64,) * 11 + (c.c_void_p,))
