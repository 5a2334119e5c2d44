"""The weights on 2 MB pages: a runner copies every projection's weight once into a huge-page arena, the
model's Linears (and a tied embedding) view the copies, and it computes exactly what it did before."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from kvdoctor.engine.model import hugepages
from kvdoctor.engine.model.hugepages import HUGE_PAGE, Arena, holds
from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.engine.serving.runner import Runner

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(3, 40))]
needs_huge_pages = pytest.mark.skipif(not hugepages.enabled(), reason="transparent huge pages are off here")


def _model(tie: str | None):
    """A model whose weights fill a few huge pages; its lm head tied to the embedding as transformers ties
    them (one parameter), as kvdoctor's own loader does (two parameters over one tensor), or not at all."""
    model = tiny_llama(hidden_size=256, intermediate_size=1024, vocab_size=2048).model
    embed = model.model.embed_tokens
    if tie == "same":
        model.lm_head.weight = embed.weight
    elif tie == "shared":
        model.lm_head.weight = torch.nn.Parameter(embed.weight.detach(), requires_grad=False)
    return model


def _linears_of(layer):
    return [*(getattr(layer.self_attn, f"{p}_proj") for p in "qkvo"), layer.mlp.gate_proj, layer.mlp.up_proj,
            layer.mlp.down_proj]


def _linears(model):
    return [m for layer in model.model.layers for m in _linears_of(layer)]


def _advised_huge(address: int) -> bool:
    """Whether the mapping holding ``address`` is advised ``MADV_HUGEPAGE`` (``hg`` among its VmFlags)."""
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()[1:]
    return False


@needs_huge_pages
@pytest.mark.parametrize("tie", [None, "same", "shared"])
def test_a_runner_moves_every_weight_into_one_arena_and_computes_the_same(tie, monkeypatch):
    # GIVEN a model and a twin whose runner is not given huge pages, and the model's weights before
    model = _model(tie)
    twin = copy.deepcopy(model)
    old = [weakref.ref(m.weight) for m in _linears(model)]
    monkeypatch.setenv("KVDOCTOR_HUGEPAGES", "0")
    with Runner.create(twin, block_size=4, device_blocks=64, host_blocks=0) as runner:
        want = runner.generate(PROMPTS, max_new_tokens=8, keep_logits=True)
    assert not any(holds(m.weight) for m in _linears(twin))
    monkeypatch.delenv("KVDOCTOR_HUGEPAGES")
    # WHEN a runner is built on the model
    with Runner.create(model, block_size=4, device_blocks=64, host_blocks=0) as runner:
        got = runner.generate(PROMPTS, max_new_tokens=8, keep_logits=True)
        # THEN every Linear and the lm head read their weights from the arena, a mapping advised huge pages
        assert all(holds(m.weight) for m in _linears(model)) and holds(model.lm_head.weight)
        assert runner._weights[0].qkv.weight.data_ptr() == model.model.layers[0].self_attn.q_proj.weight.data_ptr()
        assert _advised_huge(model.lm_head.weight.data_ptr())
    # AND the old weights are gone (one copy), and a tied embedding stays tied to the lm head's copy
    gc.collect()
    assert all(r() is None for r in old)
    if tie is not None:
        assert model.model.embed_tokens.weight.data_ptr() == model.lm_head.weight.data_ptr()
    else:
        assert not holds(model.model.embed_tokens.weight)
    # AND the tokens and logits are exactly what the weights where they were gave
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


@needs_huge_pages
def test_each_layers_old_weights_are_freed_before_the_next_layer_is_copied(monkeypatch):
    # GIVEN a model's weights as they were loaded, and a look at them each time a layer's copies are made
    from kvdoctor.engine.model import weights

    model = _model(None)
    old = [[weakref.ref(m.weight) for m in _linears_of(layer)] for layer in model.model.layers]
    alive_at_each_layer = []
    monkeypatch.setattr(weights, "give_back", lambda: alive_at_each_layer.append(
        [sum(r() is not None for r in layer) for layer in old]))
    # WHEN a runner places them
    Runner.create(model, block_size=4, device_blocks=16, host_blocks=0).close()
    # THEN after each layer's copies none of that layer's old weights is still held (the RSS never holds both)
    assert alive_at_each_layer == [[0, 7], [0, 0], [0, 0]]  # after layer 0, after layer 1, after the lm head


@needs_huge_pages
def test_a_second_runner_keeps_the_weights_where_the_first_put_them():
    # GIVEN a model whose weights a first runner moved into an arena
    model = _model(None)
    Runner.create(model, block_size=4, device_blocks=16, host_blocks=0).close()
    where = [m.weight.data_ptr() for m in _linears(model)]
    # WHEN a second runner is built on it THEN nothing is copied again
    with Runner.create(model, block_size=4, device_blocks=16, host_blocks=0) as runner:
        assert [m.weight.data_ptr() for m in _linears(model)] == where
        assert runner._weights[-1].down.weight.data_ptr() == where[-1]


@needs_huge_pages
def test_a_weight_replaced_after_placing_is_fused_again_with_its_group():
    # GIVEN a model placed by a first runner, then one of a layer's k weights replaced (a loaded adapter)
    model = _model(None)
    Runner.create(model, block_size=4, device_blocks=16, host_blocks=0).close()
    attn = model.model.layers[0].self_attn
    new = attn.k_proj.weight.detach().clone() * 2
    attn.k_proj.weight = torch.nn.Parameter(new, requires_grad=False)
    # WHEN a second runner is built THEN q, k and v are fused again with the new k (a group under one huge
    # page goes to ordinary memory), and the other projections stay where the first runner put them
    with Runner.create(model, block_size=4, device_blocks=16, host_blocks=0) as runner:
        qkv = runner._weights[0].qkv.weight
        q_rows = attn.q_proj.weight.shape[0]
        assert qkv.data_ptr() == attn.q_proj.weight.data_ptr() and not holds(qkv)
        assert torch.equal(qkv[q_rows: q_rows + new.shape[0]], new)
        assert holds(runner._weights[0].gate_up.weight) and holds(runner._weights[1].qkv.weight)


def test_a_model_smaller_than_a_huge_page_or_switched_off_stays_where_it_is(monkeypatch):
    # GIVEN the tests' usual tiny model (well under 2 MB of weights), and a larger one with huge pages off
    small = tiny_llama().model
    monkeypatch.setenv("KVDOCTOR_HUGEPAGES", "0")
    large = _model(None)
    assert not hugepages.enabled()
    # WHEN runners are built on them THEN neither moves its weights
    for model in (small, large):
        where = [m.weight.data_ptr() for m in _linears(model)]
        Runner.create(model, block_size=4, device_blocks=16, host_blocks=0).close()
        assert [m.weight.data_ptr() for m in _linears(model)][3::7] == where[3::7]  # o_proj: never fused
        assert not any(holds(m.weight) for m in _linears(model))


@needs_huge_pages
def test_an_arena_hands_out_aligned_tensors_lives_with_them_and_refuses_to_overflow():
    # GIVEN an arena for two tensors
    tensors = [torch.ones(1000, 700), torch.ones(300, 1024, dtype=torch.bfloat16)]
    arena = Arena.sized([t.nbytes for t in tensors])
    assert arena is not None
    # WHEN both are taken
    a, b = arena.take((1000, 700), torch.float32), arena.take((300, 1024), torch.bfloat16)
    # THEN the first starts on a huge page's boundary and the next on a page of its own, both writable
    assert a.data_ptr() % HUGE_PAGE == 0 and b.data_ptr() % 4096 == 0 and b.data_ptr() >= a.data_ptr() + a.nbytes
    a.copy_(tensors[0])
    b.copy_(tensors[1])
    assert holds(a) and holds(b[7:]) and not holds(tensors[0])
    # AND a third is refused with a clear error
    with pytest.raises(ValueError, match="arena full"):
        arena.take((16,), torch.float32)
    # AND the mapping lives while a tensor carved from it does, and no longer
    mapping = weakref.ref(arena._map)
    del arena, a
    gc.collect()
    assert mapping() is not None and float(b[299, 1023]) == 1.0
    del b
    gc.collect()
    assert mapping() is None
    # AND tensors too small to fill a huge page get no arena
    assert Arena.sized([4000]) is None
