"""The KV-compression options every command that builds an engine takes: ``--codec`` and ``--topk``.

``kvdoctor run``, the demo and ``kvdoctor watch --demo`` read them the same way. The
names are listed here so ``--help`` needs no engine import (a test keeps them equal to
``engine.kv.codecs.CODECS``); the engine's config judges the rest (the order of the tiers'
codecs, the calibration's shape).
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["CODEC_NAMES", "CODEC_METAVAR", "CODEC_HELP", "MERGE_HELP", "codec_setting", "merge_threshold",
           "engine_settings"]

CODEC_NAMES = ("fp32", "fp16", "bf16", "int8", "nf4")
_TIER_NAMES = ("device", "host", "disk")
_CALIBRATED = ("int8",)  # codecs whose key scales come from a calibration (engine.kv.codecs.NEEDS_CALIBRATION)
CODEC_METAVAR = "{" + ",".join((*CODEC_NAMES, "mixed")) + "}|TIER=CODEC,..."
CODEC_HELP = ("how K/V blocks are stored: fp32, fp16 or bf16 numbers, or int8 or nf4 codes (8 or 4 bits a "
              "value: smaller, a little less exact); default: the model's dtype. One per tier: "
              "device=fp16,host=int8,disk=nf4 (a block is re-encoded as it moves down); mixed: blocks attention "
              "finds unimportant shrink to nf4 on the device. int8 measures the keys' ranges once, on a sample "
              "text, and keeps them in ~/.cache/kvdoctor")


def codec_setting(text: str) -> str:
    """An argparse type: a codec, ``mixed``, or per tier ``device=fp16,host=int8,disk=nf4``. Only names
    that cannot be right are caught here."""
    names = (*CODEC_NAMES, "mixed")
    if "=" not in text:
        if text not in names:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(names)} or TIER=CODEC,...")
        return text
    for part in text.split(","):
        tier, _, name = part.partition("=")
        if tier not in _TIER_NAMES or name not in names:
            raise argparse.ArgumentTypeError(
                f"{part!r}: per tier, each part is TIER=CODEC with TIER one of {', '.join(_TIER_NAMES)} "
                f"and CODEC one of {', '.join(names)} (e.g. device=fp16,host=int8,disk=nf4)")
    return text


MERGE_HELP = ("token merging: in blocks past the sink and the recent window, adjacent tokens whose keys have cosine "
              "similarity >= THRESHOLD (per layer and KV head) share one slot with a count; 0 (default): off")


def merge_threshold(text: str) -> float:
    """An argparse type: ``--merge``'s cosine similarity threshold, 0 (off) or in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value == 0 or 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not 0 (off) or a cosine similarity threshold in (0, 1]")
    return value


def calibrated(codec: str | None) -> bool:
    """Whether ``--codec`` names a codec whose calibration runs the model's own forward (transformers')."""
    return bool(codec) and bool({part.partition("=")[2] or part for part in codec.split(",")} & set(_CALIBRATED))


def engine_settings(codec: str | None, topk: int, loaded: Any) -> dict[str, Any]:
    """The ``EngineConfig`` fields of ``--codec`` and ``--topk`` for a loaded model; a quantized codec
    brings its calibration (computed once per model and kept in the cache directory)."""
    out: dict[str, Any] = {}
    if codec:
        out["codec"] = codec
        if calibrated(codec):
            from .engine.kv.codecs import default_calibration
            from .errors import UsageError

            if loaded.tokenizer is None:
                raise UsageError(f"--codec {codec} calibrates on text, and the model {loaded.name} has no tokenizer")
            out["calibration"] = default_calibration(loaded.model, loaded.tokenizer, name=loaded.name)
    if topk:
        out["topk"] = topk
    return out
