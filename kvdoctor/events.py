"""The v1 event contract between KV-cache producers and kvdoctor's consumers.

Every class here is a frozen msgspec Struct tagged by ``kind``, so one decoder
validates any line of a trace and the engine pays about a microsecond to encode
an event. The field names and meanings are those of ``docs/trace-format.md``;
change both together. Consumers must tolerate what they do not know: unknown
fields are ignored by the decoder and unknown kinds come back as ``Unknown``.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Iterable, Literal, Union

import msgspec

__all__ = [
    "FORMAT", "VERSION", "PREFIX_CACHE", "TIERS", "Tier", "SeqId", "TierSpec", "Header", "Event", "SeqStart",
    "SeqEnd", "Alloc", "Share", "Release", "Free", "Evict", "Write", "Read", "SwapOut", "SwapIn", "Recode",
    "Rollback", "Batch", "Attn", "AttnStep", "attn_rows", "Usage", "Mem", "StepEnd", "ChecksumError", "IoError",
    "Prefetch", "Stage", "PrefetchUse", "Merge", "TraceEnd", "ObserverError", "Weights", "TransferStart",
    "TransferDone", "TransferFailed", "Adapter", "Truncate", "Padding", "Snapshot", "SnapSeq", "SnapBlock", "Unknown",
    "KNOWN_EVENTS", "KINDS", "encode", "encode_lines", "decode", "from_dict", "to_dict",
]

_NAN = float("nan")

FORMAT = "kvdoctor-trace"
# The owner a prefix cache holds its registered blocks as (``share`` with ``hash``; docs/trace-format.md)
PREFIX_CACHE = "prefix-cache"
VERSION = "1.0"

Tier = Literal["device", "host", "disk"]
TIERS: tuple[str, ...] = ("device", "host", "disk")  # fastest to slowest
SeqId = Union[int, str]


class TierSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    capacity_blocks: int
    codec: str | None = None  # how the tier stores new blocks ("fp16", "int8", "nf4"; "mixed" for a mixed device)
    io: str | None = None  # disk tier: "direct" (O_DIRECT, no page cache) or "buffered" (through the page cache)


class Header(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="header"):
    """Line 1 of every trace: what produced it and the shape of its cache."""

    format: str = FORMAT
    version: str = VERSION
    block_size: int
    num_layers: int
    tiers: list[TierSpec]
    model: str | None = None
    engine: str | None = None
    created: str | None = None
    pid: int | None = None
    calibration: str | None = None  # the INT8 key-scale calibration the cache used: its text and digest
    # Who wrote the trace in a workload of several (v1.x; trace-format.md): the instance (an engine a client talks
    # to: a prefill or decode server, a data-parallel engine), its role, this process's place. Absent: one process.
    instance: str | None = None
    role: str | None = None  # what the instance does with K/V it shares: "prefill", "decode", "both"
    dp_rank: int | None = None
    dp_size: int | None = None
    tp_rank: int | None = None
    tp_size: int | None = None
    pp_rank: int | None = None
    pp_size: int | None = None
    # Start-up facts that ranks and instances exchanging K/V must agree on (or, for layers, split).
    layers: list[int] | None = None  # the model layers whose K/V this rank holds (pipeline parallel: its stage's)
    kernel_block_size: int | None = None  # the attention kernel's block, where it differs from the manager's
    kv_layout: str | None = None  # how a block's bytes are laid out, e.g. "(2, blocks, block_size, heads, dim)"
    # Wall-clock nanoseconds since the Unix epoch at t = 0, so ``t0 + t`` orders events of several traces.
    t0: int | None = None


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", gc=False):
    """Fields every event carries: ``t`` in ns since the trace started, and the engine ``step``."""

    t: int = 0
    step: int = 0


class SeqStart(Event, tag="seq_start"):
    seq: SeqId
    prompt_len: int
    stack: list[str] | None = None  # Python frames that admitted the sequence, when recorded
    # What else computes or keys its K/V (v1.x): the adapter it runs under (name and the engine's id; which load
    # of it the latest ``adapter`` event for that id says) and the cache salt its prefix-cache keys carry
    adapter: str | None = None
    adapter_id: int | str | None = None
    salt: str | None = None
    # the request's other prefix-key parts as the caller gave them (sglang's extra_key, multimodal hashes), tagged
    extra_keys: list[str] | None = None  # apart here, so a check can see parts that coincide untagged


class SeqEnd(Event, tag="seq_end"):
    seq: SeqId
    reason: str = "finished"  # "finished" or "aborted"
    # v1.x, why the engine failed an aborted sequence: the typed error's name ("StorageError": a slower tier lost
    error: str | None = None  # or could not take its blocks); absent when a caller aborted it
    stack: list[str] | None = None  # Python frames that ended or aborted the sequence, when recorded


class Alloc(Event, tag="alloc"):
    block: int
    tier: Tier
    seq: SeqId
    stack: list[str] | None = None  # Python frames that asked for the block, when recorded
    codec: str | None = None  # how the block's bytes are stored ("fp16", "int8", "nf4" ...), when the producer says


class Share(Event, tag="share"):
    block: int
    seq: SeqId
    hash: str | None = None  # prefix-cache key of the block's content: registered by its first holder, checked at hits


class Release(Event, tag="release"):
    block: int
    seq: SeqId


class Free(Event, tag="free"):
    block: int


class Evict(Event, tag="evict"):
    block: int
    tier: Tier
    reason: str


class Write(Event, tag="write"):
    block: int
    seq: SeqId
    pos: int
    n: int
    version: int
    digest: int | None = None  # of the block's content after this write (integrity; docs/trace-format.md)
    nonfinite: list[int] | None = None  # v1.x: positions of this write whose K or V is NaN/Inf at some layer,
    nonfinite_layer: int | None = None  # the first such layer,
    stack: list[str] | None = None  # and the Python frames that wrote them (on such a write only)


class Read(Event, tag="read"):
    seq: SeqId
    blocks: list[int]
    versions: list[int]
    layer: int | None = None
    # integrity: per block, the digest recomputed over the bytes that were read (null: not verified this time),
    # and, where it differs from the producer's record, the first layer whose bytes differ
    digests: list[int | None] | None = None
    digest_layers: list[int | None] | None = None
    # long context (v1.x): per block, the tier its copy was read from ("device", or the slower tier a staged copy came from)
    tiers: list[Tier] | None = None
    # v1.x: the token positions [start, end) the read attends to, where the producer knows them: every one must
    # have been written into one of ``blocks`` since it was allocated (a slot never written holds garbage or NaN)
    span: list[int] | None = None


class SwapOut(Event, tag="swap_out"):
    block: int
    src: Tier
    dst: Tier
    version: int
    codec: str | None = None  # the codec of the copy that landed: a lossier one than before means re-encoded
    digest: int | None = None  # recomputed over the bytes that left, before the copy (integrity)
    digest_layer: int | None = None  # where ``digest`` differs from the producer's record: the first layer that does
    new_digest: int | None = None  # of the re-encoded copy that landed, when the codec changed


class SwapIn(Event, tag="swap_in"):
    block: int
    src: Tier
    dst: Tier
    version: int
    codec: str | None = None  # the codec of the copy that landed (moving up never re-encodes)
    digest: int | None = None  # recomputed over the copy that arrived (integrity)
    digest_layer: int | None = None  # where ``digest`` differs from the producer's record: the first layer that does


class Recode(Event, tag="recode"):
    """A block re-encoded in place, in its tier, to a lossier codec (mixed resolution demotes the blocks
    attention finds unimportant). Its tokens and its version are unchanged; only their precision drops."""

    block: int
    tier: Tier
    src_codec: str
    dst_codec: str
    version: int
    digest: int | None = None  # recomputed over the bytes before the re-encode (integrity)
    digest_layer: int | None = None  # where ``digest`` differs from the producer's record: the first layer that does
    new_digest: int | None = None  # of the re-encoded bytes (what later reads must match)


class Rollback(Event, tag="rollback"):
    seq: SeqId
    n: int
    version: int


class Batch(Event, tag="batch"):
    rows: list[SeqId]
    positions: list[int]
    n: list[int]
    shape: list[int] | None = None


class Attn(Event, tag="attn"):
    # JSON has no NaN or infinity: the encoder writes them as null. The statistics are typed float,
    # so the usual finite event decodes without running any Python; a null fails that validation
    # and the reader's slow path (``from_dict``) gives it back as NaN, so consumers always see floats.
    seq: SeqId
    layer: int
    max_logit: float
    entropy: float
    sink: float
    nonfinite: int
    heads_entropy: list[float] | None = None
    heads_max_logit: list[float] | None = None


class AttnStep(Event, tag="attn_step"):
    """The ``attn`` statistics of one step's rows ``seqs`` at every layer, in one event: ``max_logit[l][i]``
    (and each other statistic's) is row ``seqs[i]``'s at layer ``l``, layers 0 … L-1. It stands for the
    ``attn`` events ``rows()`` gives (layer by layer, rows in order): a producer's compact form, one object
    and one trace line a step where ``attn`` takes one per row and layer (240 at batch 8 on SmolLM2).
    Non-finite statistics are null in JSON, as in ``attn``."""

    seqs: list[SeqId]
    max_logit: list[list[float]]
    entropy: list[list[float]]
    sink: list[list[float]]
    nonfinite: list[list[int]]
    heads_entropy: list[list[list[float]]] | None = None
    heads_max_logit: list[list[list[float]]] | None = None

    def __post_init__(self) -> None:
        B, L = len(self.seqs), len(self.max_logit)
        grids = (self.max_logit, self.entropy, self.sink, self.nonfinite)
        # the rows' lengths in one pass of C loops: built every listened step, after its weights flushed the caches
        if any(len(g) != L for g in grids) or not set(map(len, chain.from_iterable(grids))) <= {B}:
            raise ValueError(f"attn_step: every statistic must be {L} layers of {B} rows, one per seq")
        for heads in (self.heads_entropy, self.heads_max_logit):
            if heads is not None and (len(heads) != L or any(len(row) != B for row in heads)):
                raise ValueError(f"attn_step: per-head statistics must be {L} layers of {B} rows")

    def rows(self) -> list[Attn]:
        """The ``attn`` events this one stands for."""
        t, step, seqs, he, hm = self.t, self.step, self.seqs, self.heads_entropy, self.heads_max_logit
        return [Attn(t=t, step=step, seq=seq, layer=layer, max_logit=ml[i], entropy=en[i], sink=sk[i], nonfinite=nf[i],
                     heads_entropy=he[layer][i] if he is not None else None,
                     heads_max_logit=hm[layer][i] if hm is not None else None)
                for layer, (ml, en, sk, nf) in enumerate(zip(self.max_logit, self.entropy, self.sink, self.nonfinite))
                for i, seq in enumerate(seqs)]


def attn_rows(events: Iterable[Any]) -> list[Attn]:
    """The ``attn`` events among ``events``, each ``attn_step`` as the ``attn`` events it stands for."""
    return [row for e in events if isinstance(e, (Attn, AttnStep)) for row in (e.rows() if isinstance(e, AttnStep) else (e,))]


class Usage(Event, tag="usage"):
    tier: Tier
    used_blocks: int
    capacity_blocks: int
    bytes: int | None = None


class Mem(Event, tag="mem"):
    rss: int | None = None
    py_heap: int | None = None
    torch_cpu: int | None = None
    gpu_used: int | None = None
    gpu_reserved: int | None = None
    kv_bytes: int | None = None
    unaccounted: int | None = None
    source: str | None = None  # which probe took the reading


# ---- kvdoctor's own kinds (v1 allows producers to add kinds) ----


class StepEnd(Event, tag="step_end"):
    """Closes a step, so consumers can judge end-of-step rules without waiting for the next step."""

    num_tokens: int = 0
    duration_ns: int = 0
    # a prefix cache's lookups this step, in full blocks of prompts: served from the cache, and computed
    prefix_hits: int | None = None
    prefix_misses: int | None = None


class ChecksumError(Event, tag="checksum_error"):
    """A copy read back from a slower tier did not match the checksum taken when it left."""

    block: int
    tier: Tier
    expected: int
    actual: int


class IoError(Event, tag="io_error"):
    """A tier's storage let the engine down: it could not grow, read or write (disk full, a spill file cut
    short or removed). ``blocks``: those whose bytes were lost (their sequences are failed and release them);
    empty when nothing was lost and only a move failed, which the engine works around."""

    tier: Tier
    op: str
    message: str
    errno: int | None = None
    path: str | None = None
    blocks: list[int] = msgspec.field(default_factory=list)


class Prefetch(Event, tag="prefetch"):
    """Blocks the engine predicted would be read next and started bringing up."""

    blocks: list[int]
    src: Tier
    dst: Tier


class Stage(Event, tag="stage"):
    """Long context: copies of ``seq``'s blocks brought from a slower tier into the device staging area this step
    for attention to read in place of a resident copy; ``versions[i]`` is the version of the copy staged, ``bytes``
    what the step moved (every layer's rows)."""

    seq: SeqId
    blocks: list[int]
    srcs: list[Tier]
    versions: list[int]
    bytes: int = 0


class PrefetchUse(Event, tag="prefetch_use"):
    """Long context: of the blocks ``seq``'s attention read this step that the engine predicted (prefetched
    to the device), ``hits`` had arrived; ``misses`` were read from a slower tier through staging."""

    seq: SeqId
    hits: list[int]
    misses: list[int]


class Merge(Event, tag="merge"):
    """Token merging (v1.x): in place in ``tier``, adjacent tokens of a full, old block whose keys were nearly the
    same were merged into one slot each, with a count. The block keeps its positions and its version; in each
    layer of ``layers``, its ``tokens`` x ``heads`` (layer, KV head) slots shrank to ``slots[i]`` live ones."""

    block: int
    tier: Tier
    version: int
    tokens: int  # token positions the block holds (its block size): the live slots per KV head before
    heads: int  # KV heads per layer
    layers: list[int]  # the layers in which some KV head shrank
    slots: list[int]  # per layer of ``layers``: live slots summed over its KV heads (was tokens * heads)
    digest: int | None = None  # recomputed over the bytes before the merge (integrity)
    digest_layer: int | None = None  # where ``digest`` differs from the producer's record: the first layer that does
    new_digest: int | None = None  # of the merged bytes (what later reads must match)


class TraceEnd(Event, tag="trace_end"):
    """The writer closed the trace on purpose; a follower stops here."""

    reason: str = "closed"


class ObserverError(Event, tag="observer_error"):
    """A producer inside an engine kvdoctor did not write (vLLM, transformers) failed in its own bookkeeping
    (v1.x). It let the host go on as called and, with ``stopped``, wrote nothing more: what the trace shows
    after this point is incomplete, so consumers do not judge it."""

    producer: str  # "vllm", "transformers"
    part: str  # what was being traced: the host's method ("BlockPool.touch") or "start-up"
    error: str  # the exception's type name
    message: str
    where: str | None = None  # kvdoctor's own file:line where it failed
    stopped: bool = True


class Weights(Event, tag="weights"):
    """What computes K/V changed under a live cache (v1.x): K/V written before this event were computed by
    other weights than K/V written after it, so a prefix-cache hit across it serves stale K/V unless the
    cache was reset in between. ``version`` counts the changes of this trace (0 before the first)."""

    version: int
    cause: str  # "update" (weights changed in place), "load" (loaded anew), "wake" (back from sleep)
    detail: str | None = None  # what the producer saw do it: "collective_rpc('apply_model')", "load_weights"
    digest: str | None = None  # a digest of a sample of the weights after the change


class TransferStart(Event, tag="transfer_start"):
    """Asynchronous work on blocks began (v1.x): ``op`` ``save`` reads them out (an offload, a KV connector sending
    a finished request's K/V), a ``load`` writes them in (a connector bringing K/V from outside). Until its
    ``transfer_done`` or ``transfer_failed`` the blocks must not be freed, reused or (saved) written, and
    (loaded) not read."""

    transfer: str  # unique in the trace
    op: str  # "save" or "load"
    blocks: list[int]
    seq: SeqId | None = None
    src: str | None = None  # where the bytes come from: a tier, an instance, a connector's store
    dst: str | None = None
    lease_steps: int | None = None  # steps after which the producer would call it lost
    # Across instances (v1.x): ``key`` names the K/V in the store or on the wire, the same on both sides
    # (a connector's file key, a request's transfer id), so the save of one trace pairs with the loads of
    # others. ``num_tokens`` the tokens the blocks hold, ``layers`` those moved, ``bytes`` their size, and
    # ``digests`` per block of ``blocks`` the content as this side saw it (null: not computed).
    key: str | None = None
    num_tokens: int | None = None
    layers: list[int] | None = None
    bytes: int | None = None
    digests: list[int | None] | None = None


class TransferDone(Event, tag="transfer_done"):
    transfer: str
    # per block of the start's ``blocks``: the content once the bytes landed (a load's digests are known
    # only now); null where not computed
    digests: list[int | None] | None = None


class TransferFailed(Event, tag="transfer_failed"):
    """The transfer ended without its bytes: a load's blocks hold nothing valid until written again."""

    transfer: str
    reason: str | None = None


class Adapter(Event, tag="adapter"):
    """An adapter (a LoRA) that computes K/V for the requests naming it changed (v1.x): ``load``ed, ``reload``ed
    under the same id with other contents, or ``unload``ed. ``load`` counts the distinct contents this id has held
    (1 at its first load), so (``name``, ``adapter_id``, ``load``) is the identity of the K/V a request computes
    under it: a prefix-cache hit across identities serves another adapter's K/V."""

    op: str  # "load", "reload", "unload"
    name: str
    adapter_id: int | str
    load: int
    path: str | None = None  # where its weights came from
    detail: str | None = None  # what the producer saw do it: "add_lora", "request r3 scheduled (load_inplace)"
    digest: str | None = None  # a fingerprint of its contents


class Truncate(Event, tag="truncate"):
    """A cache was cut (v1.x): ``op`` ``crop`` dropped slots from the end of every row, ``reset`` emptied it.
    ``keep`` is how many slots per row the call asked to leave, ``length`` how many the cache reports after it
    at ``layer``: when they differ the next pass appends to stale slots and attends to them."""

    op: str  # "crop", "reset"
    keep: int
    length: int
    layer: int | None = None
    cache: str | None = None  # the producer's name for the cache, when it watches several
    asked: str | None = None  # the call as made: "crop(-5)", "reset()"


class SnapSeq(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One live sequence in a ``snapshot``: what its ``seq_start`` and its writes so far would have set."""

    seq: SeqId
    prompt_len: int
    length: int  # tokens cached
    version: int
    adapter: str | None = None


class SnapBlock(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One allocated block in a ``snapshot``: where it sits, who owns it, and the tokens its last write left."""

    block: int
    tier: Tier
    owners: list[SeqId]
    seq: SeqId  # whose positions it holds
    pos: int
    n: int  # positions pos … pos+n-1 written
    version: int  # of the last write into the copy it has
    codec: str | None = None
    hash: str | None = None  # prefix-cache key, where the cache registered it


class Padding(Event, tag="padding"):
    """A pass wrote K/V into padding slots of ``seq``'s batch row (v1.x): slots a padded batch fills for a row
    that has no token there (left padding, a shorter prompt), which attention masks out. ``nonfinite`` counts
    the non-finite values written there at ``layer``, the first layer with any (0: none at any layer): masked
    or not, a NaN there turns the row's attention output NaN (0 x NaN in the weighted sum of V)."""

    seq: SeqId
    slots: list[int]  # the row's padding slots this pass wrote (indices into the cache's row)
    nonfinite: int = 0
    layer: int | None = None
    cache: str | None = None  # the producer's name for the cache, when it watches several


class Snapshot(Event, tag="snapshot"):
    """The live state of a cache when its trace starts mid-run (v1.x; ``kvdoctor watch|check --pid`` attached to a
    running process at a step's end): its sequences and allocated blocks, as the events it did not trace would
    have left them. Consumers start from it, so the history they missed is not read as leaks, unknown
    sequences or unwritten reads."""

    seqs: list[SnapSeq]
    blocks: list[SnapBlock]
    reason: str = "attach"


class Unknown(msgspec.Struct, frozen=True, kw_only=True):
    """A kind this version does not know, kept whole so nothing a producer wrote is lost."""

    kind: str
    t: int = 0
    step: int = 0
    fields: dict[str, Any] = msgspec.field(default_factory=dict)


KNOWN_EVENTS: tuple[type[Event], ...] = (
    SeqStart, SeqEnd, Alloc, Share, Release, Free, Evict, Write, Read, SwapOut, SwapIn, Recode,
    Rollback, Batch, Attn, AttnStep, Usage, Mem, StepEnd, ChecksumError, IoError, Prefetch, Stage, PrefetchUse, Merge,
    TraceEnd, ObserverError, Weights, TransferStart, TransferDone, TransferFailed, Adapter, Truncate,
    Padding, Snapshot,
)
KINDS: dict[str, type[Event]] = {cls.__struct_config__.tag: cls for cls in KNOWN_EVENTS}

AnyEvent = Union[KNOWN_EVENTS]  # type: ignore[valid-type]

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyEvent)
_loose = msgspec.json.Decoder(dict[str, Any])


def encode(event: Event | Header) -> bytes:
    """One event as compact JSON, without the newline."""
    if isinstance(event, Unknown):
        return _encoder.encode({"kind": event.kind, "t": event.t, "step": event.step, **event.fields})
    return _encoder.encode(event)


def encode_lines(events: list[Event]) -> bytes:
    """Events as JSON Lines, each terminated by a newline (the fast path of the trace writer)."""
    if any(type(e) is Unknown for e in events):
        return b"".join(encode(e) + b"\n" for e in events)
    return _encoder.encode_lines(events)


def decode(line: bytes | str) -> Event | Unknown:
    """Decode one line; a kind this version lacks comes back as ``Unknown``.

    Raises ``msgspec.DecodeError`` (or its subclass ``ValidationError``) for a line that
    is not JSON, or that names a known kind with fields of the wrong type.
    """
    try:
        return _decoder.decode(line)
    except msgspec.ValidationError:
        return from_dict(_loose.decode(line))


def from_dict(raw: dict[str, Any]) -> Event | Unknown:
    """An event from the plain map of its line or frame: the slow path, for what the typed decoders reject.

    That is an unknown kind (kept as ``Unknown``) or an attn event with null statistics (NaN again);
    a known kind with fields of the wrong type raises ``msgspec.ValidationError``.
    """
    kind = raw.get("kind")
    if not isinstance(kind, str) or kind == "header":
        raise msgspec.ValidationError("an event needs a string `kind` other than header")
    if kind in KINDS:
        if kind in ("attn", "attn_step"):
            raw = _nan_for_null(raw)
        return msgspec.convert(raw, KINDS[kind])
    t, step = raw.get("t", 0), raw.get("step", 0)
    if not (isinstance(t, int) and isinstance(step, int)):
        raise msgspec.ValidationError("`t` and `step` must be integers")
    fields = {k: v for k, v in raw.items() if k not in ("kind", "t", "step")}
    return Unknown(kind=kind, t=t, step=step, fields=fields)


def _nan_for_null(raw: dict[str, Any]) -> dict[str, Any]:
    """``attn``'s statistics (numbers, per-head lists) and ``attn_step``'s (grids of them) with NaN for null;
    absent per-head statistics stay None."""
    fixed = dict(raw)
    for name in ("max_logit", "entropy", "sink", "heads_entropy", "heads_max_logit"):
        value = fixed.get(name)
        if isinstance(value, list):
            fixed[name] = _nan(value)
        elif value is None and name in fixed and not name.startswith("heads_"):
            fixed[name] = _NAN
    return fixed


def _nan(values: list[Any]) -> list[Any]:
    return [_NAN if v is None else _nan(v) if isinstance(v, list) else v for v in values]


def decode_lines(buf: bytes) -> list[Event]:
    """Decode a chunk of complete JSON lines in one call; raises on the first bad line."""
    return _decoder.decode_lines(buf)


def to_dict(event: Event | Header | Unknown) -> dict[str, Any]:
    """The event as the plain dict its JSON line holds (reports and the TUI's detail pane)."""
    return _loose.decode(encode(event))
