"""vLLM v1's scheduler driven without a model, under kvdoctor's tracer.

vLLM's own tests (tests/v1/core) build a ``Scheduler`` on a ``KVCacheConfig`` of a few blocks,
feed it ``Request``s and answer each ``schedule()`` with a synthetic ``ModelRunnerOutput``: no
weights, no worker, no device. This harness does the same with kvdoctor's ``VllmTracer`` attached,
so every scheduler path (chunked prefill, prefix hits, preemption, aborts, speculative tokens, KV
connector loads and delayed frees, structured output, priorities) writes a trace the checks judge.

The model is a ``config.json`` alone (vLLM's ``ModelConfig`` reads nothing else with the tokenizer
skipped); the KV connector and the grammar are stand-ins for the scheduler-side halves that vLLM's
own tests mock too, so a test decides what an external cache holds and when a transfer finishes.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections import deque
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Callable

import torch
from vllm.config import (
    CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

from kvdoctor.checks import make_suite
from kvdoctor.integrations.vllm import VllmTracer
from kvdoctor.trace import TraceReader

__all__ = ["Harness", "HarnessConnector", "AcceptAll", "make_harness"]

VOCAB = 1000
# Two layers of a Llama shape: all vLLM's ModelConfig needs to derive what the scheduler asks of it.
_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2,
           "vocab_size": VOCAB, "max_position_embeddings": 4096, "torch_dtype": "float32"}


# vLLM 0.34 finds each request's output row by its place in ``req_ids``; earlier releases by this map.
_ROW_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}


@cache
def _model_dir() -> str:
    path = Path(tempfile.mkdtemp(prefix="kvdoctor-vllm-model-"))
    (path / "config.json").write_text(json.dumps(_CONFIG))
    return str(path)


@cache
def _block_hasher(block_size: int) -> Callable:
    init_none_hash(sha256)  # vLLM's engine does this once per process before any request is hashed
    return get_request_block_hasher(block_size, sha256)


class HarnessConnector(KVConnectorBase_V1):
    """The scheduler half of a KV connector whose external cache the test describes.

    ``external[request_id]`` is how many prompt tokens the external cache holds for that request
    (loaded asynchronously when the id is in ``load_async``); a request in ``delay_free`` keeps its
    blocks after it finishes, as a connector still sending them would, until the harness reports the
    send finished. vLLM's unit tests mock their connectors the same way (MockKVConnector).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.external: dict[str, int] = {}
        self.load_async: set[str] = set()
        self.delay_free: set[str] = set()
        self.allocated: dict[str, int] = {}  # request -> external tokens it got blocks for

    # -- scheduler side: what the test controls --
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id in self.allocated:  # already loaded (or loading): nothing new outside
            return 0, False
        num = max(0, self.external.get(request.request_id, 0) - num_computed_tokens)
        return num, num > 0 and request.request_id in self.load_async

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens:
            self.allocated[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return request.request_id in self.delay_free, None

    # -- worker side: never called without a worker --
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None: ...

    def wait_for_save(self) -> None: ...


class AcceptAll(StructuredOutputGrammar):
    """A grammar that admits every token: the scheduler's structured-output path without a compiler
    (vLLM's tests mock the grammar side the same way); the bitmask is never filled without a worker."""

    def __init__(self) -> None:
        self.num_accepted = 0

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        self.num_accepted += len(tokens)
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        return tokens

    def rollback(self, num_tokens: int) -> None:
        self.num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None: ...

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        self.num_accepted = 0


@dataclass
class Harness:
    """One traced scheduler and the loop an engine core runs around it, with a synthetic model.

    ``accept(request_id, drafts)`` says how many of a step's draft tokens the "model" accepts
    (all of them unless a test says otherwise); ``drafts`` is how many draft tokens every running
    request proposes after each step when speculative decoding is on. ``depth`` is how many schedules
    are in flight: 1 for the synchronous engine core, 2 with async scheduling (the engine core's batch
    queue schedules step N+1 before step N's output is back).
    """

    scheduler: Scheduler
    tracer: VllmTracer
    path: Path
    block_size: int
    drafts: int = 0
    depth: int = 1
    accept: Callable[[str, list[int]], int] = lambda req_id, drafts: len(drafts)
    sending: set[str] = field(default_factory=set)  # finished requests whose blocks a connector still sends
    recving: set[str] = field(default_factory=set)  # requests whose asynchronous loads finish next step
    outputs: list = field(default_factory=list)
    added: list[Request] = field(default_factory=list)  # every request added, in order (vLLM forgets finished ones)
    num_steps: int = 0
    in_flight: deque = field(default_factory=deque)  # (schedule, its rows that sample a token), oldest first
    closed: bool = False

    @property
    def connector(self) -> Any:
        """The scheduler's KV connector (a ``HarnessConnector`` unless the test named one of vLLM's)."""
        return self.scheduler.connector

    def request(self, request_id: str, prompt: list[int], *, max_tokens: int = 8, priority: int = 0,
                cache_salt: str | None = None, structured: bool = False, add: bool = True,
                images: tuple[tuple[str, int, int], ...] = (), lora: LoRARequest | None = None) -> Request:
        """A request; ``images`` are (identifier, offset, length) of multimodal items over the prompt's
        placeholder tokens: the stand-in encoder counts each one's output as cached (no encoder runs here)."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                structured_outputs=StructuredOutputsParams(json_object=True) if structured else None)
        features = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                          mm_position=PlaceholderRange(offset=offset, length=length))
                    for ident, offset, length in images]
        if features:
            self.scheduler.encoder_cache_manager.check_and_update_cache = lambda request, i: True
        request = Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params,
                          pooling_params=None, priority=priority, cache_salt=cache_salt,
                          mm_features=features or None, lora_request=lora,
                          block_hasher=_block_hasher(self.block_size))
        if structured:  # compiled at once: the scheduler only waits for a grammar, it never builds one
            request.structured_output_request.grammar = AcceptAll()
        if add:
            self.scheduler.add_request(request)
            self.added.append(request)
        return request

    def step(self) -> Any:
        """One engine-core step: schedule (``depth`` ahead), answer the oldest schedule with a synthetic
        model output, update; returns the schedule answered."""
        sched = self.scheduler
        while len(self.in_flight) < self.depth:
            output = sched.schedule()
            if self.in_flight and not output.num_scheduled_tokens:
                break  # the batch queue takes an empty schedule only when nothing else is in flight
            # Which rows finish their prompt is known only now: the next schedule moves the requests on.
            sampling = {r for r in output.num_scheduled_tokens if not sched.requests[r].is_prefill_chunk}
            self.in_flight.append((output, sampling))
        output, sampling = self.in_flight.popleft()
        req_ids = list(output.num_scheduled_tokens)
        sampled = [self._sample(output, r) if r in sampling else [] for r in req_ids]
        kv = None
        if self.sending or self.recving:
            kv = KVConnectorOutput(finished_sending=set(self.sending) or None,
                                   finished_recving=set(self.recving) or None)
            self.sending.clear()
            self.recving.clear()
        rows = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if _ROW_INDEX else {}
        result = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=kv, **rows)
        self.outputs.append(sched.update_from_output(output, result))
        if self.drafts:
            running = [r.request_id for r in sched.running if not r.is_prefill_chunk]
            sched.update_draft_token_ids(DraftTokenIds(running, [self._tokens(r, self.drafts) for r in running]))
        self.num_steps += 1
        return output

    def _sample(self, output: Any, req_id: str) -> list[int]:
        drafts = output.scheduled_spec_decode_tokens.get(req_id, [])
        return self._tokens(req_id, 1 + self.accept(req_id, drafts))

    def _tokens(self, req_id: str, n: int) -> list[int]:
        """Deterministic token ids that depend on the request's length (never an EOS: eos is ignored)."""
        request = self.scheduler.requests.get(req_id)  # gone when aborted while its step was in flight
        start = request.num_tokens if request is not None else 0
        return [(start + i) * 7 % VOCAB for i in range(n)]

    def run(self, *, max_steps: int = 200, until: Callable[[], bool] | None = None) -> int:
        """Step until every request is done (or ``until()`` holds); returns the steps taken."""
        done = until or (lambda: not self.scheduler.has_requests() and not self.in_flight)
        steps = 0
        while not done():
            assert steps < max_steps, f"the scheduler did not finish in {max_steps} steps"
            self.step()
            steps += 1
        return steps

    def abort(self, *request_ids: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def close(self) -> None:
        """Detach the tracer (once): vLLM's own methods back in place, the trace complete."""
        if not self.closed:
            self.closed = True
            self.tracer.detach()

    def findings(self) -> tuple[list, list]:
        """Close the trace, judge it with every check; returns (findings, events)."""
        self.close()
        return judge(self.path)


def judge(path: Path) -> tuple[list, list]:
    """A finished trace judged by every check: (findings, events)."""
    suite = make_suite()
    found = suite.observe_many(TraceReader(path))
    return found + suite.finish(), list(TraceReader(path))


def make_harness(path: Path, *, num_blocks: int = 64, block_size: int = 16, max_num_batched_tokens: int = 256,
                 max_num_seqs: int = 8, max_model_len: int = 1024, prefix_caching: bool = True,
                 policy: str = "fcfs", num_speculative_tokens: int | None = None,
                 connector: bool | str = False, connector_config: dict | None = None,
                 async_scheduling: bool = False, long_prefill_token_threshold: int = 0,
                 sliding_window: int | None = None) -> Harness:
    """A scheduler on ``num_blocks`` blocks (plus vLLM's null block) with kvdoctor tracing it.

    ``connector=True`` attaches the stand-in ``HarnessConnector``; a string names one of vLLM's own
    connectors (its scheduler half runs for real), configured by ``connector_config``. ``sliding_window``
    makes the one attention group a sliding window of that many tokens (vLLM drops the blocks it leaves).
    """
    model_config = ModelConfig(model=_model_dir(), dtype="float32", seed=0, skip_tokenizer_init=True,
                               max_model_len=max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        enable_chunked_prefill=True, long_prefill_token_threshold=long_prefill_token_threshold, policy=policy,
        async_scheduling=async_scheduling, is_encoder_decoder=False)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    kv_transfer = None
    if connector is True:
        kv_transfer = KVTransferConfig(kv_connector=HarnessConnector.__name__, kv_role="kv_both",
                                       kv_connector_module_path=__name__)
    elif connector:
        kv_transfer = KVTransferConfig(kv_connector=connector, kv_role="kv_both",
                                       kv_connector_extra_config=connector_config or {})
    speculative = (SpeculativeConfig(method="ngram", num_speculative_tokens=num_speculative_tokens)
                   if num_speculative_tokens else None)
    # The device named, not inferred: the CUDA wheel on a machine without a GPU infers none and refuses.
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config,
                             device_config=DeviceConfig(device="cpu"), kv_transfer_config=kv_transfer,
                             speculative_config=speculative)
    total = num_blocks + 1  # block 0 is the null block vLLM never hands out
    shape = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    spec = SlidingWindowSpec(sliding_window=sliding_window, **shape) if sliding_window else FullAttentionSpec(**shape)
    kv_cache_config = KVCacheConfig(num_blocks=total, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], spec)])
    cache_config.num_gpu_blocks = total
    scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
    scheduler = scheduler_cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config, block_size=block_size,
                          structured_output_manager=StructuredOutputManager(vllm_config), log_stats=True)
    tracer = VllmTracer(scheduler, str(path), engine="vllm scheduler harness")
    return Harness(scheduler=scheduler, tracer=tracer, path=path, block_size=block_size,
                   drafts=num_speculative_tokens or 0, depth=2 if async_scheduling else 1)
