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

import sys
from typing import Any, Callable, Iterable, Sequence, TypeVar

import torch

from ...events import AttnStep, Batch, SeqId
from ..bus import Bus
from ..config import EngineConfig
from ..features.protocol import Group, Step, StepFeature, implementing
from ..features.registry import step_features
from ..kv.cache import PagedKVCache
from ..kv.prefix import model_salt
from ..kv.readplan import ReadPlan
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


F = TypeVar("F", bound=StepFeature)
# The features that change attention on a step, by the attention hook they define (``engine.features.protocol``).
_Hooks = dict[str, list[StepFeature]]
_HOOKS = ("attend_step", "attend", "layout", "read_ids")

# A group's newest-query scores: one ``Newest`` per layer (the torch path appends them layer by layer), or
# one of every layer's at once (the compiled decode layers' buffer).
LayerScores = list[Newest] | Newest


def _first(features: Sequence[StepFeature], hook: str, *args: Any) -> Any:
    """The first answer to ``hook(*args)`` among ``features`` that is not None: the feature that takes over."""
    for feature in features:
        answer = getattr(feature, hook)(*args)
        if answer is not None:
            return answer
    return None


def _every_layer(scores: LayerScores, num_layers: int) -> bool:
    """Whether ``scores`` cover every layer (a path without scores, block-sparse attention, leaves none)."""
    return isinstance(scores, Newest) or len(scores) == num_layers


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
        # The step features the cache's config and the model ask for (engine.features.registry), called in this
        # order at every point of a step (engine.features.protocol); attention asks a hook only of the features
        # that define it, on steps where they change attention.
        self._features: list[StepFeature] = step_features(cache, cfg)
        self._block_mass = any(f.wants_block_mass for f in self._features)  # H2O ranks blocks by attention mass
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

    def feature(self, kind: type[F]) -> F | None:
        """The active step feature of type ``kind`` (what it read, merged or evicted so far); None when off."""
        return next((f for f in self._features if isinstance(f, kind)), None)

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
        groups = self._groups(plan, seqs, n, kv_lens) if not streaming else []
        stats = self.stats_due()
        # The hybrid policy and mixed resolution rank blocks by the attention they get, listener or not.
        observe = self._observe and self._stats_step()
        starts = [sum(n[:i]) for i in range(len(n))]
        step = Step(seqs, cache, plan, want_mass=observe, want_scores=stats, starts=starts,
                    block_mass=[] if self._block_mass else None)
        for feature in self._features:
            feature.begin_step(step)
        # the features that change attention this step: the compiled layers run only without any, and attention
        # asks only these for its hooks
        changing = [f for f in self._features if f.changes_attention]
        hooks = {hook: implementing(changing, hook) for hook in _HOOKS} if changing else None

        x = self._base.embed_tokens(ids)  # (N, hidden)
        cos, sin = self._rope_table(x, pos, max(p + k for p, k in zip(positions, n)))  # (N, D) each
        # Per group, the newest queries' scores of every layer: statistics are taken once, after the last layer.
        scores: list[LayerScores] = [[] for _ in groups]
        compiled = self._decode_step(plan, groups, kv_lens, slots, hooks, observe, stats)
        verify = None
        if compiled is not None:  # every layer in one compiled call; what store does besides copying, booked after
            # a sampled read's block is verified by attention as it reads it, not by another pass afterwards
            verify = cache.sample_reads(seqs)
            scores[0] = compiled.run(x, cos, sin, plan.layer_kv, verify) or []
            if compiled.units is not None:
                cache.stored(slots, compiled.units, compiled.shares)
        else:
            x = self._layers_by_torch(x, cos, sin, slots, seqs, plan, groups, hooks,
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

        if observe:  # before commit and importance eviction change the block tables
            for seq, mass in step.newest_mass.items():  # from a feature that attended for the whole step
                cache.observe_attention(seq, None, mass)
            for g, per_layer in zip(groups, scores):
                if _every_layer(per_layer, self.num_layers):
                    self._observe_attention(plan, seqs, per_layer.scores if isinstance(per_layer, Newest)
                                            else torch.stack([n.scores for n in per_layer]), g, hooks)
        booked = bus.enabled and not streaming  # a streamed step's reads are booked by the feature that streamed them
        readers = hooks["read_ids"] if hooks is not None and booked else ()
        for i, ((seq, toks), k) in enumerate(zip(rows, n)):
            # every block (None), unless a feature read fewer (block-sparse attention lists only those)
            read = _first(readers, "read_ids", seq, plan.block_ids(i)) if readers else None
            cache.commit(seq, k, tokens=toks)
            if booked:
                cache.emit_read(seq, read, checked=compiled.verified(i) if verify is not None else None)
        for feature in self._features:
            feature.after_commit(step)
        if stats:
            self._emit_stats(seqs, groups, scores, compiled.stats if compiled is not None else None, hooks)
            # a feature that attended for the whole step: each row's statistics from the scores it saw
            for seq, per_layer in step.newest_scores.items():
                self._emit_attn([seq], layer_stats([Newest(s[None]) for s in per_layer], None,
                                                   sink_tokens=self.block_size, per_head=self.per_head))
        return logits

    def _layers_by_torch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                         seqs: list[SeqId], plan: ReadPlan, groups: list[Group], hooks: _Hooks | None,
                         scores: list[LayerScores] | None) -> torch.Tensor:
        """Every layer of a step by torch ops and the model's own modules (any step, any feature); appends each
        group's newest-query scores of every layer to ``scores`` when given. ``hooks``: the features that change
        attention this step, by the hook they have (None: none does)."""
        cache = self.cache
        whole = hooks["attend_step"] if hooks is not None else ()
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
            # a feature may attend for every row at once (long context streaming)
            out = _first(whole, "attend_step", li, q, a.scaling) if whole else None
            if out is None:
                out = self._attend_groups(li, q, plan, groups, hooks, a.scaling, scores, cache.score_hook(li))
            x = x + w.o(out)
            gate, up = w.gate_up(norm2(x)).chunk(2, dim=-1)  # (N, I) each
            x = x + w.down(layer.mlp.act_fn(gate) * up)
        return x

    def _decode_step(self, plan: ReadPlan, groups: list[Group], kv_lens: list[int], slots: torch.Tensor,
                     hooks: _Hooks | None, keep_scores: bool, stats: bool) -> DecodeStep | None:
        """The compiled layers' buffers for a step of decode rows only, over K/V the cache holds as the
        model's dtype and lets them store, with nothing that changes attention (no step feature: ``hooks`` is
        None, nor the attention-nan fault's hook); None: the torch path.
        ``keep_scores``: every layer's newest-query scores (the hybrid policy's); ``stats``: the statistics."""
        if (hooks is not None or self._decode is None or len(groups) != 1 or groups[0].q_len != 1
                or groups[0].blocks.kv_rows is None or plan.layer_kv[0].dtype != self._decode.dtype
                or any(self.cache.score_hook(li) is not None for li in range(self.num_layers))):
            return None
        rows = self.cache.store_rows(slots)
        if rows is None:
            return None
        g = groups[0]
        return self._decode.step(kv_lens, g.blocks.kv_rows, g.blocks.slots.shape[1], self.block_size, rows, keep_scores,
                                 self.block_size if stats else None, self.per_head, self.cache.digest_weights())

    def _groups(self, plan: ReadPlan, seqs: list[SeqId], n: list[int], kv_lens: list[int]) -> list[Group]:
        """Decode rows (one token) share one padded attention call; a multi-token row gets its own."""
        dev = self.device
        if all(k == 1 for k in n):
            return [self._group(plan, seqs, list(range(len(n))), slice(0, len(n)), 1, kv_lens)]
        groups = []
        starts = [sum(n[:i]) for i in range(len(n))]
        decode = [i for i, k in enumerate(n) if k == 1]
        if decode:
            tokens = torch.tensor([starts[i] for i in decode], device=dev)
            groups.append(self._group(plan, seqs, decode, tokens, 1, kv_lens))
        for i, k in enumerate(n):
            if k > 1:
                groups.append(self._group(plan, seqs, [i], slice(starts[i], starts[i] + k), k, kv_lens))
        return groups

    def _group(self, plan: ReadPlan, seqs: list[SeqId], rows: list[int], tokens: slice | torch.Tensor, q_len: int,
               kv_lens: list[int]) -> Group:
        lens = [kv_lens[i] for i in rows]
        blocks = plan.table(rows)
        bias = plan.key_bias(rows, blocks.slots.shape[1])
        return Group(rows, [seqs[i] for i in rows], tokens, q_len, lens, self.block_size, blocks, max(lens),
                     bias[..., : max(lens)] if bias is not None else None)

    def _layout(self, g: Group, layer: int, hooks: _Hooks | None) -> AttnLayout:
        """The mask ``g`` attends with at ``layer``: a feature's (sliding windows), else the rows' own."""
        layout = _first(hooks["layout"], "layout", layer, g) if hooks is not None else None
        return layout if layout is not None else g.layout

    def _keep(self, g: Group, hooks: _Hooks | None) -> torch.Tensor | None:
        """The keys each row's newest query saw, (B, T), or per layer (L, B, T) when layers differ in their masks."""
        if hooks is None or not hooks["layout"]:
            return g.layout.keep
        layouts = [self._layout(g, li, hooks) for li in range(self.num_layers)]
        if all(layout is layouts[0] for layout in layouts):
            return layouts[0].keep
        full = torch.ones(g.blocks.slots.shape[0], g.kv_len, dtype=torch.bool, device=self.device)
        return torch.stack([full if layout.keep is None else layout.keep for layout in layouts])

    def _attend_groups(self, layer: int, q: torch.Tensor, plan: ReadPlan, groups: list[Group], hooks: _Hooks | None,
                       scale: float, scores: list[LayerScores] | None, corrupt: Any) -> torch.Tensor:
        """Attention output of every token (N, H*D); appends each group's newest-query scores to ``scores``. A
        feature that changes attention may take a group over (block-sparse reads) or give its mask."""
        N, H, D = q.shape
        takers = hooks["attend"] if hooks is not None else ()
        out = q.new_empty(N, H * D) if len(groups) > 1 else None
        for gi, g in enumerate(groups):
            B = g.blocks.slots.shape[0]
            qg = q[g.tokens].view(B, g.q_len, H, D).transpose(1, 2)  # (B, H, S, D)
            taken = _first(takers, "attend", layer, qg, g, scale) if takers else None
            if taken is not None:
                o, st = taken
            else:
                k, v = plan.gather(layer, g.blocks, g.kv_len, self._attn_dtype)  # (B, H_kv, T, D) each
                o, st = attend(qg.to(self._attn_dtype), k, v, self._layout(g, layer, hooks), scale=scale,
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

    def _emit_stats(self, seqs: list[SeqId], groups: list[Group], scores: list[LayerScores],
                    taken: AttnStats | None, hooks: _Hooks | None) -> None:
        """The ``attn_step`` event of each group's rows, from statistics computed once for all its layers, or
        ``taken`` inside the compiled layers' attention (their step's one group)."""
        for g, per_layer in zip(groups, scores):
            st = taken
            if st is None:
                if not _every_layer(per_layer, self.num_layers):
                    continue  # a path without scores (block-sparse attention) has no statistics
                st = layer_stats(per_layer, self._keep(g, hooks), sink_tokens=self.block_size, per_head=self.per_head)
            self._emit_attn([seqs[row] for row in g.rows], st)

    def _emit_attn(self, rows: list[SeqId], st: AttnStats) -> None:
        """The ``attn_step`` event of ``rows`` from their statistics (L, B, ...): one event for the step."""
        self.bus.emit(AttnStep, seqs=list(rows), **st.fields())

    def _observe_attention(self, plan: ReadPlan, seqs: list[SeqId], scores: torch.Tensor, g: Group,
                           hooks: _Hooks | None) -> None:
        """Feed the hybrid eviction policy and mixed resolution each row's attention mass per block: the
        newest query's probabilities summed over heads and over the block's positions, averaged over layers.

        One vectorized pass and one transfer per group, every ``stats_every`` steps."""
        L, B, H, T = scores.shape
        hidden = hidden_keys(self._keep(g, hooks))
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
