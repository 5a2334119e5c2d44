"""``kvdoctor run`` end to end on a tiny local checkpoint with its own word-level tokenizer."""

from __future__ import annotations

import json

import pytest

from kvdoctor.cli import main
from kvdoctor.commands import run as run_cmd
from kvdoctor.engine.faults import FAULTS
from kvdoctor.engine.model import tiny_llama
from kvdoctor.events import Batch, Write
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
