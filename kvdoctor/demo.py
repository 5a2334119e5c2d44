"""The demo workload behind ``kvdoctor watch --demo``: a model serving a continuous stream of chat requests.

It runs kvdoctor's own engine with a deliberately small device tier, so the scheduler
preempts requests and swaps their blocks to host and back while you watch, and now and
then a client gives up on a request that sits swapped out (an abort, as in real
serving). With ``--fault NAME`` one of the engine's deliberate faults is switched on and
its finding appears within seconds. Tracing is switched on by ``KVDOCTOR_TRACE``, like
any workload; ``kvdoctor watch --demo`` sets it and follows the file.

With ``--prefix-cache`` the engine caches full blocks by content and every request opens with the
same chat system prompt, so from the second request on its blocks are served from the cache (hits
show live); a quarter of the requests run under an adapter, whose requests share only among themselves.

With ``--speculative`` each decode step also verifies up to 4 tokens drafted by prompt lookup, and
rejected drafts are rolled back through the cache.

With ``--merge THRESHOLD`` old blocks have adjacent tokens with nearly the same keys merged
(``merge`` events; see docs/long-context.md).

    python -m kvdoctor.demo [--model tiny|PATH] [--fault NAME] [--codec CODEC] [--prefix-cache] [--speculative]
                            [--merge THRESHOLD] [--seconds S] [--steps N] [--answers]

With ``--answers`` each finished request is printed (``[7] (stop) Paged attention stores…``); ``kvdoctor
watch --demo`` asks for them and shows them on its Output screen.

It never serves on as an orphan: it stops when the process that started it is gone (its
parent changes), and on SIGTERM or SIGHUP, in each case closing its trace first.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any
from pathlib import Path

from . import knobs
from .compression import CODEC_HELP, CODEC_METAVAR, MERGE_HELP, codec_setting, merge_threshold
from .engine.model.model import DTYPES
from .errors import UsageError
from .stop_signals import interrupt_on_stop_signals, reraise

__all__ = ["DemoConfig", "run_demo", "main", "model_setting", "fault_options", "PROMPTS", "SYSTEM_PROMPT", "ADAPTER"]

# Every request's opening with --prefix-cache: long enough to fill several blocks of 16 tokens.
SYSTEM_PROMPT = (
    "You are a patient assistant for engineers who run large language models in production. Answer in plain "
    "words, give a short example where one helps, say when you are unsure, and keep every answer under a "
    "hundred words. The people asking know Python and have deployed services before, but may be new to GPU "
    "memory, attention kernels and request scheduling."
)
ADAPTER = "lora-support"  # the adapter a quarter of the demo's requests run under (--prefix-cache)

PROMPTS = (
    "What is a KV cache?",
    "Explain paged attention to a new engineer in three sentences.",
    "Write a haiku about memory leaks.",
    "Why does swapping KV blocks to host memory cost latency?",
    "List five things that can go wrong when batching requests of different lengths.",
    "Summarize the plot of a detective story in which the culprit is a forgotten pointer.",
    "How do I reverse a linked list in Python?",
    "Give me a recipe for a quick tomato soup.",
    "What is the capital of France, and why is it famous?",
    "Describe continuous batching in LLM serving, with an example timeline of four requests.",
    "Translate 'the cache is warm' into French and Spanish.",
    "What are rotary position embeddings?",
)


@dataclass
class DemoConfig:
    model: str | None = None        # None: the embedded SmolLM2; "tiny": a small random Llama
    fault: str | None = None
    seconds: float | None = None    # stop after this long (None: until interrupted)
    steps: int | None = None        # stop after this many steps
    block_size: int = 16
    device_blocks: int = 24         # small on purpose: preemption and swaps happen on screen
    host_blocks: int = 512
    concurrency: int = 8            # requests kept in flight
    max_new_tokens: int = 96
    abort_rate: float = 0.1         # chance per step, per swapped-out request, that its client gives up
    seed: int = 0
    codec: str | None = None        # how blocks are stored (see kvdoctor.compression); None: the model's dtype
    prefix_cache: bool = False      # cache full blocks by content; every request opens with SYSTEM_PROMPT
    speculative: bool = False       # prompt-lookup drafts verified each decode step (engine.serving.speculative)
    parent: int | None = None       # stop once our parent is no longer this pid (None: the parent at start)
    dtype: str = "float32"          # the model's weights and activations (and so the cache's default dtype)
    merge: float = 0.0              # token merging's key cosine threshold (engine.kv.merge); 0: off
    answers: bool = False           # print each finished request's answer (watch shows them on its Output screen)


def model_setting(value: str) -> str:
    """``--model``'s value (an argparse type), checked before a child process starts: a checkpoint that
    is not there is a usage error in one line, not the demo's traceback seconds later."""
    if value == "tiny" or (Path(value).expanduser() / "config.json").is_file():
        return value
    raise argparse.ArgumentTypeError(
        f"{value} is not a Hugging Face checkpoint directory (it needs config.json and weights); "
        "'tiny' is a small random model, and without --model the demo uses the embedded SmolLM2"
    )


def fault_options(fault: str | None, codec: str | None = None) -> list[str]:
    """The demo's options ``fault`` needs to have something to break, for ``check --demo`` and ``watch --demo``.

    A fault the demo cannot show is a ``UsageError`` saying why and where it can be seen: started anyway,
    it would run clean and exit 0 without a word, which reads as "the checks missed it".
    """
    if fault is None:
        return []
    if fault == "stale-staging":
        raise UsageError("--fault stale-staging cannot fire in the demo: it breaks the long-context staging area, "
                         "which the demo's short requests never use; see it with kvdoctor run --staging-blocks N "
                         "--fault stale-staging (docs/long-context.md)")
    if fault == "wrong-scale":  # it corrupts a dequantisation scale: the device tier must store int8 or nf4 codes
        if codec is None:
            return ["--codec", "nf4"]
        device = dict(part.split("=", 1) for part in codec.split(",")).get("device") if "=" in codec else codec
        if device not in ("int8", "nf4"):
            raise UsageError(f"--fault wrong-scale cannot fire with --codec {codec}: it corrupts the scale of an "
                             "int8 or nf4 device block (--codec int8 or nf4; without --codec the demo uses nf4)")
    if fault.startswith("prefix-"):
        return ["--prefix-cache"]  # a prefix-cache fault needs the cache it breaks
    if fault.startswith("spec-"):
        return ["--speculative"]  # a speculative-decoding fault needs rollbacks of rejected drafts
    return []


def run_demo(cfg: DemoConfig) -> int:
    """Serve requests until time or steps run out (or Ctrl-C); returns the number of steps run."""
    from .engine.model.model import load_model, tiny_llama
    from .engine.serving.runner import Runner, SamplingParams
    from .compression import calibrated, engine_settings
    from .engine.serving.scheduler import Request, Scheduler
    from .engine.serving.speculative import NgramDrafter
    from .probes import attach_to_cache

    parent = os.getppid() if cfg.parent is None else cfg.parent
    lm = (tiny_llama(num_layers=4, max_position_embeddings=2048, dtype=cfg.dtype) if cfg.model == "tiny"
          else load_model(cfg.model, dtype=cfg.dtype, light=not calibrated(cfg.codec)))  # light: no transformers import
    runner = Runner.create(
        lm.model, tokenizer=lm.tokenizer, block_size=cfg.block_size, device_blocks=cfg.device_blocks,
        host_blocks=cfg.host_blocks, fault=cfg.fault, extra={"model": lm.name}, prefix_cache=cfg.prefix_cache,
        merge=cfg.merge, **engine_settings(cfg.codec, 0, lm),
    )
    if runner.bus.enabled and knobs.get(knobs.PROBES) is None:
        # Memory readings when a trace is being written, unless KVDOCTOR_PROBES said: on (the engine's hook
        # attached them) or off.
        attach_to_cache(runner.cache)
    sched = Scheduler(runner, max_batch=cfg.concurrency, drafter=NgramDrafter() if cfg.speculative else None)
    rng = random.Random(cfg.seed)
    vocab = lm.config.vocab_size
    system = [rng.randrange(3, vocab) for _ in range(3 * cfg.block_size)] if cfg.prefix_cache else []
    deadline = None if cfg.seconds is None else time.monotonic() + cfg.seconds
    steps = 0
    try:
        while ((cfg.steps is None or steps < cfg.steps) and (deadline is None or time.monotonic() < deadline)
               and os.getppid() == parent):  # an orphan's parent is init (or a subreaper): nobody is watching
            while len(sched.live) < cfg.concurrency:
                if lm.tokenizer is not None:
                    ids = runner.encode(rng.choice(PROMPTS), chat=True,
                                        system=SYSTEM_PROMPT if cfg.prefix_cache else None)
                else:
                    ids = system + [rng.randrange(3, vocab) for _ in range(rng.randint(4, 6 * cfg.block_size))]
                sampling = SamplingParams(greedy=False, temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 30))
                adapter = ADAPTER if cfg.prefix_cache and rng.random() < 0.25 else None
                sched.submit(Request(ids, max_new_tokens=rng.randint(16, cfg.max_new_tokens), sampling=sampling,
                                     adapter=adapter))
            sched.step()
            for gen in sched.done.values() if cfg.answers else ():
                print(_answer(gen), flush=True)
            sched.done.clear()  # printed: keeping them would grow with every request
            steps += 1
            swapped = [seq for seq, live in sched.live.items() if live.state == "swapped"]
            if swapped and rng.random() < cfg.abort_rate * len(swapped):
                sched.abort(rng.choice(swapped))
    except KeyboardInterrupt:
        pass
    finally:
        runner.close()
    return steps


def _answer(gen: Any) -> str:
    """One finished request as the demo prints it: its sequence, how it ended, and its text on one line."""
    text = " ".join(gen.text.split()) if gen.text is not None else f"{len(gen.token_ids)} tokens (a random model: no text)"
    return f"[{gen.seq}] ({gen.finish_reason}) {text}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvdoctor.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=model_setting,
                   help="'tiny' for a small random model, or a local checkpoint (default: embedded SmolLM2)")
    p.add_argument("--fault", help="switch on a deliberate engine fault, e.g. leak-swapped")
    p.add_argument("--seconds", type=float, help="stop after this many seconds")
    p.add_argument("--steps", type=int, help="stop after this many steps")
    p.add_argument("--device-blocks", type=int, default=DemoConfig.device_blocks)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codec", type=codec_setting, metavar=CODEC_METAVAR, help=CODEC_HELP)
    p.add_argument("--prefix-cache", action="store_true",
                   help="cache full blocks by content; every request opens with the same chat system prompt")
    p.add_argument("--speculative", action="store_true", help="speculative decoding with prompt-lookup drafts")
    p.add_argument("--dtype", choices=DTYPES, default=DemoConfig.dtype, help="the model's and the cache's dtype")
    p.add_argument("--merge", type=merge_threshold, default=DemoConfig.merge, metavar="THRESHOLD", help=MERGE_HELP)
    p.add_argument("--answers", action="store_true",
                   help="print each finished request: [sequence] (how it ended) its text")
    a = p.parse_args(argv)
    cfg = DemoConfig(model=a.model, fault=a.fault, seconds=a.seconds, steps=a.steps, device_blocks=a.device_blocks,
                     seed=a.seed, codec=a.codec, prefix_cache=a.prefix_cache, speculative=a.speculative,
                     dtype=a.dtype, merge=a.merge, answers=a.answers, parent=os.getppid())
    with interrupt_on_stop_signals() as received:  # SIGTERM/SIGHUP stop serving as Ctrl-C does: the trace is closed
        try:
            run_demo(cfg)
        except (ValueError, OSError, UsageError) as exc:
            print(f"kvdoctor demo: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            pass  # stopped before serving began: there was no trace to close yet
    reraise(received)
    return 0


if __name__ == "__main__":
    sys.exit(main())
