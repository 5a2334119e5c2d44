"""``kvdoctor run --codec/--topk`` on a tiny local checkpoint: the settings reach the engine and show in the trace."""

from __future__ import annotations

import json

from kvdoctor.compression import CODEC_NAMES
from kvdoctor.engine.kv.codecs import CODECS
from kvdoctor.events import Read
from kvdoctor.trace import TraceReader

from test_runner_cli import _run, checkpoint  # noqa: F401  (the tiny checkpoint fixture)

PROMPT = " ".join(f"w{i % 100 + 3}" for i in range(40))


def test_codec_names_match_the_engine():
    assert CODEC_NAMES == CODECS


def test_topk_reads_fewer_blocks_than_the_sequence_holds(checkpoint, tmp_path, capsys):  # noqa: F811
    trace = tmp_path / "t.kvtrace"
    code, out, _ = _run(capsys, "--model", str(checkpoint), "--prompt", PROMPT, "--greedy", "--max-new-tokens", "6",
                        "--block-size", "4", "--topk", "1", "--codec", "fp16", "--trace", str(trace), "--json")
    assert code == 0
    result = json.loads(out)
    assert result["codec"] == "fp16" and result["topk"] == 1
    reads = [e for e in TraceReader(str(trace)) if isinstance(e, Read)]
    # a decode step reads some blocks of the sequence, not all: the first, the newest and the chosen ones between
    last = reads[-1].blocks
    assert 0 in last and len(last) < max(last) + 1


def test_int8_calibrates_once_and_runs(checkpoint, tmp_path, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code, out, _ = _run(capsys, "--model", str(checkpoint), "--prompt", PROMPT, "--greedy", "--max-new-tokens", "4",
                        "--codec", "int8", "--json")
    assert code == 0 and json.loads(out)["codec"] == "int8"
    stored = list((tmp_path / "cache" / "kvdoctor" / "calibration").iterdir())
    assert len(stored) == 1 and stored[0].suffix == ".safetensors"


def test_topk_over_pages_of_several_blocks_reads_whole_pages(checkpoint, tmp_path, capsys):  # noqa: F811
    # GIVEN top-1 over pages of 8 tokens, made of two 4-token cache blocks
    trace = tmp_path / "t.kvtrace"
    code, out, _ = _run(capsys, "--model", str(checkpoint), "--prompt", PROMPT, "--greedy", "--max-new-tokens", "6",
                        "--block-size", "4", "--topk", "1", "--sparse-block-size", "8", "--trace", str(trace), "--json")
    assert code == 0 and json.loads(out)["sparse_block_size"] == 8
    # THEN a decode step reads cache blocks page by page (both blocks of a full page), not all of them
    last = [e for e in TraceReader(str(trace)) if isinstance(e, Read)][-1].blocks
    assert 0 in last and 1 in last and len(last) < max(last) + 1


def test_dense_prefill_reaches_the_engine(checkpoint, capsys):  # noqa: F811
    # GIVEN top-1 attention whose prompt is prefilled densely (Quest; what that computes is held by
    # test_sparse's test_dense_prefill_and_dense_layers_read_every_block_there)
    code, out, _ = _run(capsys, "--model", str(checkpoint), "--prompt", PROMPT, "--greedy", "--max-new-tokens", "3",
                        "--block-size", "4", "--topk", "1", "--dense-prefill", "--json")
    # THEN the engine ran with it
    result = json.loads(out)
    assert code == 0 and result["dense_prefill"] is True and result["topk"] == 1 and len(result["token_ids"]) == 3


def test_a_page_that_is_not_whole_blocks_is_a_usage_error(checkpoint, capsys):  # noqa: F811
    code, _, err = _run(capsys, "--model", str(checkpoint), "--prompt", "w3 w4", "--block-size", "4", "--topk", "1",
                        "--sparse-block-size", "6")
    assert code == 2 and "sparse_block_size" in err and "Traceback" not in err
