"""K/V digests that add up (``kvdoctor.integrations.vllm_digests``), on tensors laid out as vLLM's caches are.

No vLLM needed: a cache in the CPU backend's layout is written as its ``cpu_attn_reshape_and_cache`` writes it
(each block and head's keys, then its values), from a fixed seed.
"""

from __future__ import annotations

import torch

from kvdoctor.events import Write
from kvdoctor.integrations.vllm_digests import (
    RankDigests, block_sums, cache_rows, linear, row_digests, unsigned, written_rows,
)

BS, HEADS, D, LAYERS = 32, 2, 8, [0, 1]


def _cpu_cache(num_blocks: int = 4) -> torch.Tensor:
    return torch.zeros(num_blocks, HEADS, BS, 2 * D)


def _store(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """What the CPU backend's ``vec`` cache update does: per (block, head), keys transposed (head size, block
    size), then values (block size, head size) (seen by writing coded values through vLLM's own op)."""
    planes = cache.view(cache.shape[0], HEADS, 2, BS * D)
    keys, values = planes[:, :, 0].view(-1, HEADS, D, BS), planes[:, :, 1].view(-1, HEADS, BS, D)
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, BS)
        keys[block, :, :, offset] = key[t]
        values[block, :, offset] = value[t]


def _saved(cache: torch.Tensor, slots: torch.Tensor, layer: int) -> list[int]:
    lin = linear(cache_rows(cache, slots, BS))
    return unsigned(block_sums(row_digests(lin, torch.arange(len(slots)), torch.tensor(layer)), BS))


def test_a_saved_block_digest_is_the_sum_of_the_rows_written_into_it_step_by_step():
    # GIVEN a prompt of 40 tokens written into blocks 2 and 1 (a prefill of 33, then a decode step of 7 rows)
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(40, HEADS, D, generator=gen), torch.randn(40, HEADS, D, generator=gen)
    slots = torch.cat((torch.arange(2 * BS, 3 * BS), torch.arange(BS, BS + 8)))
    cache = _cpu_cache()
    rows = written_rows(key, value)
    # WHEN the rows are digested as written, in two parts, and the blocks as a connector reads them out
    _store(cache, key, value, slots)
    assert torch.equal(cache_rows(cache, slots, BS), rows)
    first = row_digests(linear(rows[:33]), torch.arange(33), torch.tensor(1))
    second = row_digests(linear(rows[33:]), torch.arange(33, 40), torch.tensor(1))
    # THEN the parts add up to the connector's digest of each block
    saved = _saved(cache, slots, 1)
    assert saved[0] == unsigned(first[:BS].sum(0, keepdim=True))[0]
    assert saved[1] == unsigned((first[BS:].sum() + second.sum()).view(1))[0]
    # and the same bytes at another layer or position are other rows
    assert _saved(cache, slots, 0) != saved
    assert unsigned(row_digests(linear(rows[:1]), torch.tensor([1]), torch.tensor(1))) != unsigned(first[:1])


def _pass(digests: RankDigests, buf: list, writes: list[tuple[int, int, int, str]], key, value, cache) -> None:
    """One forward pass of one row (token positions from ``writes[0]``'s), every layer writing the same K/V."""
    pos = writes[0][1]
    n = sum(w[2] for w in writes)
    slots = [block * BS + (p % BS) + i for block, p, k, _ in writes for i in range(k)]
    for block, p, k, life in writes:
        digests.wrote(len(buf), block, "r", life)
        buf.append(Write(t=0, step=0, block=block, seq="r", pos=p, n=k, version=p + k))
    digests.begin(slots, [pos], [n])
    for layer in LAYERS:
        digests.layer(layer, key, value, cache)
        _store(cache, key, value, torch.tensor(slots))
    digests.fold(buf)


def test_a_rank_judges_a_save_against_its_writes_and_names_the_first_layer_that_differs():
    # GIVEN a rank that wrote a 40-token prompt into blocks 2 and 1, both layers alike
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(40, HEADS, D, generator=gen), torch.randn(40, HEADS, D, generator=gen)
    cache, buf = _cpu_cache(), []
    rank = RankDigests(LAYERS, BS)
    _pass(rank, buf, [(2, 0, 32, "new"), (1, 32, 8, "new")], key, value, cache)
    slots = torch.cat((torch.arange(2 * BS, 3 * BS), torch.arange(BS, BS + 8)))
    # THEN each write carries its block's digest, which the connector's save of the same bytes equals
    per_layer = {layer: _saved(cache, slots, layer) for layer in LAYERS}
    digests, layers = rank.judge([2, 1], per_layer)
    assert digests == [buf[0].digest, buf[1].digest] and layers == [None, None]
    # WHEN one row of block 1 changes at layer 1 before the save
    per_layer[1] = _saved(cache.clone().index_put_((torch.tensor([1]),), torch.tensor(9.0), accumulate=True), slots, 1)
    digests, layers = rank.judge([2, 1], per_layer)
    # THEN that block's saved digest differs from its write's, and layer 1 is named; a save missing a layer
    # of the rank's, or of a block whose rows a connector loaded, is not judged
    assert digests[0] == buf[0].digest and digests[1] != buf[1].digest and layers == [None, 1]
    assert rank.judge([2, 1], {0: per_layer[0]}) == ([None, None], [None, None])
    _pass(rank, buf, [(1, 40, 1, "loaded")], key[:1], value[:1], cache)
    assert buf[-1].digest is None and rank.judge([1], {l: [0] for l in LAYERS}) == ([None], [None])


def test_vllm_cpu_kernels_write_each_row_where_cache_rows_reads_it():
    ops = __import__("pytest").importorskip("vllm._custom_ops", reason="vLLM is not installed here")
    head_size = 64  # one the kernels support
    for isa in ("vec", "vec16"):
        # GIVEN K/V written into a cache by vLLM's own CPU cache update, over a block boundary
        gen = torch.Generator().manual_seed(2)
        key, value = (torch.randn(40, HEADS, head_size, generator=gen) for _ in range(2))
        cache = torch.zeros(3, HEADS, BS, 2 * head_size)
        keys, values = cache.view(3, HEADS, 2 * BS, head_size).chunk(2, dim=2)
        slots = torch.cat((torch.arange(BS, 2 * BS), torch.arange(2 * BS, 2 * BS + 8)))
        ops.cpu_attn_reshape_and_cache(key, value, keys, values, slots, isa)
        # THEN each token's row reads back as it was written
        assert torch.equal(cache_rows(cache, slots, BS), written_rows(key, value)), isa
