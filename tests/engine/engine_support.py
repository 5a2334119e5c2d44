"""Helpers shared by the engine tests: a tiny cache wired to an event list, and a token writer
that remembers what it wrote so tests can compare bytes read back, and for ``EngineCache`` under
``generate``: a traced run checked by every check, and contrastive search's cache calls. (A module of its own, not
conftest, so test files can import it by a name no other test folder uses.)"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch

from kvdoctor.checks import make_suite
from kvdoctor.engine.kv.cache import PagedKVCache
from kvdoctor.engine.config import EngineConfig
from kvdoctor.engine.model.hf import EngineCache
from kvdoctor.trace import TraceReader


class Recorder:
    """The cache plus every event it emitted and the K/V each sequence was given, per layer."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.events: list[Any] = []
        cache.bus.subscribe(self.events.extend)
        self.kv: dict[Any, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._gen = torch.Generator().manual_seed(0)

    def write(self, seq: Any, n: int, tokens: list[int] | None = None) -> None:
        """Append ``n`` random tokens to ``seq`` in every layer (reserve, store, commit); ``tokens``: their
        ids, for a prefix cache to key the blocks they fill by."""
        c = self.cache.config
        slots = self.cache.reserve(seq, n)
        layers = self.kv.setdefault(seq, [(torch.empty(0, c.num_kv_heads, c.head_dim),) * 2 for _ in range(c.num_layers)])
        for layer in range(c.num_layers):
            k = torch.randn(n, c.num_kv_heads, c.head_dim, generator=self._gen)
            v = torch.randn(n, c.num_kv_heads, c.head_dim, generator=self._gen)
            self.cache.store(layer, slots, k.to(self.cache.device), v.to(self.cache.device))
            layers[layer] = (torch.cat([layers[layer][0], k]), torch.cat([layers[layer][1], v]))
        self.cache.commit(seq, n, tokens=tokens)

    def add(self, seq: Any, n: int) -> None:
        self.cache.add_sequence(seq, prompt_len=n)
        self.write(seq, n)

    def fork(self, parent: Any, child: Any) -> None:
        self.cache.fork(parent, child)
        self.kv[child] = list(self.kv[parent])

    def rollback(self, seq: Any, n: int) -> None:
        self.cache.rollback(seq, n)
        self.kv[seq] = [(k[:-n], v[:-n]) for k, v in self.kv[seq]]

    def expected(self, seq: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``gather`` must return: the written K/V of the blocks still present, ``(H, T, D)``."""
        bs = self.cache.block_size
        k, v = self.kv[seq][layer]
        keep = [p for b in self.cache.seqs[seq].blocks for p in range(b.index * bs, min((b.index + 1) * bs, len(k)))]
        return k[keep].transpose(0, 1), v[keep].transpose(0, 1)

    def assert_intact(self, seq: Any) -> None:
        self.cache.ensure_resident([seq])
        for layer in range(self.cache.config.num_layers):
            k, v = (t.cpu() for t in self.cache.gather(seq, layer))
            ek, ev = self.expected(seq, layer)
            assert torch.equal(k, ek) and torch.equal(v, ev), f"seq {seq!r} layer {layer}: bytes differ"

    def kinds(self, *kinds: str) -> list[Any]:
        self.cache.bus.flush()
        return [e for e in self.events if type(e).__struct_config__.tag in kinds]


def tiny_config(**kw: Any) -> EngineConfig:
    base: dict[str, Any] = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32",
                                device_blocks=4, host_blocks=4, disk_blocks=8, chunk_blocks=2)
    base.update(kw)
    return EngineConfig(**base)


def findings_of(path) -> tuple[TraceReader, list[Any], list[Any]]:
    """Every check over the trace file at ``path``: its reader, its events and the findings."""
    reader = TraceReader(path)
    suite = make_suite()
    events = []
    for e in reader:
        events.append(e)
        suite.observe(e)
    return reader, events, suite.findings + suite.finish()


def traced(model, tmp_path, monkeypatch, run: Callable[[EngineCache], Any], name: str = "run", **engine: Any
           ) -> tuple[Any, list[Any], list[Any]]:
    """``run(cache)`` on an EngineCache that writes a trace file; its result, the trace's events and the
    findings of every check over that trace."""
    path = tmp_path / f"{name}.kvtrace"
    monkeypatch.setenv("KVDOCTOR_TRACE", str(path))
    engine = {"block_size": 4, "device_blocks": 64, "host_blocks": 0, **engine}
    with EngineCache(model, **engine) as cache:
        result = run(cache)
    monkeypatch.delenv("KVDOCTOR_TRACE")
    _, events, findings = findings_of(path)
    return result, events, findings


def kinds_of(events: list[Any]) -> Counter:
    return Counter(type(e) for e in events)


def contrastive_search(model, ids: torch.Tensor, cache: Any, top_k: int = 3, alpha: float = 0.6, steps: int = 6
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Contrastive search (Su et al., 2022) as transformers 4.x's generate ran it, making the same cache calls:
    ``batch_repeat_interleave(top_k)`` for the candidates, one forward pass over them, ``batch_select_indices``
    for each row's chosen one, ``crop(-1)`` at the end. (transformers 5 moved it to a Hub repository, which
    tests cannot reach.) Returns the tokens and the logits of one more step after the crop."""
    B = ids.shape[0]
    out = model(ids, cache=cache, output_hidden_states=True)
    context, logits = out.hidden_states[-1], out.logits[:, -1]  # (B, T, H), (B, V)
    for _ in range(steps):
        top_p, top_ids = logits.softmax(-1).topk(top_k, dim=-1)  # (B, k) each
        cache.batch_repeat_interleave(top_k)
        cand = model(top_ids.reshape(-1, 1), cache=cache, output_hidden_states=True)
        h = cand.hidden_states[-1][:, -1]  # (B*k, H)
        sim = torch.cosine_similarity(h[:, None], context.repeat_interleave(top_k, dim=0), dim=-1)  # (B*k, T)
        best = ((1 - alpha) * top_p - alpha * sim.max(-1).values.view(B, top_k)).argmax(-1)  # (B,)
        keep = best + torch.arange(B) * top_k
        cache.batch_select_indices(keep)
        ids = torch.cat([ids, top_ids[torch.arange(B), best, None]], dim=1)
        context = torch.cat([context, h[keep, None]], dim=1)
        logits = cand.logits[keep, -1]
    cache.crop(-1)
    return ids, model(ids[:, -1:], cache=cache).logits[:, -1]
