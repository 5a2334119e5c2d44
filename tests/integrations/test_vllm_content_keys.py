"""kvdoctor's content keys for vLLM's blocks: the parts that keep two tenants' K/V apart are tagged, so a
cache salt that equals an adapter's name keys other blocks (vllm #44701, sglang #24638). Runs without vLLM."""

from __future__ import annotations

from types import SimpleNamespace

from kvdoctor.integrations.vllm import VllmTracer


def _keys(lora: str | None, salt: str | None, tokens: list[int], block_size: int = 4,
          images: tuple[tuple[str, int, int], ...] = ()) -> list[str]:
    tracer = object.__new__(VllmTracer)  # only the key chain: no scheduler, no trace
    tracer._keys, tracer.block_size = {}, block_size
    features = [SimpleNamespace(identifier=ident, mm_position=SimpleNamespace(offset=offset, length=length))
                for ident, offset, length in images]
    request = SimpleNamespace(request_id="r", all_token_ids=tokens, cache_salt=salt, mm_features=features,
                              lora_request=SimpleNamespace(lora_name=lora) if lora is not None else None)
    return tracer._content_keys(request, len(tokens) // block_size)


def test_an_adapter_name_and_a_cache_salt_with_the_same_text_key_different_blocks():
    tokens = list(range(8))
    assert _keys("X", None, tokens) != _keys(None, "X", tokens)
    assert _keys("X", "Y", tokens) != _keys("Y", "X", tokens)
    assert _keys("None", None, tokens) != _keys(None, None, tokens)


def test_the_same_tokens_adapter_and_salt_key_the_same_chain_and_each_block_depends_on_its_parents():
    a, b = _keys("X", "s", list(range(8))), _keys("X", "s", list(range(8)))
    assert a == b and len(a) == 2
    assert _keys("X", "s", [9, 1, 2, 3, 4, 5, 6, 7])[1] != a[1]  # a different first block changes the second's key


def test_an_images_identifier_keys_the_blocks_holding_its_placeholders_and_those_after_them():
    # GIVEN three blocks of the same placeholder tokens, an image's over positions 4-7 (the second block)
    tokens = [0] * 12
    cat, dog = _keys(None, None, tokens, images=(("cat", 4, 4),)), _keys(None, None, tokens, images=(("dog", 4, 4),))
    # THEN another image keys its block and every later one apart, the block before it not; the same image the same
    assert cat[0] == dog[0] == _keys(None, None, tokens)[0] and cat[1] != dog[1] and cat[2] != dog[2]
    assert cat == _keys(None, None, tokens, images=(("cat", 4, 4),))
    # AND the same image one position later holds other K/V (positions differ): another key
    assert _keys(None, None, tokens, images=(("cat", 5, 3),))[1] != cat[1]
