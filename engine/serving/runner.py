"""Runs a Hugging Face Llama-family model with its attention reading K/V from the engine's blocks.

The runner uses the model's own modules (embedding, RMSNorms, q/k/v/o projections,
rotary embedding, MLP, LM head), so its numbers are transformers' numbers; only
attention differs: each layer writes the new K/V into the engine's blocks and then
attends over the K/V gathered back from them. A stale, misplaced or corrupted block
therefore changes the tokens, exactly as in a real serving engine, and the events
say which block it was.

One call of ``forward`` is one engine step over a batch of rows, each row a
sequence with one or more new tokens (a prompt, a chunk, or one decode token);
``Scheduler`` decides the rows.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from ...events import AttnStep, Batch, SeqId
from ..bus import Bus
from ..config import EngineConfig
from ..features.importance import ImportanceEviction
from ..features.merging import TokenMerging
from ..features.protocol import Step, StepFeature
from ..features.sparse import BlockSparse
from ..features.streaming import StreamedAttention
from ..features.window import SlidingWindow
from ..kv.cache import PagedKVCache
from ..kv.prefix import model_salt
from ..kv.readplan import BlockTable, ReadPlan
from ..model.attention import AttnLayout, AttnStats, Newest, attend, hidden_keys, layer_stats
from ..model.decode_layer import DecodeLayers, DecodeStep
from ..model.matvec import load as load_matvec
from ..model.rope import RopeTable, rope
from ..model.sampling import Generation, SamplingParams, sample, sampling_probs
from ..model.threads import ThreadPolicy
from ..model.weights import PageOut, model_weights, rms_norm
from .weights_watch import WeightsWatch

# the sampling names stay importable from here, where callers have always found them
__all__ = ["Runner", "SamplingParams", "UnsupportedModel", "sample", "sampling_probs", "Generation"]

# Decoder-only models whose layers are Llama-shaped: RMSNorm, q/k/v/o projections with RoPE
# (optionally q/k norms and projection biases), SwiGLU MLP.
SUPPORTED = {"llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "granite"}


class UnsupportedModel(ValueError):
    """A model whose architecture the runner cannot drive; names what it is and what is accepted."""


# A group's newest-query scores: one ``Newest`` per layer (the torch path appends them layer by layer), or
# one of every layer's at once (the compiled decode layers' buffer).
LayerScores = list[Newest] | Newest


def _every_layer(scores: LayerScores, num_layers: int) -> bool:
    """Whether ``scores`` cover every layer (a path without scores, block-sparse attention, leaves none)."""
    return isinstance(scores, Newest) or len(scores) == num_layers


@dataclass
class _Group:
    """Rows attended together: all one-token decode rows, or one multi-token row."""

    rows: list[int]  # indices into the step's rows
    tokens: slice | torch.Tensor  # which flat tokens belong to the group, in row order
    q_len: int
    lens: list[int]  # keys of each row
    sink_tokens: int
    blocks: BlockTable  # the rows' device block table from the step's read plan, and where their K/V rows start
    kv_len: int  # keys of the longest row
    window_layout: AttnLayout | None = None  # the mask of sliding-window layers, when the model has them
    key_bias: torch.Tensor | None = None  # (L, B, H_kv, T) token merging's score bias of each key (engine.kv.merge)

    @functools.cached_property
    def layout(self) -> AttnLayout:
        """The rows' padding and causal mask, built by the paths that use it: the compiled decode layers take
        each row's length instead (a layout costs 0.14 ms at batch 8, built after a step's weights stream)."""
        return AttnLayout.build([self.q_len] * len(self.rows), self.lens, sink_tokens=self.sink_tokens,
                                device=self.blocks.slots.device)


class Runner:
    """Prefill and decode of one model through one ``PagedKVCache``.

    ``stats_every``: attention statistics (``attn`` events) every N steps; 0 never.
    They are only computed while someone listens on the bus.
    ``native_matvec``: decode steps' projections on CPU (float32 or bf16 weights) by the C kernel of ``matvec``
    (each weight read once, over torch's threads; 1.2-1.6x MKL on SmolLM2); False: ``F.linear`` always.
    """

    def __init__(self, model: Any, cache: PagedKVCache, *, tokenizer: Any = None, stats_every: int = 1,
                 per_head: bool = False, native_matvec: bool = True) -> None:
        _check_supported(model)
        if stats_every < 0:
            raise ValueError(f"stats_every={stats_every}: must be >= 0")
        self.model = model
        self.cache = cache
        self.threads = ThreadPolicy()  # the team of every step follows the load of other processes
        self.tokenizer = tokenizer
        self.stats_every = stats_every
        self.per_head = per_head
        cfg = model.config
        self._base = model.model
        self._layers = list(self._base.layers)[: cfg.num_hidden_layers]
        self.num_layers = len(self._layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # Attention of a bf16/fp16 model on CPU in float32: without bf16 arithmetic every small product
        # converts anyway (bf16 products took ~2 ms a layer at batch 8), and torch's own CPU attention
        # (transformers' sdpa) accumulates bf16 in float32 too. K/V stay in the cache's dtype.
        self._attn_dtype = torch.float32 if self.device.type == "cpu" and self.dtype.itemsize < 4 else self.dtype
        self.block_size = cache.config.block_size
        attn = self._layers[0].self_attn  # Qwen3-style q/k norms rotate with the model's own function
        self._apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb if hasattr(attn, "q_norm") else None
        # q/k/v and gate/up as one matmul each, over one fused weight the model's Linears become views of,
        # every weight on 2 MB pages (the checkpoint's pages of the weights copied are dropped); few rows by
        # the C kernel.
        matvec = load_matvec() if native_matvec and self.device.type == "cpu" else None
        self._weights, self._lm_head = model_weights(self._layers, model.lm_head, self._base.embed_tokens,
                                                     matvec=matvec, pager=PageOut())
        self._norms = [(rms_norm(layer.input_layernorm), rms_norm(layer.post_attention_layernorm))
                       for layer in self._layers]
        self._final_norm = rms_norm(self._base.norm)
        self._rope_table = RopeTable(self._base.rotary_emb)
        # Decode steps of a plain Llama model on CPU: every layer in one compiled call (engine/model/decode_layer.py).
        self._decode = DecodeLayers.for_model(model, self._layers, self._weights)
        if (cache.config.num_layers, cache.config.num_kv_heads, cache.config.head_dim) != (
            self.num_layers, self.num_kv_heads, self.head_dim
        ):
            raise ValueError(
                f"cache shape (layers, kv heads, head dim) = {(cache.config.num_layers, cache.config.num_kv_heads, cache.config.head_dim)} "
                f"does not match the model's {(self.num_layers, self.num_kv_heads, self.head_dim)}"
            )
        # The step features the cache's config and the model ask for (engine.features.protocol); the attention paths
        # below take the ones that change attention by name.
        self._sparse = BlockSparse.for_cache(cache)  # block-sparse top-k reads (or H2O's attention mass)
        self._importance = ImportanceEviction.for_cache(cache)
        self._window = SlidingWindow.of_model(cfg)
        self._merging = TokenMerging.for_cache(cache)
        # Long context: a step whose rows have blocks off the device attends through the staging area.
        self._streamer = StreamedAttention(cache, cache.staging, self._sparse) if cache.staging is not None else None
        _check_compatible(self._sparse, self._importance, self._window, self._merging, self._streamer)
        # Every point of a step calls the features in this order (after a commit: merge, book the streamed
        # reads, summarise, evict), so a new feature joins here and nowhere else in the runner.
        self._features: list[StepFeature] = [f for f in (self._merging, self._streamer, self._sparse, self._importance,
                                                         self._window) if f is not None]
        # The hybrid policy and mixed resolution rank blocks by the attention mass they got.
        self._observe = cache.config.eviction == "hybrid" or cache.config.mixed
        self.weights_watch = WeightsWatch(model, cache, cache.bus)  # a weights event when the parameters change

    @classmethod
    def create(cls, model: Any, *, tokenizer: Any = None, bus: Bus | None = None, stats_every: int = 1,
               per_head: bool = False, native_matvec: bool = True, **config: Any) -> Runner:
        """A runner with a cache shaped for ``model``; ``config`` holds further ``EngineConfig`` fields
        (``block_size``, ``device_blocks``, ``host_blocks``, ``disk_blocks``, ``fault`` …)."""
        _check_supported(model)
        cfg = model.config
        param = next(model.parameters())
        if config.get("prefix_cache") and "prefix_salt" not in config:
            config["prefix_salt"] = model_salt(model)  # what besides the tokens decides their K/V
        engine_config = EngineConfig(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            dtype=str(param.dtype).removeprefix("torch."),
            device=str(param.device),
            **config,
        )
        cache = PagedKVCache(engine_config, bus=bus)
        return cls(model, cache, tokenizer=tokenizer, stats_every=stats_every, per_head=per_head,
                   native_matvec=native_matvec)

    @property
    def merging(self) -> TokenMerging | None:
        """Token merging (``EngineConfig.merge``): its threshold and what it merged so far; None when off."""
        return self._merging

    @property
    def bus(self) -> Bus:
        return self.cache.bus

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = self.model.config.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    def encode(self, prompt: str, *, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids of ``prompt``: as-is with the tokenizer's default special tokens, or in the chat template
        (after a ``system`` message when given: requests sharing one share a prefix the prefix cache reuses)."""
        if self.tokenizer is None:
            raise ValueError("this runner has no tokenizer: pass token ids instead of text")
        if chat:
            messages = [{"role": "system", "content": system}] if system is not None else []
            ids = self.tokenizer.apply_chat_template(
                messages + [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            return [int(i) for i in ids]
        return [int(i) for i in self.tokenizer(prompt)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer is not None else ""

    def stats_due(self) -> bool:
        return bool(self.bus.enabled) and self._stats_step()

    def _stats_step(self) -> bool:
        """Whether this step is one of every ``stats_every``, listener or not."""
        return bool(self.stats_every and self.bus.step % self.stats_every == 0)

    # ---- one step ----
    @torch.inference_mode()
    def forward(self, rows: Sequence[tuple[SeqId, Sequence[int]]], *, all_logits: bool = False,
                tail_logits: Sequence[int] | None = None) -> torch.Tensor:
        """Compute one step: every row's new tokens go through all layers and into the cache.

        Each row's sequence must have been added to the cache; its new tokens start at
        the sequence's current length. Returns the fp32 logits of each row's last token (B, V),
        or with ``all_logits`` of every new token, rows one after another (N, V) (perplexity),
        or with ``tail_logits`` of each row's last ``tail_logits[i]`` tokens, rows one after another
        (speculative decoding verifies a row's draft tokens with them).
        """
        if not rows:
            raise ValueError("forward needs at least one row")
        self.weights_watch.check()
        cache, bus = self.cache, self.bus
        seqs = [seq for seq, _ in rows]
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"a sequence appears twice in one step: {seqs}")
        n = [len(toks) for _, toks in rows]
        if min(n) < 1:
            raise ValueError(f"every row needs at least one token, got {n}")
        if tail_logits is not None and (len(tail_logits) != len(n) or any(not 1 <= m <= k for m, k in zip(tail_logits, n))):
            raise ValueError(f"tail_logits={list(tail_logits)}: one count per row, each in [1, its tokens {n}]")
        self.threads.before_step()
        positions = [cache.seq_len(seq) for seq in seqs]
        reserved = [cache.reserve(seq, k) for seq, k in zip(seqs, n)]
        slots = torch.cat(reserved) if len(reserved) > 1 else reserved[0]
        plan = cache.plan_reads(seqs, n)  # where every block is read from; all resident unless long context streams
        streaming = plan.streaming
        # What attention will see: committed plus the new tokens, less any blocks evicted when every tier was full.
        kv_lens = [cache.num_tokens(seq) for seq in seqs]
        if bus.enabled:
            bus.emit(Batch, rows=list(seqs), positions=positions, n=n,
                     shape=[len(seqs), self.num_kv_heads, max(kv_lens), self.head_dim])

        dev = self.device
        ids = torch.tensor([t for _, toks in rows for t in toks], dtype=torch.long, device=dev)
        pos = torch.tensor([p + i for p, k in zip(positions, n) for i in range(k)], dtype=torch.long, device=dev)
        groups = self._groups(plan, n, kv_lens) if not streaming else []
        stats = self.stats_due()
        # The hybrid policy and mixed resolution rank blocks by the attention they get, listener or not.
        observe = self._observe and self._stats_step()
        starts = [sum(n[:i]) for i in range(len(n))]
        step = Step(seqs, cache, plan, want_mass=observe, want_scores=stats)
        for feature in self._features:
            feature.begin_step(step)

        x = self._base.embed_tokens(ids)  # (N, hidden)
        cos, sin = self._rope_table(x, pos, max(p + k for p, k in zip(positions, n)))  # (N, D) each
        # Per group, the newest queries' scores of every layer: statistics are taken once, after the last layer.
        scores: list[LayerScores] = [[] for _ in groups]
        compiled = self._decode_step(plan, groups, kv_lens, slots, observe, stats)
        verify = None
        if compiled is not None:  # every layer in one compiled call; what store does besides copying, booked after
            # a sampled read's block is verified by attention as it reads it, not by another pass afterwards
            verify = cache.sample_reads(seqs)
            scores[0] = compiled.run(x, cos, sin, plan.layer_kv, verify) or []
            if compiled.units is not None:
                cache.stored(slots, compiled.units, compiled.shares)
        else:
            x = self._layers_by_torch(x, cos, sin, slots, seqs, plan, groups, starts,
                                      scores if stats or observe else None)
        if compiled is not None and compiled.normed:  # x normalised already, one decode row each: all last tokens
            logits = self._lm_head.floats(x)  # (N, V)
        elif all_logits:
            logits = self._lm_head.floats(self._final_norm(x))  # (N, V)
        else:
            tails = tail_logits if tail_logits is not None else [1] * len(n)
            ends = [sum(n[: i + 1]) for i in range(len(n))]
            last = torch.tensor([e - m + j for e, m in zip(ends, tails) for j in range(m)], device=dev)
            logits = self._lm_head.floats(self._final_norm(x[last]))  # (sum of tails, V)

        if observe and streaming:
            for seq, mass in self._streamer.step.mass.items():
                cache.observe_attention(seq, None, mass)
        if observe:  # before commit and importance eviction change the block tables
            for g, per_layer in zip(groups, scores):
                if _every_layer(per_layer, self.num_layers):
                    self._observe_attention(plan, seqs, per_layer.scores if isinstance(per_layer, Newest)
                                            else torch.stack([n.scores for n in per_layer]), g)
        booked = bus.enabled and not streaming  # a streamed step's reads are booked by the streaming feature
        for i, ((seq, toks), k) in enumerate(zip(rows, n)):
            read = self._sparse.read_ids(seq, plan.block_ids(i)) if self._sparse is not None and booked else None
            cache.commit(seq, k, tokens=toks)
            if booked:  # block-sparse attention lists only the blocks it read
                cache.emit_read(seq, read, checked=compiled.verified(i) if verify is not None else None)
        for feature in self._features:
            feature.after_commit(step)
        if stats:
            self._emit_stats(seqs, groups, scores, compiled.stats if compiled is not None else None)
            if streaming:  # each row's statistics from the scores of the parts its keys were streamed in
                for seq, per_layer in self._streamer.step.scores.items():
                    self._emit_attn([seq], layer_stats([Newest(s[None]) for s in per_layer], None,
                                                       sink_tokens=self.block_size, per_head=self.per_head))
        return logits

    def _layers_by_torch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                         seqs: list[SeqId], plan: ReadPlan, groups: list[_Group], starts: list[int],
                         scores: list[LayerScores] | None) -> torch.Tensor:
        """Every layer of a step by torch ops and the model's own modules (any step, any feature); appends each
        group's newest-query scores of every layer to ``scores`` when given."""
        cache, streaming = self.cache, plan.streaming
        N, H, H_kv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        for li, (layer, w, (norm1, norm2)) in enumerate(zip(self._layers, self._weights, self._norms)):
            a = layer.self_attn
            qkv = w.qkv(norm1(x))  # (N, (H + 2 H_kv) * D): q, k, v side by side
            v = qkv[:, (H + H_kv) * D:].view(N, H_kv, D)
            if hasattr(a, "q_norm"):  # Qwen3-style per-head norms before RoPE
                q, k = qkv[:, : H * D].view(N, H, D), qkv[:, H * D : (H + H_kv) * D].view(N, H_kv, D)
                q, k = self._apply_rope(a.q_norm(q), a.k_norm(k), cos, sin, unsqueeze_dim=1)
            else:  # q and k heads are adjacent: one rotation for both, half the elementwise calls
                qk = rope(qkv[:, : (H + H_kv) * D].view(N, H + H_kv, D), cos[:, None], sin[:, None])
                q, k = qk[:, :H], qk[:, H:]  # (N, H, D), (N, H_kv, D)
            cache.store(li, slots, k, v)
            for feature in self._features:
                feature.after_store(li, seqs)
            if streaming:
                out = self._streamer.attend(li, q, starts, a.scaling)
            else:
                out = self._attend_groups(li, q, seqs, plan, groups, a.scaling, scores, cache.score_hook(li))
            x = x + w.o(out)
            gate, up = w.gate_up(norm2(x)).chunk(2, dim=-1)  # (N, I) each
            x = x + w.down(layer.mlp.act_fn(gate) * up)
        return x

    def _decode_step(self, plan: ReadPlan, groups: list[_Group], kv_lens: list[int], slots: torch.Tensor,
                     keep_scores: bool, stats: bool) -> DecodeStep | None:
        """The compiled layers' buffers for a step of decode rows only, over K/V the cache holds as the
        model's dtype and lets them store, with nothing that changes attention (no step feature, nor the
        attention-nan fault's hook); None: the torch path.
        ``keep_scores``: every layer's newest-query scores (the hybrid policy's); ``stats``: the statistics."""
        if (self._decode is None or len(groups) != 1 or groups[0].q_len != 1 or groups[0].blocks.kv_rows is None
                or any(feature.changes_attention for feature in self._features)
                or plan.layer_kv[0].dtype != self._decode.dtype
                or any(self.cache.score_hook(li) is not None for li in range(self.num_layers))):
            return None
        rows = self.cache.store_rows(slots)
        if rows is None:
            return None
        g = groups[0]
        return self._decode.step(kv_lens, g.blocks.kv_rows, g.blocks.slots.shape[1], self.block_size, rows, keep_scores,
                                 self.block_size if stats else None, self.per_head, self.cache.digest_weights())

    def _groups(self, plan: ReadPlan, n: list[int], kv_lens: list[int]) -> list[_Group]:
        """Decode rows (one token) share one padded attention call; a multi-token row gets its own."""
        dev = self.device
        if all(k == 1 for k in n):
            return [self._group(plan, list(range(len(n))), slice(0, len(n)), 1, kv_lens)]
        groups = []
        starts = [sum(n[:i]) for i in range(len(n))]
        decode = [i for i, k in enumerate(n) if k == 1]
        if decode:
            tokens = torch.tensor([starts[i] for i in decode], device=dev)
            groups.append(self._group(plan, decode, tokens, 1, kv_lens))
        for i, k in enumerate(n):
            if k > 1:
                groups.append(self._group(plan, [i], slice(starts[i], starts[i] + k), k, kv_lens))
        return groups

    def _group(self, plan: ReadPlan, rows: list[int], tokens: slice | torch.Tensor, q_len: int,
               kv_lens: list[int]) -> _Group:
        lens = [kv_lens[i] for i in rows]
        blocks = plan.table(rows)
        window = None
        if self._window is not None:
            window = AttnLayout.build([q_len] * len(rows), lens, sink_tokens=self.block_size, device=self.device,
                                      window=self._window.window)
        bias = plan.key_bias(rows, blocks.slots.shape[1])
        return _Group(rows, tokens, q_len, lens, self.block_size, blocks, max(lens), window,
                      bias[..., : max(lens)] if bias is not None else None)

    def _layout(self, g: _Group, layer: int) -> AttnLayout:
        windowed = self._window is not None and self._window.windows[layer] is not None
        return g.window_layout if windowed else g.layout

    def _keep(self, g: _Group) -> torch.Tensor | None:
        """The keys each row's newest query saw, (B, T), or per layer (L, B, T) when only some layers are windowed."""
        if self._window is None:
            return g.layout.keep
        if self._window.evicts:
            return g.window_layout.keep
        B, T = g.blocks.slots.shape[0], g.kv_len
        full = torch.ones(B, T, dtype=torch.bool, device=self.device)
        return torch.stack([full if (k := self._layout(g, li).keep) is None else k for li in range(self.num_layers)])

    def _attend_groups(self, layer: int, q: torch.Tensor, seqs: list[SeqId], plan: ReadPlan, groups: list[_Group],
                       scale: float, scores: list[LayerScores] | None, corrupt: Any) -> torch.Tensor:
        """Attention output of every token (N, H*D); appends each group's newest-query scores to ``scores``."""
        N, H, D = q.shape
        out = q.new_empty(N, H * D) if len(groups) > 1 else None
        for gi, g in enumerate(groups):
            B = g.blocks.slots.shape[0]
            qg = q[g.tokens].view(B, g.q_len, H, D).transpose(1, 2)  # (B, H, S, D)
            if self._sparse is not None:
                o, st = self._attend_sparse(layer, qg, [seqs[i] for i in g.rows], plan, g, scale)
            else:
                k, v = plan.gather(layer, g.blocks, g.kv_len, self._attn_dtype)  # (B, H_kv, T, D) each
                o, st = attend(qg.to(self._attn_dtype), k, v, self._layout(g, layer), scale=scale,
                               scores=scores is not None, corrupt=corrupt,
                               key_bias=g.key_bias[layer] if g.key_bias is not None else None)
            o = o.transpose(1, 2).reshape(B * g.q_len, H * D).to(q.dtype)  # (tokens, H*D)
            if out is None:
                out = o
            else:
                out[g.tokens] = o
            if st is not None and scores is not None:
                scores[gi].append(st)
        return out

    def _attend_sparse(self, layer: int, qg: torch.Tensor, rows: list[SeqId], plan: ReadPlan, g: _Group,
                       scale: float) -> tuple[torch.Tensor, Newest | None]:
        """Block-sparse attention (and the attention mass importance eviction accumulates). On a statistics
        step it also returns the newest query's scores over the blocks it read (the rest at the lowest
        finite score: no probability), so ``attn`` events come from what attention really saw."""
        want_mass = self._importance is not None and self._importance.needs_mass
        o, mass, scores = self._sparse.attend(layer, qg, rows, g.blocks.slots, g.layout, g.lens, scale,
                                              want_mass=want_mass, want_scores=self.stats_due(),
                                              key_bias=g.key_bias[layer] if g.key_bias is not None else None)
        if mass is not None:
            for seq, row, m in zip(rows, g.rows, mass):
                self._importance.observe(seq, plan.block_ids(row), m)
        return o, scores

    def _emit_stats(self, seqs: list[SeqId], groups: list[_Group], scores: list[LayerScores],
                    taken: AttnStats | None) -> None:
        """The ``attn_step`` event of each group's rows, from statistics computed once for all its layers, or
        ``taken`` inside the compiled layers' attention (their step's one group)."""
        for g, per_layer in zip(groups, scores):
            st = taken
            if st is None:
                if not _every_layer(per_layer, self.num_layers):
                    continue  # a path without scores (block-sparse attention) has no statistics
                st = layer_stats(per_layer, self._keep(g), sink_tokens=self.block_size, per_head=self.per_head)
            self._emit_attn([seqs[row] for row in g.rows], st)

    def _emit_attn(self, rows: list[SeqId], st: AttnStats) -> None:
        """The ``attn_step`` event of ``rows`` from their statistics (L, B, ...): one event for the step."""
        self.bus.emit(AttnStep, seqs=list(rows), **st.fields())

    def _observe_attention(self, plan: ReadPlan, seqs: list[SeqId], scores: torch.Tensor, g: _Group) -> None:
        """Feed the hybrid eviction policy and mixed resolution each row's attention mass per block: the
        newest query's probabilities summed over heads and over the block's positions, averaged over layers.

        One vectorized pass and one transfer per group, every ``stats_every`` steps."""
        L, B, H, T = scores.shape
        hidden = hidden_keys(self._keep(g))
        if hidden is not None:
            scores = scores.masked_fill(hidden, float("-inf"))
        # nan_to_num: a head broken by non-finite scores (the attention-nan fault) contributes nothing
        probs = torch.softmax(scores.float(), dim=-1).nan_to_num_(0.0)
        per_token = probs.sum(dim=2).mean(dim=0)  # (B, T)
        nb = g.blocks.slots.shape[1]
        per_token = torch.nn.functional.pad(per_token, (0, nb * self.block_size - T))
        mass = per_token.view(B, nb, self.block_size).sum(dim=-1).tolist()  # (B, nb)
        for row, m in zip(g.rows, mass):
            self.cache.observe_attention(seqs[row], None, m[: len(plan.block_ids(row))])

    # ---- whole requests ----
    def generate(self, prompts: Iterable[str | Sequence[int]], *, max_new_tokens: int = 32,
                 sampling: SamplingParams | None = None, chat: bool = False, stop_token_ids: Iterable[int] = (),
                 keep_logits: bool = False, max_batch: int = 8) -> list[Generation]:
        """Run every prompt to completion with continuous batching; results in prompt order
        (``scheduler.generate``, where the batching is: the scheduler drives a runner, not the other way)."""
        from ..serving.scheduler import generate  # the scheduler takes a runner: imported when used, it closes no cycle

        return generate(self, prompts, max_new_tokens=max_new_tokens, sampling=sampling, chat=chat,
                        stop_token_ids=stop_token_ids, keep_logits=keep_logits, max_batch=max_batch)

    @torch.no_grad()
    def update_weights(self, update: Callable[[Any], Any], *, detail: str | None = None) -> None:
        """Change the model's weights in place, ``update(model)`` (copy a trainer's weights in, load a state
        dict): a ``weights`` event, and requests from now on never hit K/V the old weights computed."""
        update(self.model)
        self.weights_watch.changed(detail or f"update_weights({getattr(update, '__qualname__', type(update).__name__)})")

    def close(self) -> None:
        self.threads.restore()
        self.cache.close()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_compatible(sparse: BlockSparse | None, importance: ImportanceEviction | None, window: SlidingWindow | None,
                      merging: TokenMerging | None, streamer: StreamedAttention | None) -> None:
    """The features that cannot run together, refused when the runner is made."""
    if merging is not None and window is not None:
        raise ValueError("token merging is not supported with sliding-window attention (a merged block's "
                         "slots are not its token positions)")
    if window is not None and sparse is not None:
        raise ValueError("block-sparse top-k reads are not supported with sliding-window attention")
    if streamer is not None and (window is not None or importance is not None):
        raise ValueError("long context (staging_blocks) is not supported with sliding-window attention "
                         "or importance eviction")


def _check_supported(model: Any) -> None:
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if kind not in SUPPORTED or layers is None or not hasattr(model, "lm_head"):
        raise UnsupportedModel(
            f"model type {kind!r} is not a Llama-family decoder the runner can drive "
            f"(supported: {', '.join(sorted(SUPPORTED))}); use kvdoctor.engine.model.hf.EngineCache with model.generate instead"
        )
