"""The device arena seen as rows of ``head_dim`` elements: where a step's stores land and where a read's
keys and values start, for ``store`` and for callers that index the arena themselves (the compiled
decode layers write K/V at ``store_rows`` and gather at ``read_rows``).

The per-layer views and the last store plan are cached here; they are dropped whenever the device
arena reallocates (``forget``), since a view of the old tensor would write where nobody reads.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .storage import TensorArena

__all__ = ["RowLayout", "StorePlan"]


class StorePlan(NamedTuple):
    """Where one step's reserved slots are written."""

    blk: torch.Tensor  # (N,) device slot of each token's block
    off: torch.Tensor  # (N,) its position in the block
    rows: torch.Tensor | None  # (2 * N * H,) rows of D elements in a layer's arena; None: index by blk/off
    extent: int  # rows in a layer's arena view


class RowLayout:
    def __init__(self, dev: TensorArena, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 native: bool) -> None:
        self.dev, self.num_layers, self.block_size = dev, num_layers, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.native = native  # the device's codec stores the dtype as it is (rows of K/V, not codes)
        self._kv: list[torch.Tensor] | None = None  # per-layer views of the device arena
        self._plan: tuple[torch.Tensor, StorePlan] | None = None  # the last ``slots`` planned and its plan

    def forget(self) -> None:
        """The device arena reallocated: every view and plan points into the old tensor."""
        self._kv = None
        self._plan = None

    def layer_kv(self, layer: int) -> torch.Tensor:
        """``(num_slots, H, 2, block_size, D)`` view of the device arena for one layer."""
        if self._kv is None:
            self._kv = [self.dev.layer_kv(layer_) for layer_ in range(self.num_layers)]
        return self._kv[layer]

    def plan(self, slots: torch.Tensor) -> StorePlan:
        """Where ``slots`` lie: block and offset, and for the device arena's own layout the (K/V, token, head)
        rows of D elements each token's heads go to in a layer's arena seen as (rows, D). The same for every
        layer (they share strides), so a step's layers reuse the plan of the one ``slots`` tensor they store."""
        if self._plan is not None and self._plan[0] is slots:
            return self._plan[1]
        blk, off = slots // self.block_size, slots % self.block_size
        rows, extent = None, 0
        strides = self.row_strides() if self.native else None
        if strides is not None:
            s_blk, s_head, s_kv, s_pos = strides
            kv = self.layer_kv(0)
            heads = torch.arange(kv.shape[1], device=slots.device)
            at = (blk * s_blk + off * s_pos)[:, None] + heads[None, :] * s_head  # (N, H) rows of K
            rows = torch.stack((at, at + s_kv)).view(-1)  # (2 * N * H,): K rows, then V rows
            extent = ((kv.shape[0] - 1) * s_blk + (kv.shape[1] - 1) * s_head + s_kv + (kv.shape[3] - 1) * s_pos) + 1
        plan = StorePlan(blk, off, rows, extent)
        self._plan = (slots, plan)
        return plan

    def read_rows(self, table: torch.Tensor) -> tuple[torch.Tensor | None, int]:
        """Where each block's keys, and its values, of each head start, as element offsets from a layer's
        start, ordered (K/V, row, head, block), for ``table`` (B, blocks) of device slots; and the extent
        they index. None where the arena is not such rows."""
        strides = self.row_strides()
        if strides is None:
            return None, 0
        D = self.head_dim
        s_blk, s_head, s_kv, _ = (st * D for st in strides)
        heads = torch.arange(self.num_kv_heads, device=table.device)
        key = table[:, None, :] * s_blk + heads[None, :, None] * s_head  # (B, H_kv, nb)
        rows = torch.stack([key, key + s_kv]).reshape(-1)  # (2*B*H_kv*nb,)
        return rows, int(rows.max()) + 1

    def row_strides(self) -> tuple[int, int, int, int] | None:
        """The device arena's strides in rows of D elements (block, head, K/V, position), the layout both the
        store plan and ``read_rows`` index; None where a layer's arena is not such rows."""
        kv = self.layer_kv(0)  # (P, H, 2, bs, D)
        D, strides = kv.shape[-1], kv.stride()
        if strides[-1] != 1 or strides[-2] != D or any(st % D for st in strides[:-1]):
            return None
        s_blk, s_head, s_kv, s_pos = (st // D for st in strides[:-1])
        return s_blk, s_head, s_kv, s_pos
