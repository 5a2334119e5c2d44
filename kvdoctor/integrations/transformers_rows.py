"""One transformers cache as kvdoctor sees it: rows of a batch are sequences, padding is not.

A transformers ``Cache`` keeps one K/V row per batch index and knows nothing about whose tokens
a row holds. ``CacheRows`` keeps that missing story next to it, in plain Python (no torch):

- each row has a *holder*, the sequence whose K/V the row stores, and the blocks that hold the
  holder's real tokens (``block_size`` tokens per block, padding slots belong to no block);
- each row computes a *writer* sequence; it is the holder unless a misuse fed the row another
  sequence's tokens (a cache reused for an unrelated prompt, rows swapped between calls, a beam
  reorder applied twice), and then the writer's writes and reads land in blocks it does not own;
- the token id of every slot, so a ``generate`` call can say which sequence each row continues.

Every change is told to ``emit`` as v1 events, so the checks judge the user's cache with the same
rules as any engine's: positions, ownership, versions.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..events import Alloc, Batch, Free, Read, Release, Rollback, SeqEnd, SeqStart, Write

__all__ = ["CacheRows", "Row", "Versions"]

Emit = Callable[..., None]


class Versions:
    """Sequence ids and cache versions, shared by every cache one observer watches (ids are unique per trace)."""

    def __init__(self) -> None:
        self.version: dict[Any, int] = {}
        self.next_block = 0
        self.next_seq = 0

    def new_seq(self, label: str) -> str:
        """A sequence that is not one of a pass's first rows (a fork, a row computing another prompt)."""
        self.next_seq += 1
        return f"{label}.seq{self.next_seq}"

    def new_block(self) -> int:
        self.next_block += 1
        return self.next_block - 1


class Row:
    """One batch row of the cache: who holds it, who computes in it, what its slots contain."""

    __slots__ = ("holder", "writer", "tokens", "real_at", "num_real", "blocks", "block_versions", "unwritten",
                 "first_pos", "next_pos")

    def __init__(self, holder: Any) -> None:
        self.holder = holder
        self.writer = holder
        self.tokens: list[int | None] = []  # token id per slot (padding included); None: unknown
        self.real_at: list[int] = []  # per slot: index among the row's real tokens, -1 for padding
        self.num_real = 0
        self.blocks: list[int] = []  # block k holds real tokens k*block_size ... (k+1)*block_size-1
        self.block_versions: list[int] = []  # the version the last write into each block made
        self.unwritten = False  # holds slots nobody wrote (left by a cut): its writes are numbered by slot
        self.first_pos = 0  # the position its first real token was written at, and one past its last: a read's span
        self.next_pos = 0  # is numbered as the writes are, whatever position ids the caller passed


class CacheRows:
    """The rows of one cache and the events their changes make."""

    def __init__(self, label: str, block_size: int, versions: Versions, emit: Emit,
                 stack: Callable[[], list[str] | None] = lambda: None) -> None:
        self.label = label
        self.block_size = block_size
        self.ids = versions
        self.emit = emit
        self.stack = stack  # the user's frames for seq_start, a sequence's first alloc and seq_end
        self.rows: list[Row] = []
        self.num_slots = 0  # slots written per row (transformers' get_seq_length)
        self.num_calls = 0  # times the cache was seen empty and filled: generate calls, mostly

    # ---- sequences ------------------------------------------------------------------

    def start_seq(self, prompt_len: int, name: str | None = None) -> str:
        seq = name or self.ids.new_seq(self.label)
        self.ids.version[seq] = 0
        self.emit(SeqStart, seq=seq, prompt_len=prompt_len, stack=self.stack())
        return seq

    def new_rows(self, prompt_lens: Sequence[int]) -> None:
        """A cache seen empty: one new sequence per row, named by cache, generate call and row ("c1.gen2.row0":
        row 0 of the second call on the first cache), as a user counts them."""
        self.end_all("finished")
        self.num_calls += 1
        call = f"{self.label}.gen{self.num_calls}"
        self.rows = [Row(self.start_seq(n, f"{call}.row{b}")) for b, n in enumerate(prompt_lens)]
        self.num_slots = 0

    def end_all(self, reason: str) -> None:
        """Every holder leaves with its blocks (the cache was reset, dropped or the observer closed)."""
        for row in self.rows:
            self._end(row, reason)
        self.rows = []
        self.num_slots = 0

    def _end(self, row: Row, reason: str) -> None:
        self.emit(SeqEnd, seq=row.holder, reason=reason, stack=self.stack())
        for block in row.blocks:
            self.emit(Free, block=block)
        self.ids.version.pop(row.holder, None)

    def find_holder(self, prefix: Sequence[int]) -> Any | None:
        """The holder of the row whose slots hold exactly ``prefix`` (the tokens a generate call says are cached)."""
        for row in self.rows:
            if row.tokens == prefix:
                return row.holder
        return None

    # ---- a forward pass -------------------------------------------------------------

    def write(self, row: Row, tokens: Sequence[int | None], real: Sequence[bool], positions: Sequence[int]) -> tuple[int, int]:
        """The slots one forward appended to ``row``: its real tokens are written by ``row.writer``
        into the holder's blocks at their rotary ``positions``. Returns (first position, real tokens)."""
        bs, writer = self.block_size, row.writer
        first, count = row.num_real, 0
        chunk_block = chunk_pos = chunk_n = -1
        for token, is_real, pos in zip(tokens, real, positions):
            row.tokens.append(token)
            if not is_real:
                row.real_at.append(-1)
                continue
            if row.unwritten:  # rotary positions restart over stale slots; the slot is where the K/V land
                pos = row.num_real
            if not row.num_real:
                row.first_pos = pos
            row.next_pos = pos + 1
            k = row.num_real // bs
            if k == len(row.blocks):
                block = self.ids.new_block()
                row.blocks.append(block)
                row.block_versions.append(0)
                self.emit(Alloc, block=block, tier="device", seq=row.holder, stack=None if k else self.stack())
            if count == 0:
                first = pos
            if k == chunk_block and pos == chunk_pos + chunk_n:
                chunk_n += 1
            else:
                if chunk_n > 0:
                    self._write_chunk(row, writer, chunk_block, chunk_pos, chunk_n)
                chunk_block, chunk_pos, chunk_n = k, pos, 1
            row.real_at.append(row.num_real)
            row.num_real += 1
            count += 1
        if chunk_n > 0:
            self._write_chunk(row, writer, chunk_block, chunk_pos, chunk_n)
        return first, count

    def stale(self, n: int) -> None:
        """``n`` slots appended to every row that no sequence wrote (a cut that left them behind): they count as the
        row's tokens, in blocks of its holder, with no ``write``, so a read of them is a read of unwritten slots."""
        bs = self.block_size
        for row in self.rows:
            row.tokens.extend([None] * n)
            row.real_at.extend(range(row.num_real, row.num_real + n))
            row.num_real += n
            row.unwritten = True
            row.next_pos = row.first_pos + row.num_real
            while len(row.blocks) * bs < row.num_real:
                block = self.ids.new_block()
                row.blocks.append(block)
                row.block_versions.append(0)
                self.emit(Alloc, block=block, tier="device", seq=row.holder)
        self.num_slots += n

    def _write_chunk(self, row: Row, writer: Any, k: int, pos: int, n: int) -> None:
        version = self.ids.version.get(writer, 0) + n
        self.ids.version[writer] = version
        row.block_versions[k] = version
        self.emit(Write, block=row.blocks[k], seq=writer, pos=pos, n=n, version=version)

    def batch(self, firsts: Sequence[int], counts: Sequence[int], shape: list[int] | None) -> None:
        self.emit(Batch, rows=[r.writer for r in self.rows], positions=list(firsts), n=list(counts), shape=shape)

    def read(self, layer: int, visible_from: int) -> None:
        """Each row's writer read the blocks holding real tokens in slots ``visible_from``… (one layer group)."""
        bs = self.block_size
        for row in self.rows:
            if not row.num_real:
                continue
            lo = first = 0
            if visible_from > 0:
                real_at = row.real_at
                s = min(visible_from, len(real_at))
                while s < len(real_at) and real_at[s] < 0:
                    s += 1
                first = real_at[s] if s < len(real_at) else row.num_real
                lo = first // bs if s < len(real_at) else len(row.blocks)
            if lo >= len(row.blocks):
                continue
            self.emit(Read, seq=row.writer, blocks=row.blocks[lo:], versions=row.block_versions[lo:], layer=layer,
                      span=[row.first_pos + first, row.next_pos])

    # ---- what transformers does to a cache between passes ---------------------------

    def remap(self, sources: Sequence[int]) -> None:
        """New row ``i`` now holds what old row ``sources[i]`` held (reorder_cache, batch_select_indices,
        batch_repeat_interleave). The first row to take a source keeps its holder (the same sequence in
        another row needs no event); a further one is a fork: a new sequence written with a copy of it,
        as transformers copies the tensors. A holder no new row takes leaves with its blocks."""
        old = self.rows
        taken: set[int] = set()
        new: list[Row] = []
        for src in sources:
            source = old[src]
            if src not in taken:
                taken.add(src)
                new.append(source)
            else:
                new.append(self._fork(source))
        for i, row in enumerate(old):
            if i not in taken:
                self._end(row, "finished")
        self.rows = new

    def _fork(self, source: Row) -> Row:
        row = Row(self.start_seq(source.num_real))
        row.tokens = list(source.tokens)
        row.real_at = list(source.real_at)
        row.num_real = source.num_real
        row.next_pos = source.num_real  # the copy is written at the positions that number its slots
        bs = self.block_size
        for k in range(len(source.blocks)):
            block = self.ids.new_block()
            row.blocks.append(block)
            row.block_versions.append(0)
            self.emit(Alloc, block=block, tier="device", seq=row.holder, stack=None if k else self.stack())
            self._write_chunk(row, row.holder, k, k * bs, min(bs, source.num_real - k * bs))
        return row

    def crop(self, remove: int) -> None:
        """``remove`` slots were cut from the end of every row; a request past what was written is
        recorded as it was asked (``n`` larger than the sequence holds), so the checks can name it."""
        bs = self.block_size
        excess = max(0, remove - self.num_slots)
        keep = max(0, self.num_slots - remove)
        for row in self.rows:
            left = _real_before(row, keep)
            dropped = row.num_real - left
            if dropped or excess:
                self.rollback(row, dropped + excess)
            del row.tokens[keep:], row.real_at[keep:]
            row.num_real = left
            row.next_pos = row.first_pos + left
            num_blocks = -(-left // bs)
            for block in row.blocks[num_blocks:]:
                self.emit(Release, block=block, seq=row.holder)
                self.emit(Free, block=block)
            del row.blocks[num_blocks:], row.block_versions[num_blocks:]
        self.num_slots = keep

    def rollback(self, row: Row, n: int) -> None:
        """``row``'s holder drops its last ``n`` tokens (any count: a crop past the written length is
        recorded with the count it asked for); its version moves on so older copies look stale."""
        version = self.ids.version.get(row.holder, 0) + 1
        self.ids.version[row.holder] = version
        self.emit(Rollback, seq=row.holder, n=n, version=version)


def _real_before(row: Row, slot: int) -> int:
    """How many real tokens sit in the row's slots before ``slot`` (the slot before it may be padding)."""
    for s in range(min(slot, len(row.real_at)) - 1, -1, -1):
        if row.real_at[s] >= 0:
            return row.real_at[s] + 1
    return 0
