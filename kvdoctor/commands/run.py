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

from ..compression import CODEC_HELP, CODEC_METAVAR, MERGE_HELP, calibrated, codec_setting, engine_settings, merge_threshold
from ..engine.model.model import DTYPES
from ..faults import FAULT_NAMES, add_fault_argument
from ..knobs import VERIFY_MODES  # content digest verification of reads (engine.kv.digest)

NAME = "run"
HELP = "generate with a model on kvdoctor's tiered KV cache (default: the embedded SmolLM2-135M-Instruct)"


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
    gen = p.add_argument_group("what to generate")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE ('-': standard input), for long inputs")
    gen.add_argument("--model", metavar="PATH", help="a local Hugging Face Llama-family checkpoint directory "
                     "(default: the embedded SmolLM2-135M-Instruct, which needs no download)")
    gen.add_argument("--dtype", choices=DTYPES, default="float32",
                     help="number format of the weights, the activations and the KV cache (default float32)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt in the model's chat template, as a chat assistant would receive it")
    gen.add_argument("--max-new-tokens", type=_positive, default=64, metavar="N", help="tokens to generate (default 64)")
    gen.add_argument("--greedy", action="store_true", help="always take the most likely next token (default: sample)")
    gen.add_argument("--temperature", type=float, default=0.7,
                     help="sampling: below 1 favours likely tokens, above 1 flattens the choice (default 0.7)")
    gen.add_argument("--top-p", type=float, default=0.9,
                     help="sampling: draw only from the most likely tokens that together hold this probability "
                     "(default 0.9)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same text (default 0)")
    gen.add_argument("--repeat", type=_positive, default=1, metavar="N",
                     help="run the prompt N times, one request after another (default 1); with --prefix-cache the "
                     "later ones reuse the first one's cached blocks")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (text, tokens, timings, swaps, cache statistics) instead of the text")

    tiers = p.add_argument_group(
        "the KV cache", "The cache holds the keys and values (K/V) of every token so far, in blocks of "
        "--block-size tokens, on three tiers: device (where attention reads them), host memory and disk. "
        "Small tiers force blocks to move between them, which is what the checks watch.")
    tiers.add_argument("--block-size", type=_positive, default=16, metavar="N", help="tokens per KV block (default 16)")
    tiers.add_argument("--device-blocks", type=_positive, default=256, metavar="N",
                       help="device tier capacity in blocks (default 256)")
    tiers.add_argument("--host-blocks", type=_non_negative, default=1024, metavar="N",
                       help="host tier capacity in blocks: where blocks go when the device is full (default 1024)")
    tiers.add_argument("--disk-blocks", type=_non_negative, default=0, metavar="N",
                       help="disk tier capacity in blocks, below host (default 0: no disk tier)")
    tiers.add_argument("--eviction", choices=("lru", "hybrid"), default="lru",
                       help="which blocks leave a full tier first: lru, the least recently used (default), or hybrid, "
                       "which weighs how recently a block was used, how far its tokens are from the newest one and "
                       "how much attention they got")
    tiers.add_argument("--codec", type=codec_setting, metavar=CODEC_METAVAR, help=CODEC_HELP)
    tiers.add_argument("--merge", type=merge_threshold, default=0.0, metavar="THRESHOLD", help=MERGE_HELP)

    longctx = p.add_argument_group(
        "long context and sparse attention", "For prompts longer than the device tier holds, and for "
        "attention that reads only part of the cache (docs/long-context.md).")
    longctx.add_argument("--staging-blocks", type=_non_negative, default=0, metavar="N",
                         help="let a sequence outgrow the device tier: its blocks on host and disk are copied "
                         "through a device staging area of N blocks as attention needs them (0, the default: the "
                         "sequence must fit on the device)")
    longctx.add_argument("--topk", type=_non_negative, default=0, metavar="K",
                         help="block-sparse attention: each new token reads only the K blocks whose keys can score "
                         "highest, plus the first block and the newest (default 0: every block); use with "
                         "--block-size 64 or 128, or with --sparse-block-size")
    longctx.add_argument("--sparse-block-size", type=_non_negative, default=0, metavar="N",
                         help="with --topk: choose pages of N tokens (a multiple of --block-size, e.g. 64 over blocks "
                         "of 16) instead of single blocks (default 0: one block)")
    longctx.add_argument("--dense-prefill", action="store_true",
                         help="with --topk: read every block while computing the prompt and only the top-k pages "
                         "while generating; slower prompt, better text (perplexity +5.7%% instead of +16%% at k=16 "
                         "on 1k tokens)")

    reuse = p.add_argument_group("reuse and speculation")
    reuse.add_argument("--prefix-cache", action="store_true",
                       help="automatic prefix caching: a request reuses the cached K/V blocks of the longest prompt "
                       "start it shares with an earlier one and computes only the rest (see --repeat)")
    reuse.add_argument("--speculative", metavar="ngram|PATH",
                       help="speculative decoding: guess several next tokens cheaply, by copying them from earlier "
                       "in the text (ngram) or with a smaller local model sharing the tokenizer (PATH), and let the "
                       "model check them all in one pass")
    reuse.add_argument("--num-draft", type=int, default=4, metavar="K",
                       help="with --speculative: tokens guessed per step (default 4)")

    record = p.add_argument_group("recording and checking",
                                  "Record a trace to check it later (kvdoctor check --trace FILE).")
    record.add_argument("--trace", metavar="FILE",
                        help="write the engine's events to FILE (.kvtrace, .kvtrace.gz or .kvtrace.msgpack)")
    record.add_argument("--no-probes", dest="probes", action="store_false",
                        help="with --trace: record no memory readings (RSS, Python heap, GPU: the mem events; on by "
                        "default; KVDOCTOR_PROBES=0 does the same)")
    record.add_argument("--stats-every", type=_non_negative, default=1, metavar="N",
                        help="record attention statistics (per layer: entropy, largest score; what the attention "
                        "checks read) every N steps (default 1: every step; 0: never)")
    record.add_argument("--verify", choices=VERIFY_MODES,
                        help="check that a block read back holds the bytes written to it (a digest per block): on "
                        "every read (full), on a sample of reads (sample) or never (off); default $KVDOCTOR_VERIFY, "
                        "else sample")
    add_fault_argument(p, record, choices=FAULT_NAMES)


def _prompt(args: argparse.Namespace) -> str:
    """The prompt text: ``--prompt``, or ``--prompt-file`` (``-``: standard input)."""
    from ..errors import UsageError

    if args.prompt_file is None:
        return args.prompt
    try:
        if args.prompt_file == "-":
            return sys.stdin.read()
        with open(args.prompt_file, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prompt-file {args.prompt_file}: {getattr(exc, 'strerror', None) or exc}") from None


def run(args: argparse.Namespace) -> int:
    from ..errors import EngineFailure, UsageError

    if args.temperature <= 0 or not 0 < args.top_p <= 1:
        raise UsageError("--temperature must be > 0 and --top-p in (0, 1]")
    if args.num_draft < 1:
        raise UsageError(f"--num-draft must be >= 1, got {args.num_draft}")
    from ..engine.errors import EngineError
    from ..engine.features.merging import TokenMerging
    from ..engine.model.model import ModelLoadError, load_model
    from ..engine.serving.runner import Runner, SamplingParams, UnsupportedModel
    from ..engine.serving.scheduler import Request, Scheduler
    from ..trace import TraceWriter

    try:
        loaded = load_model(args.model, dtype=args.dtype, light=not calibrated(args.codec))  # light: see engine/model/llama.py
        runner = Runner.create(
            loaded.model, tokenizer=loaded.tokenizer, stats_every=args.stats_every,
            block_size=args.block_size, device_blocks=args.device_blocks, host_blocks=args.host_blocks,
            disk_blocks=args.disk_blocks, staging_blocks=args.staging_blocks, eviction=args.eviction, fault=args.fault, verify=args.verify, extra={"model": loaded.name},
            **engine_settings(args.codec, args.topk, loaded),
            sparse_block_size=args.sparse_block_size, prefix_cache=args.prefix_cache, merge=args.merge,
            dense_prefill=args.dense_prefill,
        )
    except (ModelLoadError, UnsupportedModel, ValueError) as exc:
        raise UsageError(str(exc)) from None
    try:
        drafter = _drafter(args, runner)
    except BaseException:
        runner.close()
        raise
    writer = None
    try:
        if runner.tokenizer is None:
            raise UsageError(f"{loaded.path} has no tokenizer, so a text prompt cannot be encoded")
        prompt_ids = runner.encode(_prompt(args), chat=args.chat)
        need = -(-(len(prompt_ids) + args.max_new_tokens) // args.block_size)
        total = args.device_blocks + args.host_blocks + args.disk_blocks
        if args.staging_blocks and need > total:
            raise UsageError(
                f"the prompt ({len(prompt_ids)} tokens) plus --max-new-tokens {args.max_new_tokens} needs {need} blocks, "
                f"and device + host + disk hold {total}: raise --host-blocks or --disk-blocks by {need - total}"
            )
        if not args.staging_blocks and need > args.device_blocks:
            raise UsageError(
                f"the prompt ({len(prompt_ids)} tokens) plus --max-new-tokens {args.max_new_tokens} needs {need} blocks "
                f"on the device tier, which holds {args.device_blocks}: raise --device-blocks or --block-size, or stream "
                f"from host and disk with --staging-blocks N"
            )
        if args.trace:
            writer = TraceWriter(args.trace, runner.cache.header())
            runner.bus.subscribe(writer.write_many)
            if args.probes:  # a recorded run shows memory like any traced workload (KVDOCTOR_PROBES=0: off)
                from ..probes import from_env

                from_env(runner.cache, default=True)
        sampling = SamplingParams(greedy=args.greedy, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        sched = Scheduler(runner, drafter=drafter, num_draft=args.num_draft)
        prefills = []
        for _ in range(args.repeat):  # the last request's tokens and decode speed are reported
            seq = sched.submit(Request(prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling))
            t0 = time.perf_counter()
            sched.step()
            t1 = time.perf_counter()
            sched.run()
            t2 = time.perf_counter()
            prefills.append(round(t1 - t0, 6))
        gen = sched.done[seq]
        stats = runner.cache.stats()
        cache = runner.cache
        reads = cache.rows_from_device + cache.rows_from_slower
        merger = runner.feature(TokenMerging)
        merging = merger.stats() if merger is not None else None
        team = runner.threads  # before close gives the user's threads back
        threads = {"adaptive": team.adaptive, "team": team.team, "changes": team.changes}
    except EngineError as exc:
        raise EngineFailure(f"the engine failed: {exc}") from None
    finally:
        runner.close()
        if drafter is not None:
            drafter.close()
        if writer is not None:
            writer.close()
    decode_tokens = len(gen.token_ids) - 1
    result = {
        "model": loaded.name,
        "prompt_tokens": len(prompt_ids),
        "token_ids": gen.token_ids,
        "text": gen.text,
        "finish_reason": gen.finish_reason,
        "prefill_s": prefills[-1],
        "prefill_s_each": prefills,  # per request, in order (--repeat)
        "prefix": stats.get("prefix"),  # the prefix cache's hits and misses (--prefix-cache), else null
        # --speculative: drafted and accepted tokens, acceptance rate, generated tokens per target forward pass
        "speculative": {"drafter": args.speculative, "num_draft": args.num_draft, **sched.spec_stats()}
        if drafter is not None else None,
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
        "dense_prefill": runner.cache.config.dense_prefill,
        "staging_blocks": args.staging_blocks,
        "merge": merging,  # token merging (--merge): threshold, blocks merged, (layer, head, slot) rows freed
        "threads": threads,  # the thread policy: adaptive or not, the team at the end, how often it changed size
    }
    if args.staging_blocks:
        moved = cache.bytes_staged + sum(stats["swaps"].values()) * cache.config.bytes_per_block
        tokens = len(prompt_ids) + len(gen.token_ids)
        result["bytes_moved_per_token"] = round(moved / max(tokens, 1), 1)  # staged rows and whole-block swaps
        result["device_hit_rate"] = round(cache.rows_from_device / reads, 4) if reads else None
        result["prefetch_hit_rate"] = stats["prefetch_hit_rate"]
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


def _drafter(args: argparse.Namespace, runner):
    """The drafter ``--speculative`` names (None without it); a bad one is a usage error."""
    from ..engine.model.model import ModelLoadError, load_model
    from ..engine.serving.runner import Runner, UnsupportedModel
    from ..engine.serving.speculative import ModelDrafter, NgramDrafter
    from ..errors import UsageError

    if not args.speculative:
        return None
    if args.speculative == "ngram":
        return NgramDrafter()
    try:
        draft = load_model(args.speculative)
        draft_runner = Runner.create(draft.model, block_size=args.block_size, device_blocks=args.device_blocks,
                                     host_blocks=0, stats_every=0)
    except (ModelLoadError, UnsupportedModel, ValueError) as exc:
        raise UsageError(f"--speculative {args.speculative}: {exc}") from None
    try:
        return ModelDrafter(draft_runner, runner.model.config.vocab_size)
    except ValueError as exc:
        draft_runner.close()
        raise UsageError(f"--speculative {args.speculative}: {exc}") from None
