"""Run inside vLLM's worker processes (``LLM.collective_rpc``): a rank's trace restarted, and faults on one rank.

Tensor-parallel workers are processes of their own, so a test patches them through vLLM's own RPC: each
function takes the worker first and acts only on the rank it names. The faults are the field's bug classes
on the real producer: a rank whose slot mapping drops a request's tokens (its K/V written nowhere), and a
rank whose copy of a request's block table holds another block than its peers'.
"""

from __future__ import annotations

from typing import Any


def _rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def retrace(worker: Any, folder: str) -> str:
    """Close this rank's trace and start a new one in ``folder`` (each test judges its own)."""
    from kvdoctor.integrations.vllm_ranks import RankTrace

    runner = worker.model_runner
    old = runner.__dict__.get("_kvdoctor_rank")
    if old:
        old.close()
    path = f"{folder}/tp{_rank()}.kvtrace"
    runner._kvdoctor_rank = RankTrace(runner, path, "vllm test")
    return path


def close(worker: Any) -> None:
    trace = worker.model_runner.__dict__.get("_kvdoctor_rank")
    if trace:
        trace.close()


def skip_writes(worker: Any, rank: int, prefix: str) -> None:
    """On ``rank``: the slot mapping of requests whose id starts with ``prefix`` points nowhere (-1)."""
    if _rank() != rank:
        return
    runner = worker.model_runner
    tables = runner.input_batch.block_table
    original = tables.compute_slot_mapping

    def compute_slot_mapping(num_reqs: int, query_start_loc: Any, positions: Any) -> None:
        original(num_reqs, query_start_loc, positions)
        starts = query_start_loc.tolist()
        for i, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
            if req_id.startswith(prefix):
                tables[0].slot_mapping.np[starts[i]:starts[i + 1]] = -1

    tables.compute_slot_mapping = compute_slot_mapping


def other_block(worker: Any, rank: int, prefix: str) -> int | None:
    """On ``rank``: a request whose id starts with ``prefix`` enters the batch with its last block swapped for
    the pool's last block (which nothing else holds in a short test); returns that block on ``rank``."""
    if _rank() != rank:
        return None
    batch = worker.model_runner.input_batch
    original = batch.add_request
    spare = worker.model_runner.kv_cache_config.num_blocks - 1

    def add_request(request: Any) -> Any:
        if request.req_id.startswith(prefix):
            ids = request.block_ids[0]
            request.block_ids = ([*ids[:-1], spare], *request.block_ids[1:])
        return original(request)

    batch.add_request = add_request
    return spare


def undo(worker: Any) -> None:
    """Every fault above off again (they shadow methods on instances)."""
    runner = worker.model_runner
    runner.input_batch.block_table.__dict__.pop("compute_slot_mapping", None)
    runner.input_batch.__dict__.pop("add_request", None)
