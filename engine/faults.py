"""Deliberate, named faults that make the real engine misbehave, so every check can be shown working.

Each fault changes what the engine *does* (which memory it writes, which copy it
serves, what it frees); the events it emits stay honest descriptions of that
behaviour, and the checks find the bug from them exactly as they would find a
real one. All faults are off unless ``EngineConfig(fault=NAME)`` or the
``KVDOCTOR_FAULT`` environment variable names one.
"""

from __future__ import annotations

from typing import Any, Callable

from .. import knobs

__all__ = ["FAULTS", "CONTENT_FAULTS", "resolve_fault", "Faults"]

FAULTS: dict[str, str] = {
    "leak-swapped": "blocks swapped out to host or disk are forgotten when their sequence ends: "
    "never freed, they stay allocated in the slower tier",
    "stale-version": "a block swapped back out reuses the host/disk copy it left behind at its last "
    "swap-in, even after newer writes; the next swap-in serves that old copy",
    "stale-staging": "the device staging area (long context) serves the copy it staged of a block by the block's "
    "id alone, without comparing versions: a block written since it was staged is read at its old version",
    "batch-misalign": "every eighth batched step, the second row's new K/V is written into the "
    "first row's sequence's tail block instead of its own",
    "attention-nan": "from step 2 on, one head's newest score at the middle layer becomes NaN "
    "(the runner applies it through Faults.corrupt_scores)",
    "free-during-prefetch": "a prefetch's copy is slow (it waits until a step needs the block); a block dropped "
    "or demoted while its copy is in flight is not waited for: its reserved device slot goes back to the pool "
    "while the copy still lands there, and the transfer never ends",
    # Content faults: the bytes go wrong while every event stays right; only digests (integrity) see them.
    "overwrite-foreign": "once, from step 2 on: right after a sequence's write, another live sequence's newest "
    "block is copied over the first block of the sequence written",
    "stale-slot": "once, from step 2 on: a block handed a reused device slot never gets its first write; the "
    "slot keeps the bytes its previous block left there",
    "wrong-scale": "once, from step 2 on: the dequantisation scale stored with a just-written token (int8/nf4 "
    "device codec) is doubled at the middle layer",
    "bit-flip": "once, from step 2 on: one bit of a high byte of a sequence's first block flips at the middle "
    "layer (an exponent bit for fp16/bf16/fp32, a code bit for int8/nf4)",
    "row-off-by-one": "once, from step 2 on: a step's first token is written one row further into its block "
    "(every layer), leaving its own row as it was",
    "zeroed-block": "once, from step 2 on: a sequence's first block is zeroed at the middle layer, as a page "
    "cleared under the cache would be",
    "noise": "once, from step 2 on: the keys of a sequence's first block get small noise (about 1% of their "
    "size) at the middle layer: nearly the right values, which attention statistics do not notice",
    # A write whose values are wrong and whose events say so (the write's nonfinite positions): slots sees it.
    "nonfinite-write": "once, from step 2 on: the first token a step stores gets a NaN in its keys at the middle "
    "layer as it is written, as a kernel or an fp16 overflow would write it (its record holds the NaN too)",
    # Prefix-cache faults (engine.kv.prefix): the cache hands a request K/V that is not its prefix's.
    "prefix-unsalted": "the prefix cache keys blocks by their tokens alone, leaving out the salt (model, weights, "
    "KV codec, rope scaling, adapter): a request under another adapter hits blocks computed under the first",
    "prefix-overwritten": "a block that only the prefix cache holds is handed to a request as its next new block "
    "without leaving the cache; the request writes over it, and a later hit is served that request's K/V",
    "prefix-freed-in-use": "when the request that computed a cached block ends, the cache evicts the block at once, "
    "though requests that hit it still hold it and read it (its slot goes to the next block allocated)",
    # Speculative decoding (engine.serving.speculative)
    "spec-rollback-uncut": "a rollback that keeps part of a sequence (rejected draft tokens) is recorded and advances "
    "the version, but the sequence's length is not cut: the rejected tokens' K/V stay in it, attention reads them, "
    "and the next token is written after them",
}

# Faults that corrupt stored K/V while the events stay right.
CONTENT_FAULTS = ("overwrite-foreign", "stale-slot", "wrong-scale", "bit-flip", "row-off-by-one", "zeroed-block",
                  "noise")

_CONTENT_FROM_STEP = 2  # the content faults fire once, at the first chance from this step on
_MISALIGN_EVERY = 8  # batch-misalign fires on the 1st, 9th, 17th ... step that has two or more rows
_NAN_FROM_STEP = 2


def resolve_fault(name: str | None) -> str | None:
    """The fault in force: ``name`` if given, else ``$KVDOCTOR_FAULT``; validated."""
    if name:
        return name
    env = knobs.get(knobs.FAULT)
    if not env:
        return None
    if env not in FAULTS:
        raise ValueError(f"{knobs.FAULT.name}={env!r}: must be one of {', '.join(FAULTS)}")
    return env


class Faults:
    """Switches the engine consults at the few places a fault changes behaviour."""

    def __init__(self, name: str | None, num_layers: int) -> None:
        self.name = name
        self.leak_swapped = name == "leak-swapped"
        self.stale_version = name == "stale-version"
        self.stale_staging = name == "stale-staging"
        self.batch_misalign = name == "batch-misalign"
        self.attention_nan = name == "attention-nan"
        self.prefix_unsalted = name == "prefix-unsalted"
        self.prefix_overwritten = name == "prefix-overwritten"
        self.prefix_freed_in_use = name == "prefix-freed-in-use"
        self.rollback_uncut = name == "spec-rollback-uncut"
        self.free_during_prefetch = name == "free-during-prefetch"
        self.nonfinite_write = name == "nonfinite-write"
        self.nan_layer = num_layers // 2
        self._batched_steps = 0
        self._misalign_step = -1
        self.content = name if name in CONTENT_FAULTS else None
        self.row_off_by_one = name == "row-off-by-one"
        self.corrupt_layer = num_layers // 2  # the layer bit-flip and wrong-scale hit
        self.shift: tuple[int, int] | None = None  # row-off-by-one: (meant flat slot, step) written one row on
        self.used_slots: set[int] = set()  # stale-slot: device slots handed out so far (a reuse holds old bytes)
        # What a content fault (or nonfinite-write) corrupted once it fired: {"block", "seq", "layer", "step"}
        self.hit: dict[str, Any] | None = None

    def content_due(self, step: int) -> bool:
        """True while a content fault is on and has not fired yet, from its first step on."""
        return self.content is not None and self.hit is None and step >= _CONTENT_FROM_STEP

    def nonfinite_due(self, step: int) -> bool:
        """True while nonfinite-write is on and has not fired yet, from the content faults' first step on."""
        return self.nonfinite_write and self.hit is None and step >= _CONTENT_FROM_STEP

    def fired(self, block: int, seq: Any, layer: int | None, step: int) -> None:
        self.hit = {"block": block, "seq": seq, "layer": layer, "step": step}

    def misalign_now(self, step: int) -> bool:
        """True on the batched steps where the second row's writes go astray (counted once per step)."""
        if not self.batch_misalign:
            return False
        if self._misalign_step != step:
            self._misalign_step = step
            self._batched_steps += 1
        return (self._batched_steps - 1) % _MISALIGN_EVERY == 0

    def corrupt_scores(self, layer: int, scores: Any, step: int) -> Any:
        """Attention scores ``(..., H, Tq, Tk)`` as the fault leaves them: NaN in one head's newest score.

        The runner calls this on every layer's pre-softmax scores; with the fault off it
        returns ``scores`` untouched. The corruption is in place, like a real kernel bug.
        """
        if not self.attention_nan or layer != self.nan_layer or step < _NAN_FROM_STEP:
            return scores
        scores[..., 0, -1, -1] = float("nan")
        return scores

    def score_hook(self, layer: int, step: int) -> Callable[[Any], Any] | None:
        """The ``corrupt`` callable for ``engine.model.attention`` at ``layer`` this step, or None when
        nothing would change (so the runner keeps the fused attention path)."""
        if not self.attention_nan or layer != self.nan_layer or step < _NAN_FROM_STEP:
            return None
        return lambda scores: self.corrupt_scores(layer, scores, step)
