"""The adapters check: a prefix-cache hit on K/V computed under another adapter identity (name, id, load)."""

from __future__ import annotations

from tracebuilder import rules

from kvdoctor.events import PREFIX_CACHE, Adapter, SeqStart


def _load(trace, name, key, load=1, op="load", digest=None):
    trace._emit(Adapter, op=op, name=name, adapter_id=key, load=load, path=f"/adapters/{name}", detail="add_lora",
                digest=digest)


def _start(trace, seq, adapter=None, adapter_id=None, salt=None, extra_keys=None):
    trace.seq_version[seq] = 0
    trace.seq_len[seq] = 0
    trace._emit(SeqStart, seq=seq, prompt_len=4, adapter=adapter, adapter_id=adapter_id, salt=salt,
                extra_keys=extra_keys)


def _cached_block(trace, block, seq, key="k0", **adapter):
    """``seq`` (under ``adapter``) fills ``block``, the prefix cache registers it under ``key``, ``seq`` ends."""
    _start(trace, seq, **adapter)
    trace.alloc(block, seq)
    trace.write(block, seq, trace.block_size)
    trace.share(block, PREFIX_CACHE, hash=key)
    trace.release(block, seq)
    trace.end(seq)
    trace.end_step()


def _hit(trace, block, seq, **adapter):
    _start(trace, seq, **adapter)
    trace.share(block, seq, hash="k0")
    trace.release(block, seq)
    trace.end(seq)
    trace.end_step()
    return trace.run()


def test_a_hit_after_an_in_place_reload_of_the_same_adapter_names_request_block_and_loads(trace):
    # GIVEN a block computed under adapter "sql" (id 1, load 1), then "sql" reloaded in place with new contents
    _load(trace, "sql", 1)
    _cached_block(trace, 7, "r1", adapter="sql", adapter_id=1)
    _load(trace, "sql", 1, load=2, op="reload")
    # WHEN a request under "sql" hits the block
    findings = _hit(trace, 7, "r2", adapter="sql", adapter_id=1)
    # THEN one foreign hit naming the request, the block, both loads and the upstream report
    assert rules(findings) == ["adapters/foreign-hit"]
    (f,) = findings
    assert (f.seq, f.block, f.step) == ("r2", 7, 1)
    assert "load 1 -> 2" in f.message and "#42495" in f.message
    assert f.evidence["computed_under"] == {"name": "sql", "id": 1, "load": 1, "digest": None}


def test_two_adapters_with_one_name_and_different_ids_do_not_share_blocks(trace):
    _load(trace, "x", 1)
    _load(trace, "x", 2)
    _cached_block(trace, 3, "r1", adapter="x", adapter_id=1)
    (f,) = _hit(trace, 3, "r2", adapter="x", adapter_id=2)
    assert (f.check, f.rule) == ("adapters", "foreign-hit")
    assert "ids 1 and 2" in f.message and "#30931" in f.message


def test_a_cache_salt_equal_to_an_adapter_name_reaching_its_blocks_is_a_key_collision(trace):
    # GIVEN a block of adapter "COLLIDE"; WHEN a base-model request salted "COLLIDE" hits it
    _load(trace, "COLLIDE", 1)
    _cached_block(trace, 5, "lora", adapter="COLLIDE", adapter_id=1)
    (f,) = _hit(trace, 5, "base", salt="COLLIDE")
    # THEN the cause is the key's untagged parts
    assert (f.check, f.rule, f.seq, f.block) == ("adapters", "key-collision", "base", 5)
    assert "salt='COLLIDE' for 'base', adapter='COLLIDE' for 'lora'" in f.message and "#44701" in f.message
    assert f.evidence["hit_under"] is None


def test_a_crafted_extra_key_equal_to_an_adapters_id_reaching_its_blocks_is_a_key_collision(trace):
    # GIVEN a block computed under LoRA "alpha", whose engine id is "lora-7f3a" (sglang keys by the id)
    _load(trace, "alpha", "lora-7f3a")
    _cached_block(trace, 5, "lora", adapter="alpha", adapter_id="lora-7f3a")
    # WHEN a base-model request whose extra key is that id hits it (sglang #24638)
    (f,) = _hit(trace, 5, "base", extra_keys=["lora-7f3a"])
    # THEN the cause is the key's untagged parts, named tag by tag
    assert (f.rule, f.seq, f.block) == ("key-collision", "base", 5)
    assert "extra_keys='lora-7f3a' for 'base', adapter_id='lora-7f3a' for 'lora'" in f.message
    assert "sglang #24638" in f.message


def test_requests_whose_extra_keys_differ_from_an_adapters_parts_hit_nothing_of_it_and_twins_share(trace):
    # GIVEN a LoRA block and a base-model block, each cached
    _load(trace, "alpha", "lora-7f3a")
    _cached_block(trace, 5, "lora", key="k5", adapter="alpha", adapter_id="lora-7f3a")
    _cached_block(trace, 6, "b1", key="k0", extra_keys=["tenant-1"])
    # WHEN a base request with the same extra key hits the base block THEN nothing is found
    assert _hit(trace, 6, "b2", extra_keys=["tenant-1"]) == []


def test_a_base_model_request_hitting_an_adapters_block_is_foreign(trace):
    _load(trace, "a", 1)
    _cached_block(trace, 2, "r1", adapter="a", adapter_id=1)
    (f,) = _hit(trace, 2, "r2")
    assert f.rule == "foreign-hit" and "leaves the adapter out" in f.message


def test_hits_under_the_same_identity_and_an_unchanged_reload_are_clean(trace):
    # near misses: the same adapter and load; an unload and load of the same contents keeps load 1;
    # a reload with new contents after which the cache was reset (the block evicted) leaves nothing to hit
    _load(trace, "a", 1)
    _cached_block(trace, 2, "r1", adapter="a", adapter_id=1, salt="tenant")
    _hit(trace, 2, "r2", adapter="a", adapter_id=1, salt="tenant")
    trace._emit(Adapter, op="unload", name="a", adapter_id=1, load=1)
    _load(trace, "a", 1)
    assert _hit(trace, 2, "r3", adapter="a", adapter_id=1, salt="tenant") == []
    _load(trace, "a", 1, load=2, op="reload")
    trace.evict(2, reason="prefix-cache-reset")
    trace.end_step()
    _cached_block(trace, 2, "r4", adapter="a", adapter_id=1)
    assert _hit(trace, 2, "r5", adapter="a", adapter_id=1) == []


def test_one_finding_per_request_with_every_foreign_block_as_evidence(trace):
    _load(trace, "a", 1)
    _cached_block(trace, 2, "r1", adapter="a", adapter_id=1)
    _cached_block(trace, 3, "r0", key="k1", adapter="a", adapter_id=1)
    _load(trace, "a", 1, load=2, op="reload")
    _start(trace, "r2", adapter="a", adapter_id=1)
    trace.share(2, "r2", hash="k0")
    trace.share(3, "r2", hash="k1")
    for block in (2, 3):
        trace.release(block, "r2")
    trace.end("r2")
    trace.end_step()
    (f,) = trace.run()
    assert f.evidence["foreign_blocks"] == [2, 3]


def test_the_same_contents_re_added_under_a_new_id_are_the_same_kv(trace):
    # near miss: a server unloads an adapter and loads the same files again, under a new id (vLLM's serving
    # layer counts ids); the contents' digest says the K/V are the same
    _load(trace, "a", 1, digest="d1")
    _cached_block(trace, 2, "r1", adapter="a", adapter_id=1)
    trace._emit(Adapter, op="unload", name="a", adapter_id=1, load=1, digest="d1")
    _load(trace, "a", 2, digest="d1")
    assert _hit(trace, 2, "r2", adapter="a", adapter_id=2) == []
    _load(trace, "a", 3, digest="d2")
    (f,) = _hit(trace, 2, "r3", adapter="a", adapter_id=3)
    assert f.rule == "foreign-hit" and "ids 1 and 3" in f.message


def _running_across_a_reload(trace, digests):
    """Request r1 under "sql" writes and reads block 4, "sql" is reloaded (contents ``digests[1]``), r1 reads on."""
    _load(trace, "sql", 1, digest=digests[0])
    _start(trace, "r1", adapter="sql", adapter_id=1)
    trace.alloc(4, "r1")
    trace.write(4, "r1", 2)
    trace.read("r1", [4])
    trace.end_step()
    _load(trace, "sql", 1, load=2, op="reload", digest=digests[1])
    trace.read("r1", [4])
    trace.end_step()
    trace.read("r1", [4])
    trace.release(4, "r1")
    trace.free(4)
    trace.end("r1")
    trace.end_step()
    return trace.run()


def test_a_request_reading_across_an_in_place_reload_is_a_stale_read(trace):
    # GIVEN a request running under "sql" while "sql" is reloaded with other contents
    findings = _running_across_a_reload(trace, ("d1", "d2"))
    # THEN one warning, at the first read after the reload, naming the request, the block and both loads
    assert rules(findings) == ["adapters/stale-read"]
    (f,) = findings
    assert (f.severity, f.seq, f.block, f.step) == ("warning", "r1", 4, 1)
    assert "load 1 -> 2" in f.message and f.evidence["stale_blocks"] == [4]


def test_a_reload_with_the_same_contents_leaves_a_running_request_alone(trace):
    assert _running_across_a_reload(trace, ("d1", "d1")) == []
