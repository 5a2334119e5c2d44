"""A store entry per rank for vLLM's ``ExampleConnector``, and faults on one rank's connector.

vLLM's ``ExampleConnector`` names an entry's files by the prompt's tokens and the layer, not by the rank: at
tensor parallel 2 both ranks of the prefill instance write their own heads to the same files, and each decode
rank loads whichever rank wrote last. ``RankedExampleConnector`` (``--store per-rank`` in
``vllm_disaggregated.py``) keeps each rank's share in a folder of its own (``tp1pp0/<key>/<layer>``), and finds
a prompt in the store only when every rank's folder holds a file for every layer of its stage. vLLM loads it
in every process that builds a connector through ``kv_connector_module_path="vllm_rank_store"``.

The faults run inside the workers (``LLM.collective_rpc``, with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``) and
act on one rank's connector only, by shadowing a method on that connector object (the class, which the
kvdoctor plugin wraps, is left alone), each on the requests it names by their order: a rank that saves nothing
for a request (LMCache #1807), or all but one layer, a rank that loads all but its last layer, and a block whose
bytes change between the rank's write and its connector's save.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector, align_to_block_size


def _ranks(config: Any) -> list[tuple[int, int]]:
    parallel = config.parallel_config
    return [(t, p) for p in range(parallel.pipeline_parallel_size) for t in range(parallel.tensor_parallel_size)]


def _rank() -> tuple[int, int]:
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group


class RankedExampleConnector(ExampleConnector):
    """``ExampleConnector`` with a folder per rank under the shared path (the scheduler side keeps the path)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._root = self._storage_path
        self._config = vllm_config
        if role == KVConnectorRole.WORKER:
            tp, pp = _rank()
            self._storage_path = os.path.join(self._root, f"tp{tp}pp{pp}")

    def _found_match_for_prompt(self, prompt_token_ids: list[int], mm_hashes: list[str]) -> bool:
        """The prompt's entry is whole: every rank's folder holds every layer of that rank's stage."""
        from vllm.distributed.utils import get_pp_indices

        valid = align_to_block_size(len(prompt_token_ids) - 1, self._block_size)
        name = os.path.basename(self._generate_foldername_debug(torch.tensor(prompt_token_ids)[:valid], mm_hashes))
        total = self._config.model_config.get_total_num_hidden_layers()
        pp_size = self._config.parallel_config.pipeline_parallel_size
        for tp, pp in _ranks(self._config):
            folder = os.path.join(self._root, f"tp{tp}pp{pp}", name)
            start, end = get_pp_indices(total, pp, pp_size)
            if not os.path.isdir(folder) or len(os.listdir(folder)) != end - start:
                return False
        return True


def _connector_of(rank: int) -> Any:
    """This worker's KV connector when it is tensor-parallel rank ``rank``, else None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group() if _rank()[0] == rank else None


def _layer(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(name)


class _Only:
    """The connector's metadata narrowed to some requests while a method runs (it reads the requests from it)."""

    def __init__(self, connector: Any, keep: Any) -> None:
        self.connector, self.keep = connector, keep

    def __enter__(self) -> None:
        self.meta = self.connector._connector_metadata
        self.connector._connector_metadata = type(self.meta)(requests=[r for r in self.meta.requests if self.keep(r)])

    def __exit__(self, *exc: Any) -> None:
        self.connector._connector_metadata = self.meta


def _order(seen: dict[bytes, int], request: Any) -> int:
    """The place of ``request`` among the requests this fault has seen, in order of first sight."""
    return seen.setdefault(request.token_ids.numpy().tobytes(), len(seen))


def skip_saves(worker: Any, rank: int, skipped: list[int | None]) -> None:
    """On ``rank``: the i-th request its connector stores saves no layer (``skipped[i]`` None) or every layer but
    ``skipped[i]``; requests past the list save whole."""
    connector = _connector_of(rank)
    if connector is None:
        return
    save, seen = type(connector).save_kv_layer, {}

    def kept(request: Any, layer: int) -> bool:
        i = _order(seen, request)
        return not request.is_store or i >= len(skipped) or skipped[i] not in (None, layer)

    def save_kv_layer(layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        with _Only(connector, lambda r: kept(r, _layer(layer_name))):
            save(connector, layer_name, kv_layer, attn_metadata, **kwargs)

    connector.save_kv_layer = save_kv_layer


def overwrite_before_save(worker: Any, rank: int, layer: int) -> None:
    """On ``rank``: the first request its connector stores has the start of its first block changed at
    ``layer`` in the paged cache after the forward pass wrote it and before the connector saves that layer, as
    another request reusing the block, or a copy racing the save, would."""
    connector = _connector_of(rank)
    if connector is None:
        return
    save, done = type(connector).save_kv_layer, []

    def save_kv_layer(layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        stored = [r for r in connector._get_connector_metadata().requests if r.is_store]
        if stored and not done and _layer(layer_name) == layer:
            done.append(stored[0])
            first = int(stored[0].slot_mapping[0]) // connector._block_size
            kv_layer[first, :, 0] += 1.0  # the CPU layout: each KV head's first 2 x head size values in the block
        save(connector, layer_name, kv_layer, attn_metadata, **kwargs)

    connector.save_kv_layer = save_kv_layer


def load_fewer_layers(worker: Any, rank: int, victim: int) -> None:
    """On ``rank``: the ``victim``-th request its connector loads gets every layer but the last (the connector is
    handed a forward context without it, as a connector that skips a layer it does not find would)."""
    import dataclasses

    connector = _connector_of(rank)
    if connector is None:
        return
    load, seen = type(connector).start_load_kv, {}

    def start_load_kv(forward_context: Any, **kwargs: Any) -> None:
        layers = forward_context.no_compile_layers
        last = max((n for n, m in layers.items() if getattr(m, "kv_cache", None) is not None), key=_layer)
        fewer = dataclasses.replace(forward_context, no_compile_layers={n: m for n, m in layers.items() if n != last})
        hit = lambda r: not r.is_store and _order(seen, r) == victim  # noqa: E731
        with _Only(connector, lambda r: not hit(r)):
            load(connector, forward_context, **kwargs)
        with _Only(connector, hit):
            load(connector, fewer, **kwargs)

    connector.start_load_kv = start_load_kv
