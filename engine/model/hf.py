"""kvdoctor's cache under ``model.generate``: a transformers ``Cache`` backed by ``PagedKVCache``.

transformers 5.x hands every layer's new K/V to ``cache.update`` and attends over
what it returns. ``EngineCache`` writes them into the engine's paged blocks and
returns the K/V gathered back from those blocks, so any decoder transformers
supports runs on kvdoctor's tiered cache with the engine's events (``batch``,
``write``, ``read``, swaps, usage). Row ``b`` of the batch is the engine sequence
``seqs[b]``. Attention statistics (``attn`` events) need the scores, which
transformers' own kernels do not expose: switch the model to the ``"kvdoctor"``
attention implementation (``use_kvdoctor_attention(model)``), registered here with
``AttentionInterface``, which computes attention over those K/V with statistics.

Every generate mode runs on it: greedy and sampling, beam search (``reorder_cache``),
``num_return_sequences``, assisted and prompt-lookup decoding (``crop``), and the row
expansion and selection contrastive search makes (``batch_repeat_interleave``,
``batch_select_indices``). A row operation moves rows between engine sequences instead of
copying K/V: a row keeps the sequence it continues, a duplicate row is a sequence that
``adopt``s the blocks (or a ``fork``), a dropped row's sequence ends, and a write into a
shared partial block copies it first; the events show it as ``share``, ``release``,
``seq_start``/``seq_end`` and ``free``.

A step ends when the next forward pass begins or on ``finish()``; call
``finish()`` (or ``close()``) after ``generate`` so the last step and the
sequences' ends reach the trace.
"""

from __future__ import annotations

import functools
import itertools
import threading
from typing import Any, Sequence

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ...events import AttnStep, Batch, SeqId
from ..config import EngineConfig
from ..errors import CacheMisuse
from ..kv.cache import PagedKVCache
from .attention import AttnLayout, Newest, attend, layer_stats
from .threads import ThreadPolicy

__all__ = ["EngineCache", "ATTN_IMPLEMENTATION", "use_kvdoctor_attention", "kvdoctor_attention"]

ATTN_IMPLEMENTATION = "kvdoctor"
_active = threading.local()  # the EngineCache whose update ran last in this thread: attention reads its blocks


class _EngineLayer(CacheLayerMixin):
    """One layer's view of the shared engine cache; all state lives in ``EngineCache``."""

    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, owner: EngineCache, layer: int) -> None:
        super().__init__()
        self.owner, self.layer = owner, layer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.is_initialized = True
        return self.owner._update(self.layer, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass  # EngineCache.reset() releases the sequences once for all layers

    def crop(self, tokens_to_remove: int) -> None:
        pass  # EngineCache.crop() rolls the sequences back once for all layers

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        pass  # EngineCache.reorder_cache() moves the rows once for all layers

    def batch_repeat_interleave(self, repeats: int) -> None:
        pass  # EngineCache.batch_repeat_interleave() forks the rows once for all layers

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        pass  # EngineCache.batch_select_indices() keeps the rows once for all layers


class EngineCache(Cache):
    """A transformers ``Cache`` whose K/V live in a kvdoctor ``PagedKVCache``.

    ``EngineCache(model, device_blocks=…, host_blocks=…, …)`` builds an engine shaped for
    ``model`` (further keywords are ``EngineConfig`` fields); ``EngineCache(cache=engine)``
    wraps an existing one. ``seqs`` names the engine sequences of the batch rows (default:
    ``"gen1.row0"``, ``"gen1.row1"``, … for the rows of the first generate call, ``"gen2.row0"`` …
    after a ``finish()``); rows that forks add take fresh ``"genN.forkK"`` ids, and ``finish()`` puts
    the given names back.

    Misuse raises ``CacheMisuse`` before the model fails somewhere deep, with a finding in the trace
    where one applies: a model whose layers, KV heads or head size differ from the engine's (the trace
    header names no head shapes, so no finding); a batch of another size on the rows an earlier generate
    call left (a ``batch`` event whose shape does not fit them: ``batch/batch-shape``); and, for a cache
    built from ``model``, a generate call whose prompt does not continue the tokens those rows hold (an
    unrelated prompt on a used cache, which transformers would compute after the old tokens: a ``batch``
    from position 0 on rows that hold tokens, ``batch/batch-position``). ``finish()`` between unrelated generate calls.
    """

    def __init__(self, model: Any = None, *, cache: PagedKVCache | None = None, seqs: Sequence[SeqId] | None = None,
                 stats_every: int = 1, per_head: bool = False, **engine_config: Any) -> None:
        if (model is None) == (cache is None):
            raise ValueError("EngineCache needs exactly one of model (to build an engine) or cache (an engine)")
        self._owns_engine = cache is None
        if cache is None:
            cfg = model.config.get_text_config(decoder=True)
            param = next(model.parameters())
            cache = PagedKVCache(EngineConfig(
                num_layers=cfg.num_hidden_layers,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                dtype=str(param.dtype).removeprefix("torch."),
                device=str(param.device),
                **engine_config,
            ))
        elif engine_config:
            raise ValueError(f"engine options {sorted(engine_config)} only apply when EngineCache builds the engine")
        self.engine = cache
        # transformers' forward runs kvdoctor's kernels (on their pool) and torch's ops (on its OpenMP team): each
        # waits and is sized, as the runner's, by the CPUs other processes leave (engine.model.threads), and given
        # back at finish()
        self.threads = ThreadPolicy()
        self.stats_every = stats_every
        self.per_head = per_head
        self.seqs: list[SeqId] = list(seqs) if seqs is not None else []
        self._names = list(seqs) if seqs is not None else None  # what finish() puts back: forks take new ids
        self._ids = itertools.count()
        self._calls = 0  # generate calls (sets of rows) so far: the N of "genN.rowB"
        self._tokens: torch.Tensor | None = None  # the token ids generate last held for the rows (B, T)
        self._prompts_model = model if model is not None and _see_prompts(model) else None
        self._last_layer = -1  # the last layer the current pass updated
        self._slots: torch.Tensor | None = None
        self._table: torch.Tensor | None = None
        self._kv_len = 0
        self._in_step = False
        self._scores: list[Newest] = []  # newest queries' scores per layer, for this step's statistics
        self._keep: torch.Tensor | None = None
        num_layers = cache.config.num_layers
        super().__init__(layers=[_EngineLayer(self, i) for i in range(num_layers)])

    @property
    def bus(self) -> Any:
        return self.engine.bus

    # ---- what transformers asks ----
    def get_seq_length(self, layer_idx: int = 0) -> int:
        if not self.seqs or self.seqs[0] not in self.engine.seqs:
            return 0
        return self.engine.seq_len(self.seqs[0])

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx >= len(self.layers):
            self._check_shapes(layer_idx, key_states)
        return self._update(layer_idx, key_states, value_states)

    def _check_shapes(self, layer: int, k: torch.Tensor) -> None:
        """The model must be one the engine was shaped for: its layers, KV heads and head size."""
        c = self.engine.config
        _, heads, _, dim = k.shape  # (B, H_kv, S, D)
        short = self._in_step and self._last_layer != len(self.layers) - 1  # the last pass stopped early
        if layer < len(self.layers) and heads == c.num_kv_heads and dim == c.head_dim and not short:
            return
        came = (f"a pass that ended at layer {self._last_layer}" if short else
                f"layer {layer} with {heads} KV heads of {dim} dims")
        raise CacheMisuse("shapes", f"this EngineCache was built for a model of {len(self.layers)} layers with "
                                    f"{c.num_kv_heads} KV heads of {c.head_dim} dims, but the model passed {came}: "
                                    f"build one EngineCache per model (EngineCache(model, ...))")

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``-tokens_to_remove`` tokens of every row (assisted decoding's rejected
        candidates, contrastive search's look-ahead) as a ``rollback``; 0 does nothing. As for
        transformers' ``DynamicCache``, the count is negative: a positive one (the old "crop to this
        length") is refused."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count of tokens to remove, "
                             f"as transformers' DynamicCache takes it (crop({-tokens_to_remove}))")
        if tokens_to_remove == 0:
            return
        self._end_step()
        for seq in self.seqs:
            if seq in self.engine.seqs:
                self.engine.rollback(seq, -tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues the hypothesis of row ``beam_idx[i]``. Rows change owners,
        not bytes (``_remap``)."""
        self._remap(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Every row becomes ``repeats`` adjacent rows (contrastive search's candidates): the copies
        are ``fork``s that share the row's blocks copy-on-write."""
        if repeats < 1:
            raise ValueError(f"batch_repeat_interleave({repeats}): repeats must be >= 1")
        self._remap([b for b in range(len(self.seqs)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (row numbers, or a boolean mask), in that order; the other rows'
        sequences end and their blocks nobody else holds are freed."""
        idx = torch.as_tensor(indices)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().squeeze(1)
        self._remap(idx.tolist())

    def reset(self) -> None:
        """Release every row's sequence; the next forward starts from an empty cache."""
        self.finish()

    # ---- rows ----
    def _remap(self, sources: list[int]) -> None:
        """Row ``i`` of the new batch continues row ``sources[i]`` of the current one, with ownership
        moves, shares and releases in place of K/V copies:

        - the first new row that picks an old row takes that row's sequence as it is (no event);
        - a further row picking it takes a sequence no row picked, which ``adopt``s the picked one's
          blocks (``share`` the ones it lacks, ``release`` the rest), or else a ``fork`` (``seq_start``,
          ``share``) when every old sequence is taken;
        - the sequences nobody picked and nobody adopted end (``seq_end``; their blocks nobody else
          holds are freed).

        Shared partial blocks are copied on the next write into them (``PagedKVCache.reserve``). Every
        row holds the same number of tokens (they are one padded batch), so adoption always applies."""
        old = self.seqs
        if any(not 0 <= s < len(old) for s in sources):
            raise IndexError(f"EngineCache has {len(old)} rows; cannot take rows {sources}")
        self._end_step()  # the step's statistics and usage belong to the rows that computed it
        eng = self.engine
        live = bool(old) and old[0] in eng.seqs  # rows exist once the first forward pass created them
        rows: list[SeqId | None] = [None] * len(sources)
        taken: set[int] = set()
        for i, s in enumerate(sources):
            if s not in taken:
                taken.add(s)
                rows[i] = old[s]
        spare = [q for b, q in enumerate(old) if b not in taken]
        for i, s in enumerate(sources):
            if rows[i] is not None:
                continue
            # a row's own previous sequence first, so that ids stay in their rows where they can
            q = old[i] if i < len(old) and old[i] in spare else (spare[0] if spare else None)
            if q is not None:
                spare.remove(q)
                if live:
                    eng.adopt(q, old[s])
            else:
                q = self._fresh_id()
                if live:
                    eng.fork(old[s], q)
            rows[i] = q
        if live:
            for q in spare:
                eng.remove_sequence(q, reason="aborted")
        self.seqs = list(rows)

    def _fresh_id(self) -> SeqId:
        """A sequence id not yet used by this cache's engine (ids are unique within a trace)."""
        while True:
            seq = f"gen{self._calls}.fork{next(self._ids)}"
            if seq not in self.engine.seqs and seq not in self.seqs:
                return seq

    # ---- the engine side ----
    def _begin(self, batch: int, new: int) -> None:
        """Layer 0 of a forward pass: close the previous step, reserve slots, bring blocks up."""
        self.threads.before_step()
        self._end_step()
        eng = self.engine
        if not self.seqs:
            # Fresh ids after every finish(), named by generate call and row, so a finding's "gen2.row1"
            # reads as "the second row of the second generate call"; unique within the trace.
            self._calls += 1
            self.seqs = [self._row_name(b) for b in range(batch)]
        if len(self.seqs) != batch:
            self._wrong_batch(batch, new)
        for seq in self.seqs:
            if seq not in eng.seqs:
                eng.add_sequence(seq, prompt_len=new)
        positions = [eng.seq_len(seq) for seq in self.seqs]
        self._slots = torch.cat([eng.reserve(seq, new) for seq in self.seqs])
        eng.ensure_resident(self.seqs)
        tables = [eng.slot_table(seq) for seq in self.seqs]
        width = max(t.numel() for t in tables)
        table = torch.zeros(batch, width, dtype=torch.long, device=eng.device)
        for b, t in enumerate(tables):
            table[b, : t.numel()] = t
        self._table = table
        self._kv_len = eng.num_tokens(self.seqs[0])
        self._in_step = True
        if eng.bus.enabled:
            c = eng.config
            eng.bus.emit(Batch, rows=list(self.seqs), positions=positions, n=[new] * batch,
                         shape=[batch, c.num_kv_heads, self._kv_len, c.head_dim])

    def _row_name(self, row: int) -> SeqId:
        seq = f"gen{self._calls}.row{row}"
        while seq in self.engine.seqs:  # an engine shared with another EngineCache
            seq = f"{seq}'"
        return seq

    def _see_tokens(self, input_ids: torch.Tensor, first: bool) -> None:
        """The token ids ``generate`` holds for the rows, before each pass: at a call's first pass, the
        tokens the rows already hold must be where the call's prompt begins (a continued conversation),
        else the call computes its prompt's tail after another prompt's K/V."""
        held = self.get_seq_length()
        previous, self._tokens = self._tokens, input_ids
        if not first or not held or previous is None or previous.shape[0] != input_ids.shape[0]:
            return  # a new cache, a finished one, or a batch change (refused at the pass)
        width = min(held, previous.shape[1])
        if input_ids.shape[1] >= held and torch.equal(input_ids[:, :width], previous[:, :width]):
            return
        differ = (input_ids[:, :width] != previous[:, :width]) if input_ids.shape[1] >= width else None
        if differ is not None and differ.any():
            where = f"differs from them at position {int(differ.any(0).nonzero()[0])}"
        else:
            where = f"has {input_ids.shape[1]} tokens"
        rows = ", ".join(map(str, self.seqs))
        # in the trace, the pass the call would make: its prompt from position 0 on rows that hold ``held`` tokens
        self._refused_batch(positions=[0] * len(self.seqs), n=[input_ids.shape[1]] * len(self.seqs))
        raise CacheMisuse("prompt", f"this EngineCache's rows ({rows}) hold {held} tokens from an earlier generate "
                                    f"call, and this call's prompt {where}: it does not continue them. Call "
                                    f"cache.finish() before an unrelated prompt, or pass the earlier output followed "
                                    f"by the new tokens to continue")

    def _refused_batch(self, positions: list[int], n: list[int], shape: list[int] | None = None) -> None:
        """The ``batch`` event of a pass refused as misuse, written at once: the trace shows what the call would
        have computed on the rows it found (``batch/batch-position``, ``batch/batch-shape``) before the error."""
        bus = self.engine.bus
        if bus.enabled:
            bus.emit(Batch, rows=list(self.seqs), positions=positions, n=n, shape=shape)
            bus.flush()

    def _wrong_batch(self, batch: int, new: int) -> None:
        """A pass of ``batch`` rows on the rows an earlier call left: the ``batch`` event the engine would
        compute (its shape does not fit the rows it holds: ``batch/batch-shape``), then ``CacheMisuse``."""
        eng, c = self.engine, self.engine.config
        held = len(self.seqs)
        self._refused_batch(positions=[eng.seq_len(s) for s in self.seqs], n=[new] * held,
                            shape=[batch, c.num_kv_heads, eng.seq_len(self.seqs[0]) + new, c.head_dim])
        raise CacheMisuse("batch", f"this EngineCache holds {held} row(s) ({', '.join(map(str, self.seqs))}) from an "
                                   f"earlier generate call, but the model passed a batch of {batch}: call "
                                   f"cache.finish() between generate calls, or use one EngineCache per batch")

    def _update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, H_kv, S, D = k.shape
        if layer == 0:
            self._check_shapes(layer, k)
            self._begin(B, S)
        self._last_layer = layer
        eng = self.engine
        _active.cache = self
        eng.store(layer, self._slots, k.transpose(1, 2).reshape(B * S, H_kv, D), v.transpose(1, 2).reshape(B * S, H_kv, D))
        kb, vb = eng.read_blocks(layer, self._table)  # (B, nb, H_kv, bs, D) each, decoded by the codec
        nb, bs = kb.shape[1], kb.shape[3]
        keys = kb.transpose(1, 2).reshape(B, H_kv, nb * bs, D)[:, :, : self._kv_len]
        values = vb.transpose(1, 2).reshape(B, H_kv, nb * bs, D)[:, :, : self._kv_len]
        if layer == len(self.layers) - 1:
            for seq in self.seqs:
                eng.commit(seq, S)
                eng.emit_read(seq)
        return keys.to(k.dtype), values.to(v.dtype)

    def stats_due(self) -> bool:
        bus = self.engine.bus
        return bool(bus.enabled and self.stats_every and bus.step % self.stats_every == 0)

    def _end_step(self) -> None:
        if self._in_step:
            self._in_step = False
            self._emit_stats()
            self.engine.end_step(int(self._slots.numel()))

    def _emit_stats(self) -> None:
        """The step's ``attn_step`` event (every row and layer), computed once from the scores attention kept."""
        per_layer, self._scores = self._scores, []
        if len(per_layer) != len(self.layers):
            return  # not the kvdoctor attention implementation, or statistics not due this step
        st = layer_stats(per_layer, self._keep, sink_tokens=self.engine.block_size, per_head=self.per_head)
        self.engine.bus.emit(AttnStep, seqs=list(self.seqs), **st.fields())

    def finish(self) -> None:
        """End the current step and release every row's sequence (``seq_end``): call after ``generate``."""
        self._end_step()
        for seq in self.seqs:
            if seq in self.engine.seqs:
                self.engine.remove_sequence(seq, reason="finished")
        self.seqs = list(self._names) if self._names is not None else []
        self._tokens = None
        self.engine.end_step(0)
        self.threads.restore()

    def close(self) -> None:
        """``finish()``, then close the engine if this cache built it."""
        model, self._prompts_model = self._prompts_model, None
        ours = model is not None and vars(model).get("prepare_inputs_for_generation")
        if ours and getattr(ours, "_kvdoctor_engine_cache", False):
            del model.prepare_inputs_for_generation  # the class's own again
        if not self.engine._closed:
            self.finish()
            if self._owns_engine:
                self.engine.close()

    def __enter__(self) -> EngineCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _see_prompts(model: Any) -> bool:
    """Wrap ``model.prepare_inputs_for_generation`` on the instance (until the cache closes) so that an
    ``EngineCache`` passed to ``generate`` sees the token ids of its rows: the cache holds K/V only.
    False when there is nothing to wrap or another EngineCache's wrapper is already there."""
    prepare = getattr(model, "prepare_inputs_for_generation", None)
    if prepare is None or getattr(prepare, "_kvdoctor_engine_cache", False):
        return False

    @functools.wraps(prepare)
    def seen(*args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        ids = args[0] if args else kwargs.get("input_ids")
        if isinstance(cache, EngineCache) and isinstance(ids, torch.Tensor):
            cache._see_tokens(ids, bool(kwargs.get("is_first_iteration")))
        return prepare(*args, **kwargs)

    seen._kvdoctor_engine_cache = True  # type: ignore[attr-defined]
    model.prepare_inputs_for_generation = seen
    return True


def kvdoctor_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention over an ``EngineCache``'s K/V that emits ``attn`` statistics.

    ``query`` (B, H, S, D), ``key``/``value`` (B, H_kv, T, D) as returned by the cache;
    returns (B, S, H, D) like transformers' SDPA path.
    """
    B, H, S, D = query.shape
    owner: EngineCache | None = getattr(_active, "cache", None)
    if owner is not None and owner.engine._closed:
        owner = None
    layer = getattr(module, "layer_idx", 0)
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask == 0  # an additive mask: 0 where attention is allowed
    sink = owner.engine.block_size if owner is not None else 16
    layout = AttnLayout.from_mask(mask, B, S, sink_tokens=sink)
    stats = owner is not None and owner.stats_due()
    corrupt = owner.engine.score_hook(layer) if owner is not None else None
    scale = scaling if scaling is not None else D ** -0.5
    out, newest = attend(query, key, value, layout, scale=scale, scores=stats, corrupt=corrupt)
    if newest is not None:
        owner._scores.append(Newest(newest.scores.float(), newest.probs))
        owner._keep = layout.keep
    return out.transpose(1, 2).contiguous(), None


def use_kvdoctor_attention(model: Any) -> Any:
    """Switch ``model`` to the ``"kvdoctor"`` attention implementation (statistics from the scores); returns it."""
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


AttentionInterface.register(ATTN_IMPLEMENTATION, kvdoctor_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
