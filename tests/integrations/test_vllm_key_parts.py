"""What vLLM's prefix key holds besides the tokens, on the real scheduler: images, cache salts and adapters.

vLLM keys a block by its tokens and by tagged extra parts: an image's identifier for blocks holding its
placeholder tokens, the LoRA's name and path, the cache salt (``generate_block_hash_extra_keys``). The plugin
writes each request's parts on its ``seq_start`` (``adapter``, ``adapter_id``, ``salt``, ``extra_keys``: the
images' identifiers) and keys its own content digests by images too, so:
- parts joined untagged, where an image identifier equal to an adapter's name reaches that adapter's blocks
  (vllm #44701, sglang #24638), are ``adapters/key-collision`` naming both parts;
- a key that leaves images out (a weak multimodal hash: vllm PR #12621, sglang #2151), where another image's
  K/V are served for the same placeholder tokens, is ``prefix/hash-mismatch``.
The scheduler runs without a model (``vllm_harness``); a stand-in encoder counts every image as encoded.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed here: ./kvd test-vllm sets it up")

from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402

from kvdoctor.events import SeqStart, Share  # noqa: E402
from kvdoctor.integrations.vllm import PREFIX_CACHE  # noqa: E402

from vllm_harness import make_harness  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 16
PLACEHOLDERS = [7] * (3 * BS) + [8] * 5  # an image's placeholder tokens: the same whatever the image


@pytest.fixture
def harness(tmp_path):
    h = make_harness(tmp_path / "sched.kvtrace", block_size=BS)
    yield h
    h.close()


def _hits(events) -> dict:
    hits: dict = {}
    for e in events:
        if type(e) is Share and e.seq != PREFIX_CACHE:
            hits.setdefault(e.seq, []).append(e.block)
    return hits


def _patch_extra_keys(monkeypatch, change):
    """vLLM's extra key parts as ``change`` rewrites them (the releases before a fix)."""
    original = kv_cache_utils.generate_block_hash_extra_keys

    def patched(request, *args, **kwargs):
        keys, mm_idx = original(request, *args, **kwargs)
        return change(keys or ()) or None, mm_idx

    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", patched)


def test_images_salts_and_adapters_key_their_blocks_apart_and_a_clean_run_gives_no_finding(harness):
    # GIVEN one image's placeholders twice, another image's, a salted and an adapter's request on the same tokens
    whole = (0, len(PLACEHOLDERS))
    for request_id, kwargs in (("cat", {"images": (("cat-1", *whole),)}), ("cat-again", {"images": (("cat-1", *whole),)}),
                               ("dog", {"images": (("dog-2", *whole),)}), ("salted", {"cache_salt": "cat-1"}),
                               ("lora", {"lora": LoRARequest("cat-1", 1, "/adapters/cat-1")})):
        harness.request(request_id, PLACEHOLDERS, max_tokens=3, **kwargs)
        harness.run()
    findings, events = harness.findings()
    # THEN the same image hit its blocks and nothing else hit anything, and no check finds anything
    assert set(_hits(events)) == {"cat-again"} and len(_hits(events)["cat-again"]) == 3
    assert findings == [], [f.message for f in findings]
    # AND each request's seq_start names its key parts, each apart
    starts = {e.seq: (e.extra_keys, e.salt, e.adapter, e.adapter_id) for e in events if type(e) is SeqStart}
    assert starts == {"cat": (["cat-1"], None, None, None), "cat-again": (["cat-1"], None, None, None),
                      "dog": (["dog-2"], None, None, None), "salted": (None, "cat-1", None, None),
                      "lora": (None, None, "cat-1", 1)}


def test_an_image_identifier_equal_to_an_adapters_name_reaches_its_blocks_when_key_parts_are_untagged(
        harness, monkeypatch):
    # GIVEN vLLM's extra key parts joined untagged (vllm #44701): an adapter COLLIDE serves a prompt
    _patch_extra_keys(monkeypatch, lambda keys: tuple(k[1] for k in keys))
    harness.request("adapter", PLACEHOLDERS, max_tokens=3, lora=LoRARequest("COLLIDE", 1, "/adapters/collide"))
    harness.run()
    # WHEN a base-model request sends an image whose identifier is COLLIDE over the same tokens
    harness.request("image", PLACEHOLDERS, max_tokens=3, images=(("COLLIDE", 0, len(PLACEHOLDERS)),))
    harness.run()
    findings, events = harness.findings()
    # THEN it hit the adapter's blocks, and adapters/key-collision names the image's part and the adapter's
    assert len(_hits(events).get("image", ())) == 3
    (f,) = [f for f in findings if f.check == "adapters"]
    assert f.rule == "key-collision" and f.seq == "image" and f.block in _hits(events)["image"]
    assert "extra_keys='COLLIDE'" in f.message and "adapter='COLLIDE'" in f.message, f.message


def test_a_key_that_leaves_images_out_serves_another_images_blocks_as_a_prefix_hash_mismatch(harness, monkeypatch):
    # GIVEN vLLM's key without its multimodal parts (a weak image hash: vllm PR #12621, sglang #2151)
    _patch_extra_keys(monkeypatch, lambda keys: tuple(k for k in keys if k[0] != "mm"))
    harness.request("cat", PLACEHOLDERS, max_tokens=3, images=(("cat-1", 0, len(PLACEHOLDERS)),))
    harness.run()
    # WHEN another image comes with the same placeholder tokens
    harness.request("dog", PLACEHOLDERS, max_tokens=3, images=(("dog-2", 0, len(PLACEHOLDERS)),))
    harness.run()
    findings, events = harness.findings()
    # THEN the dog's hits on the cat's blocks are each named: kvdoctor's key holds the images apart
    mismatches = [f for f in findings if f.rule == "hash-mismatch"]
    assert {(f.check, f.seq) for f in mismatches} == {("prefix", "dog")}, [f.message for f in findings]
    assert sorted(f.block for f in mismatches) == sorted(_hits(events)["dog"]) and len(mismatches) == 3
