"""Nothing outside engine/ touches the cache's pool, tier mover or sequences table: it asks ``PagedKVCache`` a query.

The pool's blocks and slot tables, the mover's swaps and the sequences table change shape as the engine does;
the facade's queries (``has_sequence``, ``sequence``, ``blocks_of``, ``block``, ``free_blocks``, ``settle``,
``stats``) are what consumers may rely on. An AST scan of every consumer folder finds attribute chains into
those internals, and the modules that hold them imported directly.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONSUMERS = ("kvdoctor", "checks", "benchmarks", "examples")
# the producers for other engines: their pools are vLLM's and transformers' own (they never import ours)
FOREIGN = ROOT / "kvdoctor" / "integrations"

# the cache's parts that are no consumer's business, reached as ``<x>.cache.<part>`` or ``cache.<part>``
CACHE_INTERNALS = {"pool", "mover", "tiers", "seqs", "step", "tier_arenas", "dev_slots"}
# a bare name ``cache`` may be transformers' cache (``EngineCache``), whose ``seqs`` are its own rows
NAMED_CACHE_INTERNALS = CACHE_INTERNALS - {"seqs"}
POOL_INTERNALS = {"blocks", "slots", "tiers"}  # ``<x>.pool.<table>``
INTERNAL_MODULES = {"kvdoctor.engine.kv.pool", "kvdoctor.engine.kv.mover", "kvdoctor.engine.kv.sequences"}


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def reaches_in(source: str) -> list[tuple[int, str]]:
    """(line, what) for every place ``source`` reaches into the engine's internals."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            receiver = node.value
            if isinstance(receiver, ast.Attribute) and receiver.attr == "cache" and node.attr in CACHE_INTERNALS:
                found.append((node.lineno, f".cache.{node.attr}"))
            elif isinstance(receiver, ast.Name) and receiver.id == "cache" and node.attr in NAMED_CACHE_INTERNALS:
                found.append((node.lineno, f"cache.{node.attr}"))
            elif _name(receiver) == "pool" and node.attr in POOL_INTERNALS:
                found.append((node.lineno, f"pool.{node.attr}"))
            elif node.attr == "mover":
                found.append((node.lineno, ".mover"))
        elif isinstance(node, ast.ImportFrom) and node.module in INTERNAL_MODULES:
            found.append((node.lineno, f"from {node.module} import"))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name in INTERNAL_MODULES]
    return found


def _sources() -> list[Path]:
    return sorted(p for folder in CONSUMERS if (ROOT / folder).is_dir() for p in (ROOT / folder).rglob("*.py")
                  if FOREIGN not in p.parents)


def test_no_consumer_reaches_into_pool_tiers_or_sequences():
    # GIVEN every Python file of the folders outside the engine
    # WHEN each is scanned for chains into the cache's internals
    bad = [f"{p.relative_to(ROOT)}:{line}: {what}" for p in _sources() for line, what in reaches_in(p.read_text())]
    # THEN there are none: each asks the cache a query instead
    assert not bad, "code outside engine/ reaches into the cache's internals:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, what", [
    ("free = runner.cache.pool.slots['device'].num_free", ".cache.pool"),
    ("cache.mover.move(blocks, 'host')", "cache.mover"),
    ("s = self.cache.seqs[seq]", ".cache.seqs"),
    ("n = eng.pool.blocks[3].tier", "pool.blocks"),
    ("from kvdoctor.engine.kv.mover import TierMover", "from kvdoctor.engine.kv.mover import"),
])
def test_the_scan_catches_each_way_in(source, what):
    # GIVEN a line that reaches into the engine WHEN it is scanned THEN the scan names it
    assert what in [w for _, w in reaches_in(source)]


def test_the_scan_lets_queries_and_transformers_rows_pass():
    # GIVEN the facade's queries, and transformers' cache listing its own rows
    source = "cache.free_blocks('device'); runner.cache.blocks_of(seq); [s for s in cache.seqs]"
    # WHEN scanned THEN nothing is reported
    assert reaches_in(source) == []
