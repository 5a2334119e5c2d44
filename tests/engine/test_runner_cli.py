"""``kvdoctor run`` end to end on a tiny local checkpoint with its own word-level tokenizer."""

from __future__ import annotations

import json

import pytest

from kvdoctor.cli import main
from kvdoctor.commands import run as run_cmd
from kvdoctor.engine.faults import FAULTS
from kvdoctor.engine.model.model import tiny_llama
from kvdoctor.events import Batch, Mem, Write
from kvdoctor.session import Session, TraceSource
from kvdoctor.trace import TraceReader

WORDS = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(125)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(seed=0).model.save_pretrained(path)
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
    tok.save_pretrained(path)
    return path


def _run(capsys, *args):
    code = main(["run", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_run_prints_json_and_writes_a_trace(checkpoint, tmp_path, capsys):
    trace = tmp_path / "run.kvtrace"
    code, out, _ = _run(capsys, "--model", str(checkpoint), "--prompt", "w5 w6 w7 w8 w9", "--greedy",
                        "--max-new-tokens", "6", "--block-size", "4", "--device-blocks", "4", "--json",
                        "--trace", str(trace))
    assert code == 0
    result = json.loads(out)
    assert 1 <= len(result["token_ids"]) <= 6 and result["prompt_tokens"] == 5
    assert {"text", "prefill_s", "decode_tokens_per_s"} <= set(result)
    reader = TraceReader(trace)
    events = list(reader)
    assert reader.header.block_size == 4 and not reader.truncated
    assert any(isinstance(e, Batch) for e in events) and any(isinstance(e, Write) for e in events)


@pytest.mark.parametrize("options, env, probed", [
    ((), {}, True), ((), {"KVDOCTOR_PROBES": "1"}, True), (("--no-probes",), {}, False),
    ((), {"KVDOCTOR_PROBES": "0"}, False),
], ids=["default", "env-on", "no-probes", "env-off"])
def test_a_recorded_run_holds_memory_readings_unless_switched_off(checkpoint, tmp_path, capsys, monkeypatch,
                                                                  options, env, probed):
    # GIVEN `kvdoctor run --trace F` with the probes' switches as given
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    trace = tmp_path / "run.kvtrace"
    code, _, _ = _run(capsys, "--model", str(checkpoint), "--prompt", "w5 w6", "--greedy", "--max-new-tokens", "3",
                      "--trace", str(trace), *options)
    # THEN the trace holds mem readings (RSS and the KV bytes at least) exactly when the probes are on
    assert code == 0
    mems = [e for e in TraceReader(trace) if isinstance(e, Mem)]
    assert bool(mems) is probed
    assert all(m.rss and m.kv_bytes is not None for m in mems)
    # AND the readings raise no finding on a clean run
    assert Session(TraceSource(trace)).run().findings == []


def test_greedy_run_is_reproducible_and_chat_changes_the_prompt(checkpoint, capsys):
    args = ["--model", str(checkpoint), "--prompt", "w5 w6", "--greedy", "--max-new-tokens", "4", "--json"]
    a = json.loads(_run(capsys, *args)[1])
    b = json.loads(_run(capsys, *args)[1])
    chat = json.loads(_run(capsys, *args, "--chat")[1])
    assert a["token_ids"] == b["token_ids"]
    assert chat["prompt_tokens"] == 5  # w1 w5 w6 w2 w3


def test_a_device_tier_too_small_is_a_usage_error(checkpoint, capsys):
    code, _, err = _run(capsys, "--model", str(checkpoint), "--prompt", "w5 " * 20, "--max-new-tokens", "20",
                        "--block-size", "4", "--device-blocks", "2")
    assert code == 2 and "--device-blocks" in err and "Traceback" not in err


def test_a_missing_model_is_a_usage_error(tmp_path, capsys):
    code, _, err = _run(capsys, "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert code == 2 and "not a Hugging Face checkpoint" in err


def test_fault_choices_are_the_engines_faults():
    assert set(run_cmd.FAULT_NAMES) == set(FAULTS)


def test_verify_choices_are_the_engines_modes():
    from kvdoctor.engine.config import VERIFY_MODES

    assert run_cmd.VERIFY_MODES == VERIFY_MODES


def test_run_in_bfloat16_computes_and_caches_in_bfloat16(checkpoint, capsys):
    # GIVEN the fp32 checkpoint run greedily in each dtype
    args = ["--model", str(checkpoint), "--prompt", "w5 w6 w7", "--greedy", "--max-new-tokens", "4", "--json"]
    fp32 = json.loads(_run(capsys, *args)[1])
    code, out, _ = _run(capsys, *args, "--dtype", "bfloat16")
    # THEN the bf16 run works and says the cache holds bf16, where the default stays fp32
    assert code == 0
    bf16 = json.loads(out)
    assert fp32["dtype"] == "float32" and bf16["dtype"] == "bfloat16"
    assert len(bf16["token_ids"]) == 4


def test_an_unknown_dtype_is_a_usage_error(checkpoint, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--model", str(checkpoint), "--prompt", "w5", "--dtype", "float8"])
    assert exc.value.code == 2
    assert "--dtype" in capsys.readouterr().err


def test_prefix_cache_serves_a_repeated_prompt_from_the_first_requests_blocks(checkpoint, tmp_path, capsys):
    # GIVEN a 10-token prompt in blocks of 4, run twice one after another
    prompt = " ".join(f"w{i}" for i in range(5, 15))
    args = ["--model", str(checkpoint), "--prompt", prompt, "--greedy", "--max-new-tokens", "4", "--block-size", "4",
            "--repeat", "2", "--json"]
    plain = json.loads(_run(capsys, *args)[1])
    trace = tmp_path / "prefix.kvtrace"
    code, out, _ = _run(capsys, *args, "--prefix-cache", "--trace", str(trace))
    cached = json.loads(out)
    # THEN the second request reused the two full blocks (8 tokens) before the prompt's last token
    assert code == 0 and plain["prefix"] is None
    assert cached["prefix"]["hit_blocks"] == 2 and cached["prefix"]["hit_tokens"] == 8
    assert cached["token_ids"] == plain["token_ids"] and len(cached["prefill_s_each"]) == 2
    # AND the trace says so, and the checks find nothing in it
    assert main(["check", "--trace", str(trace)]) == 0
    ends = [e for e in TraceReader(trace) if type(e).__name__ == "StepEnd" and e.prefix_hits]
    assert [e.prefix_hits for e in ends] == [2]


def test_speculative_decoding_gives_the_same_greedy_tokens_and_reports_acceptance(checkpoint, capsys):
    # GIVEN a repetitive prompt, where prompt lookup finds drafts, and the checkpoint itself as a draft model
    prompt = " ".join(["w5 w6 w7 w8"] * 4)
    args = ["--model", str(checkpoint), "--prompt", prompt, "--greedy", "--max-new-tokens", "12", "--json"]
    plain = json.loads(_run(capsys, *args)[1])
    for drafter in ("ngram", str(checkpoint)):
        code, out, _ = _run(capsys, *args, "--speculative", drafter, "--num-draft", "3")
        result = json.loads(out)
        # THEN the tokens are plain greedy decoding's, and the JSON says how speculation went
        assert code == 0 and result["token_ids"] == plain["token_ids"], drafter
        spec = result["speculative"]
        assert spec["drafter"] == drafter and spec["num_draft"] == 3 and spec["drafted"] > 0
        assert spec["tokens_per_forward"] >= 1
    assert plain["speculative"] is None
    # a draft model that is the target itself agrees with it on every token
    assert spec["acceptance_rate"] == 1.0


def test_bad_speculative_settings_are_one_line_usage_errors(checkpoint, tmp_path, capsys):
    other = tmp_path / "other-vocab"
    tiny_llama(seed=0, vocab_size=64).model.save_pretrained(other)
    base = ["--model", str(checkpoint), "--prompt", "w5 w6", "--max-new-tokens", "2"]
    for extra, says in ((["--speculative", str(tmp_path / "missing")], "is not a Hugging Face checkpoint"),
                        (["--speculative", str(other)], "vocabulary has 64 tokens"),
                        (["--speculative", "ngram", "--num-draft", "0"], "--num-draft must be >= 1")):
        code, _, err = _run(capsys, *base, *extra)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, (extra, err)


# ---- long context (issue 13): a prompt file longer than the device tier ----
LONG = " ".join(f"w{3 + (i * 7) % 120}" for i in range(120))  # 120 tokens: 16 blocks of 8 with 8 new ones
TIERS = ("--device-blocks", "4", "--host-blocks", "6", "--disk-blocks", "16", "--staging-blocks", "3")


def test_run_streams_a_prompt_file_longer_than_the_device_with_the_resident_tokens(checkpoint, tmp_path, capsys):
    from kvdoctor.checks import make_suite

    # GIVEN a prompt file of 121 tokens and a device tier of 4 blocks of 8 (a quarter of the sequence)
    prompt = tmp_path / "long.txt"
    prompt.write_text(LONG)
    common = ["--model", str(checkpoint), "--prompt-file", str(prompt), "--block-size", "8", "--max-new-tokens", "8",
              "--greedy", "--json"]
    code, out, _ = _run(capsys, *common, "--device-blocks", "64")
    resident = json.loads(out)
    # WHEN it runs streamed from host and disk through a 3-block staging area
    trace = tmp_path / "long.kvtrace"
    code, out, err = _run(capsys, *common, *TIERS, "--trace", str(trace))
    got = json.loads(out)
    # THEN the tokens are the resident run's, the JSON says what moved, and the trace is clean
    assert code == 0, err
    assert got["token_ids"] == resident["token_ids"]
    assert got["bytes_moved_per_token"] > 0 and 0 < got["device_hit_rate"] < 1
    suite = make_suite()
    for ev in TraceReader(trace):
        suite.observe(ev)
    findings = suite.findings + suite.finish()
    assert findings == [], [f.message for f in findings]


def test_prompt_file_dash_reads_stdin(checkpoint, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("w5 w6 w7"))
    code, out, _ = _run(capsys, "--model", str(checkpoint), "--prompt-file", "-", "--max-new-tokens", "2", "--json")
    assert code == 0 and json.loads(out)["prompt_tokens"] == 3


def test_a_sequence_that_fits_no_tier_is_one_line_naming_what_is_needed(checkpoint, tmp_path, capsys):
    prompt = tmp_path / "long.txt"
    prompt.write_text(LONG)
    code, _, err = _run(capsys, "--model", str(checkpoint), "--prompt-file", str(prompt), "--block-size", "8",
                        "--device-blocks", "4", "--host-blocks", "2", "--staging-blocks", "2")
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "needs 23 blocks" in err and "device + host + disk hold 6" in err  # 120 tokens + 64 new, by 8
    code, _, err = _run(capsys, "--model", str(checkpoint), "--prompt-file", str(tmp_path / "none.txt"))
    assert code == 2 and "--prompt-file" in err and "Traceback" not in err


def test_run_with_merge_reports_what_it_merged_and_a_bad_threshold_is_a_usage_error(checkpoint, tmp_path, capsys):
    prompt = " ".join(f"w{3 + i % 40}" for i in range(40))
    code, out, _ = _run(capsys, "--model", str(checkpoint), "--prompt", prompt, "--greedy", "--max-new-tokens", "8",
                        "--block-size", "4", "--device-blocks", "32", "--merge", "0.3", "--json",
                        "--trace", str(tmp_path / "m.kvtrace"))
    assert code == 0
    merge = json.loads(out)["merge"]
    assert merge["threshold"] == 0.3 and merge["blocks_merged"] > 0 and merge["rows_freed"] > 0
    assert any(type(e).__name__ == "Merge" for e in TraceReader(tmp_path / "m.kvtrace"))
    with pytest.raises(SystemExit) as exc:
        _run(capsys, "--model", str(checkpoint), "--prompt", prompt, "--merge", "1.5")
    assert exc.value.code == 2 and "cosine similarity threshold" in capsys.readouterr().err
    code, _, err = _run(capsys, "--model", str(checkpoint), "--prompt", prompt, "--merge", "0.9",
                        "--staging-blocks", "2")
    assert code == 2 and "staging_blocks" in err and len(err.strip().splitlines()) == 1
