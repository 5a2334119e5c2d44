"""``kvdoctor run``: generate with a real model on kvdoctor's engine, optionally recording a trace.

The prompt is tokenized as-is with the model's tokenizer and its default special
tokens, unless ``--chat`` wraps it in the chat template. The tier options size the
cache in blocks so a user can force swaps through host and disk; ``--fault`` turns
one of the engine's deliberate faults on, so the checks have something to find.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..compression import CODEC_HELP, CODEC_METAVAR, codec_setting, engine_settings
from ..engine.model import DTYPES

NAME = "run"
HELP = "generate with a model on kvdoctor's tiered KV cache (default: the embedded SmolLM2-135M-Instruct)"

# The fault names, kept here so --help needs no engine import; kept equal to engine.faults.FAULTS by a test.
FAULT_NAMES = ("leak-swapped", "stale-version", "batch-misalign", "attention-nan", "overwrite-foreign", "stale-slot",
               "wrong-scale", "bit-flip", "row-off-by-one")
# Content digest verification of reads (engine.digest); kept equal to engine.config.VERIFY_MODES by a test.
VERIFY_MODES = ("off", "sample", "full")


def _int_at_least(lo: int):
    """An argparse type: an integer >= ``lo``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} must be >= {lo}")
        return value

    return parse


_positive, _non_negative = _int_at_least(1), _int_at_least(0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--model", metavar="PATH", help="a local Hugging Face Llama-family checkpoint directory "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weights, activations and KV cache in this dtype (default float32)")
    p.add_argument("--max-new-tokens", type=_positive, default=64, metavar="N", help="tokens to generate (default 64)")
    p.add_argument("--greedy", action="store_true", help="take the most likely token (default: sample)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling cut (default 0.9)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--block-size", type=_positive, default=16, metavar="N", help="tokens per KV block (default 16)")
    p.add_argument("--device-blocks", type=_positive, default=256, metavar="N", help="device tier capacity in blocks (default 256)")
    p.add_argument("--host-blocks", type=_non_negative, default=1024, metavar="N", help="host tier capacity in blocks (default 1024)")
    p.add_argument("--disk-blocks", type=_non_negative, default=0, metavar="N", help="disk tier capacity in blocks (default 0: none)")
    p.add_argument("--stats-every", type=_non_negative, default=1, metavar="N",
                   help="attention statistics every N steps (default 1; 0 never)")
    p.add_argument("--trace", metavar="FILE", help="write the engine's events to FILE (.kvtrace or .kvtrace.gz)")
    p.add_argument("--fault", choices=FAULT_NAMES, help="switch on one of the engine's deliberate faults")
    p.add_argument("--verify", choices=VERIFY_MODES, help="content digests of K/V blocks checked on every read (full), "
                   "a sample of reads (sample) or none (off); default $KVDOCTOR_VERIFY, else sample")
    p.add_argument("--codec", type=codec_setting, metavar=CODEC_METAVAR, help=CODEC_HELP)
    p.add_argument("--topk", type=_non_negative, default=0, metavar="K",
                   help="block-sparse attention: read the K blocks whose keys can score highest, plus the first "
                   "block and the newest (default 0: dense); use with --block-size 64 or 128, or with "
                   "--sparse-block-size")
    p.add_argument("--sparse-block-size", type=_non_negative, default=0, metavar="N",
                   help="with --topk: choose pages of N tokens (a multiple of --block-size, e.g. 64 over blocks of "
                   "16) instead of single blocks (default 0: one block)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError

    if args.temperature <= 0 or not 0 < args.top_p <= 1:
        raise UsageError("--temperature must be > 0 and --top-p in (0, 1]")
    from ..engine.errors import EngineError
    from ..engine.model import ModelLoadError, load_model
    from ..engine.runner import Runner, SamplingParams, UnsupportedModel
    from ..engine.scheduler import Request, Scheduler
    from ..trace import TraceWriter

    try:
        loaded = load_model(args.model, dtype=args.dtype)
        runner = Runner.create(
            loaded.model, tokenizer=loaded.tokenizer, stats_every=args.stats_every,
            block_size=args.block_size, device_blocks=args.device_blocks, host_blocks=args.host_blocks,
            disk_blocks=args.disk_blocks, fault=args.fault, verify=args.verify, extra={"model": loaded.name},
            **engine_settings(args.codec, args.topk, loaded),
            sparse_block_size=args.sparse_block_size,
        )
    except (ModelLoadError, UnsupportedModel, ValueError) as exc:
        raise UsageError(str(exc)) from None
    writer = None
    try:
        if runner.tokenizer is None:
            raise UsageError(f"{loaded.path} has no tokenizer, so a text prompt cannot be encoded")
        prompt_ids = runner.encode(args.prompt, chat=args.chat)
        need = -(-(len(prompt_ids) + args.max_new_tokens) // args.block_size)
        if need > args.device_blocks:
            raise UsageError(
                f"the prompt ({len(prompt_ids)} tokens) plus --max-new-tokens {args.max_new_tokens} needs {need} blocks "
                f"on the device tier, which holds {args.device_blocks}: raise --device-blocks or --block-size"
            )
        if args.trace:
            writer = TraceWriter(args.trace, runner.cache.header())
            runner.bus.subscribe(writer.write_many)
        sampling = SamplingParams(greedy=args.greedy, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        sched = Scheduler(runner)
        seq = sched.submit(Request(prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling))
        t0 = time.perf_counter()
        sched.step()
        t1 = time.perf_counter()
        sched.run()
        t2 = time.perf_counter()
        gen = sched.done[seq]
        stats = runner.cache.stats()
    except EngineError as exc:
        raise UsageError(f"the engine failed: {exc}") from None
    finally:
        runner.close()
        if writer is not None:
            writer.close()
    decode_tokens = len(gen.token_ids) - 1
    result = {
        "model": loaded.name,
        "prompt_tokens": len(prompt_ids),
        "token_ids": gen.token_ids,
        "text": gen.text,
        "finish_reason": gen.finish_reason,
        "prefill_s": round(t1 - t0, 6),
        "decode_tokens_per_s": round(decode_tokens / (t2 - t1), 3) if decode_tokens > 0 and t2 > t1 else None,
        "swaps": stats["swaps"],
        "trace": args.trace,
        "fault": args.fault,
        "dtype": runner.cache.config.dtype,  # the model's compute dtype, and the cache's unless --codec says otherwise
        "codec": runner.cache.config.codec,  # as given: one name, "mixed", or {tier: codec}
        "tier_codecs": runner.cache.config.tier_codecs,
        "peak_kv_bytes": stats["peak_kv_bytes"],  # the most resident at a step's end, each block in its codec's bytes
        "recodes": stats["recodes"],  # blocks mixed resolution demoted
        "topk": args.topk,
        "sparse_block_size": runner.cache.config.sparse_block_size,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(gen.text)
        tps = result["decode_tokens_per_s"]
        print(
            f"kvdoctor run: {len(gen.token_ids)} tokens ({gen.finish_reason}), prefill {result['prefill_s']:.3f} s, "
            f"decode {tps if tps is not None else '-'} tok/s" + (f", trace {args.trace}" if args.trace else ""),
            file=sys.stderr,
        )
    return 0
