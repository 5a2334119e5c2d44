"""Decode throughput: kvdoctor's runner against transformers' ``generate`` with its default cache.

Same model (the embedded SmolLM2-135M-Instruct unless ``--model``), same process,
greedy decoding of ``--new-tokens`` tokens per row, end-of-sequence ignored so every
run decodes the same number of tokens:

- batch 1: one prompt;
- batch 8: eight prompts of different lengths, continuously batched by the runner and
  left-padded into one batch for transformers;
- layers (``--layer-pairs N``): the runner with its compiled decode layers (``engine/model/decode_layer.py``)
  against a second runner on the same model with its torch path (``KVDOCTOR_DECODE_LAYER=0``), ABBA;
- pages (``--page-pairs N``): the runner with its weights on 2 MB pages (``engine/model/hugepages.py``) against
  a runner on a second copy of the model that leaves them on 4 KB pages (``KVDOCTOR_HUGEPAGES=0``), ABBA;
- bound: one row through every projection (the kernel alone), the batch-1 ceiling the weights' bytes set,
  and batch-1 runs each paired with a bound measured next to it (the runner's share of the bound);
- events: the runner with events off (nobody listening: no statistics, no trace) against
  every event, attention statistics included, written to a trace file; and, timed around their
  entry points, the milliseconds a listened step spends inside each part of the event path
  (statistics, staging for digests, booking writes, reads, the step's end and its sink);
- sinks (``--sink-split RUNS``): where a listened step's extra time goes, in cycles of an unlistened step
  and one step listened by each of a sink that discards the events (what producing them costs the engine),
  the JSON trace writer and the msgpack one (what writing them adds);
- digests: with every event on, the time spent inside the content-digest code (staging at
  ``store``, folding and booking at ``commit``, verifying reads and swaps), timed around its
  entry points with the timers' own cost subtracted, as a share of the decode steps' time,
  for the sampled default and for full verification (every read); and, as a cross-check, whole
  runs with digests off against each mode, paired ABBA like the speed comparison (noisier).
  Alternating events off/on step by step cannot measure digests: a step with nobody listening
  leaves the blocks it writes without a record, so the next listened step has little to verify.

Decode tokens/s counts the tokens generated after the first one, over the time after
the first token (prefill excluded), by the wall clock and by this process's CPU time
(the fairer clock on a shared machine with ``--threads 1``). The two sides of every
comparison run alternately in this process (ABBA), and what is reported is the median
of the per-pair ratios with its quartiles: a burst of load from other processes hits
one pair, not the figure. Events on/off alternates step by step inside one continuous
batch (off, on, on, off, …) and reports the median extra time of a listened step over its
neighbour, by CPU time and wall clock, with quartiles; ``--compiled-events both`` also runs it with the
attention statistics and digest sums by torch and numpy instead of their compiled passes, run for run
alternately, as the baseline of what those passes save. Peak RSS of the process is reported. Usage::

    .venv/bin/python benchmarks/decode.py [--threads 1] [--new-tokens 48] [--repeats 5]
        [--event-runs 2] [--event-tokens 64] [--digest-pairs 3] [--only-events] [--compiled-events both]
        [--mixed-outputs] [--no-matvec] [--dtype bfloat16] [--layer-pairs 3]
        [--page-pairs 3] [--sink-split 40] [--profile N] [--bound-repeats 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch

# Benchmarks are scripts, their folder their package: on the path while the siblings load, and only then
# (left there, this folder's vllm.py would shadow vLLM for whatever imports it next in the process).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
try:
    from decode_events import (
        compiled_events, digest_share, digests_paired, event_parts, events_by_step, scoped_env, sink_split)
    from pairing import clocks, median, paired, prompts_of, quartiles, rates, runner_decode
finally:
    sys.path.remove(_HERE)


class _FirstToken:
    """A logits processor that only notes when transformers finished its prefill."""

    def __init__(self) -> None:
        self.t: tuple[float, float] | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.t is None:
            self.t = clocks()
        return scores


def hf_decode(model: Any, prompts: list[list[int]], new_tokens: list[int], pad_id: int) -> tuple[float, float]:
    """Decode tokens/s (wall, CPU) of ``model.generate`` with its default cache on a left-padded batch.

    A static batch runs every row for the longest budget; only each row's own budget counts as output."""
    from transformers import LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    first = _FirstToken()
    longest = max(new_tokens)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                         do_sample=False, pad_token_id=pad_id, logits_processor=LogitsProcessorList([first]))
    assert out.shape[1] == width + longest
    return rates(sum(n - 1 for n in new_tokens), first.t)


def _rss_mb(field: str = "VmRSS") -> float:
    """This process's resident set now (MB), or one part of it (``RssAnon``: its own memory; ``RssFile``:
    pages of mapped files, such as the checkpoint's weights), from /proc (0 where there is none)."""
    try:
        with open("/proc/self/status") as fh:
            return next((round(int(line.split()[1]) / 1024, 1) for line in fh if line.startswith(field + ":")), 0.0)
    except OSError:
        return 0.0


def _projection_calls(runner: Any) -> tuple[list[Callable[[], None]], int]:
    """One row through every projection of a step, as calls, and the bytes their weights hold. With the C
    kernel each call is the kernel alone on buffers allocated once (nothing of a call's Python around it,
    which the compiled decode layers do not pay either); otherwise the projection as the runner calls it."""
    from kvdoctor.engine.kernels import pool

    projections = [p for w in runner._weights for p in (w.qkv, w.o, w.gate_up, w.down)] + [runner._lm_head]
    calls = []
    for p in projections:
        N, K = p.weight.shape
        x = torch.randn(1, K, dtype=torch.float32 if p.matvec is not None else p.weight.dtype, device=p.weight.device)
        if p.matvec is None:
            calls.append(lambda p=p, x=x: p(x))
            continue
        y, scratch, fn = torch.empty(1, N), torch.empty(1, K), p.matvec.kernels[p.weight.dtype]
        args = (x.data_ptr(), p.weight.data_ptr(), None, y.data_ptr(), scratch.data_ptr(), 1, N, K,
                pool.team(), 0)  # the kernels' team; outputs as they are (0: not rounded to bf16)
        calls.append(lambda fn=fn, args=args, keep=(x, y, scratch): fn(*args))
    return calls, sum(p.weight.nbytes for p in projections)


def _bound_seconds(calls: list[Callable[[], None]], passes: int) -> tuple[float, float]:
    """Median seconds (wall, CPU) of ``passes`` passes over ``calls``, after one that warms caches and kernels."""
    times = []
    with torch.inference_mode():
        for _ in range(passes + 1):
            t = clocks()
            for call in calls:
                call()
            end = clocks()
            times.append((end[0] - t[0], end[1] - t[1]))
    return median([w for w, _ in times[1:]]), median([c for _, c in times[1:]])


def weight_bound(runner: Any, repeats: int) -> dict[str, float]:
    """The batch-1 ceiling the weights set: the time one row takes through every projection of a step
    (the matrix-vector products a decode step cannot avoid; each reads its whole weight once), as
    GB/s over the bytes those weights hold and as tokens/s. Median of ``repeats`` passes."""
    calls, nbytes = _projection_calls(runner)
    s = _bound_seconds(calls, repeats)[0]
    return {"weight_mb": round(nbytes / 2**20, 1), "ms": round(1e3 * s, 3), "gb_s": float(f"{nbytes / s / 1e9:.3g}"),
            "tok_s": round(1 / s, 1)}


def share_of_bound(runner: Any, prompt: list[int], new_tokens: int, pairs: int) -> dict[str, Any]:
    """Batch-1 decode tokens/s as a share of the bound, each runner run paired (ABBA) with a bound
    measured next to it (tokens/s of 5 passes' median): a machine's load moves both alike."""
    calls, _ = _projection_calls(runner)

    def bound() -> tuple[float, float]:
        wall, cpu = _bound_seconds(calls, 5)
        return 1 / wall, 1 / cpu

    return paired(bound, lambda: runner_decode(runner, [prompt], [new_tokens]), pairs)


def profile_batch8(runner: Any, prompts: list[list[int]], new_tokens: int) -> int:
    """Where the runner's decode time goes: torch.profiler's ops by self CPU time over one continuous batch
    (the Python side is best seen with ``py-spy record`` on the same command)."""
    from torch.profiler import ProfilerActivity, profile

    runner_decode(runner, prompts, [4] * len(prompts))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall, _ = runner_decode(runner, prompts, [new_tokens] * len(prompts))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    print(f"decode {wall:.2f} tok/s (wall, under the profiler), threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    return 0


def _named(r: dict[str, Any], a: str, b: str, ratio: str) -> dict[str, Any]:
    """``paired``'s result per clock with its sides and ratio named as the report names them."""
    return {clock: {a: v["a"], b: v["b"], ratio: v["ratio"], f"{ratio}_q1": v["ratio_q1"], f"{ratio}_q3": v["ratio_q3"]}
            for clock, v in r.items()}


# what each A/B of the runner against another runner compares: the other's side, the runner's
_AGAINST = {"layers": ("torch path", "compiled decode layers"), "pages": ("weights on 4 KB pages", "on 2 MB pages")}


def _against(results: dict[str, Any], kind: str, baseline: Any, runner: Any, scenarios: list[tuple[str, Any, Any]],
             pairs: int) -> None:
    """ABBA pairs of ``baseline`` (another runner) against ``runner`` in every scenario, into ``results``."""
    runner_decode(baseline, scenarios[0][1], [4])
    for name, prompts, budgets in scenarios:
        r = paired(lambda p=prompts, b=budgets: runner_decode(baseline, p, b),
                   lambda p=prompts, b=budgets: runner_decode(runner, p, b), pairs)
        results[f"{name}_{kind}"] = _named(r, "baseline", "runner", "speedup")
    baseline.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a local checkpoint directory (default: the embedded SmolLM2)")
    ap.add_argument("--new-tokens", type=int, default=48, help="tokens per request in the speed comparison")
    ap.add_argument("--repeats", type=int, default=5, help="transformers/runner pairs per case")
    ap.add_argument("--event-runs", type=int, default=2,
                    help="batch-8 runs alternating events off/on step by step (0 skips the comparison)")
    ap.add_argument("--event-tokens", type=int, default=64, help="tokens per request in each events run")
    ap.add_argument("--digest-pairs", type=int, default=0,
                    help="also ABBA pairs of whole runs per digest comparison (off vs sample, off vs full): a "
                    "cross-check, too noisy on a shared machine to resolve 1%% (default 0: skipped)")
    ap.add_argument("--sink-split", type=int, default=0, metavar="RUNS",
                    help="also RUNS batch-1 and batch-8 runs cycling step by step through events off, the JSON trace, "
                         "the msgpack trace and a sink that discards the events (the engine's own cost of producing "
                         "them): where a listened step's extra time goes (default 0: skipped)")
    ap.add_argument("--only-events", action="store_true", help="skip the transformers speed comparison")
    ap.add_argument("--compiled-events", choices=("on", "off", "both"), default="on",
                    help="events runs with the attention statistics and digest sums compiled (on), by torch and "
                         "numpy (off), or both, alternating run by run (results named *_torch for off)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--batch-lengths", default="24,40,56,72,88,104,120,136",
                    help="prompt lengths of the batch-8 run (comma separated)")
    ap.add_argument("--mixed-outputs", action="store_true",
                    help="also run batch 8 with different output budgets per request (continuous batching's case)")
    ap.add_argument("--layer-pairs", type=int, default=0,
                    help="also ABBA pairs of the runner with its compiled decode layers against its torch path "
                         "(engine/model/decode_layer.py; same model, a second runner with KVDOCTOR_DECODE_LAYER=0)")
    ap.add_argument("--page-pairs", type=int, default=0,
                    help="also ABBA pairs of the runner with its weights on 2 MB pages against a second copy of the "
                         "model whose runner leaves them on 4 KB pages (KVDOCTOR_HUGEPAGES=0; engine/model/hugepages.py)")
    ap.add_argument("--no-matvec", action="store_true", help="runner with F.linear (MKL) for every projection, not the C kernel")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="weights, activations and KV cache of both sides (default float32)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the model, the cache and transformers run")
    ap.add_argument("--bound-repeats", type=int, default=7,
                    help="timed passes over every projection at one row for the bandwidth bound (0 skips it); with it, "
                         "also --repeats batch-1 runs each paired with a bound measured beside it (share of the bound)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="only profile the runner on the batch-8 prompts for N new tokens (torch.profiler, ops by self CPU)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from kvdoctor.engine.model.model import load_model
    from kvdoctor.engine.serving.runner import Runner
    from kvdoctor import binary_trace
    from kvdoctor.trace import TraceWriter

    # With --only-events transformers never runs: the runner's own light modules (engine/model/llama.py) then, so
    # the peak RSS is what serving with kvdoctor's runner takes.
    lm = load_model(args.model, dtype=args.dtype, device=args.device, light=args.only_events)
    rss_loaded = _rss_mb()
    model, tok = lm.model, lm.tokenizer
    lengths = [int(x) for x in args.batch_lengths.split(",")]
    batch8 = prompts_of(tok, lengths)
    batch1 = [batch8[len(batch8) // 2]]
    pad = getattr(model.generation_config, "pad_token_id", None)
    pad = pad if pad is not None else model.config.eos_token_id
    runner = Runner.create(model, tokenizer=tok, device_blocks=512, host_blocks=0, native_matvec=not args.no_matvec)
    trace_path = os.path.join(tempfile.mkdtemp(prefix="kvd-bench-"), "decode.kvtrace")

    if args.profile:
        return profile_batch8(runner, batch8, args.profile)
    N = args.new_tokens
    # The mixed case gives the eight requests different output budgets (N/4 … N), as a server sees them:
    # the runner's batch shrinks as requests finish, a static batch keeps computing finished rows.
    mixed = [max(2, N * (i + 2) // 9) for i in range(len(batch8))]
    scenarios = [("batch1", batch1, [N]), ("batch8", batch8, [N] * len(batch8))]
    if args.mixed_outputs:
        scenarios.append(("batch8_mixed_outputs", batch8, mixed))
    # Warm both paths once (allocator, kernels) before timing anything. With --only-events transformers
    # never runs, so the process's memory is the runner's alone (the checkpoint pages of the weights fused
    # into new copies, dropped then, are not mapped again).
    if not args.only_events:
        hf_decode(model, batch1, [4], pad)
    runner_decode(runner, batch1, [4])
    runner_decode(runner, batch8, [4] * len(batch8))
    results: dict[str, Any] = {"model": lm.name, "new_tokens": N, "threads": torch.get_num_threads(),
                               "repeats": args.repeats, "batch8_prompt_lengths": lengths,
                               "native_matvec": runner._lm_head.matvec is not None, "dtype": args.dtype,
                               "rss_after_load_mb": rss_loaded, "load_before": os.getloadavg()[0]}
    if args.bound_repeats:
        results["bound"] = weight_bound(runner, args.bound_repeats)
        r = share_of_bound(runner, batch1[0], N, args.repeats)
        results["batch1_bound_share"] = _named(r, "bound", "runner", "share")
    for name, prompts, budgets in scenarios if not args.only_events else ():
        r = paired(lambda p=prompts, b=budgets: hf_decode(model, p, b, pad),
                   lambda p=prompts, b=budgets: runner_decode(runner, p, b), args.repeats)
        results[name] = _named(r, "transformers", "runner", "speedup")
    if args.layer_pairs:
        with scoped_env("KVDOCTOR_DECODE_LAYER", "0"):
            torch_path = Runner.create(model, tokenizer=tok, device_blocks=512, host_blocks=0,
                                       native_matvec=not args.no_matvec)
        _against(results, "layers", torch_path, runner, scenarios, args.layer_pairs)
    if args.page_pairs:  # a second copy of the model, whose runner leaves its weights on 4 KB pages
        with scoped_env("KVDOCTOR_HUGEPAGES", "0"):
            other = load_model(args.model, dtype=args.dtype, device=args.device, light=args.only_events)
            small_pages = Runner.create(other.model, tokenizer=tok, device_blocks=512, host_blocks=0,
                                        native_matvec=not args.no_matvec)
        _against(results, "pages", small_pages, runner, scenarios, args.page_pairs)
    E = args.event_tokens
    writer = TraceWriter(trace_path, runner.cache.header())
    kernels = {"on": (True,), "off": (False,), "both": (True, False)}[args.compiled_events]
    for name, prompts in (("events_batch1", batch1), ("events_batch8", batch8)) if args.event_runs else ():
        steps = {on: {"off_wall": [], "off_cpu": [], "on_wall": [], "on_cpu": []} for on in kernels}
        for _ in range(args.event_runs):
            for on in kernels:  # with both, the two kinds of run alternate
                with compiled_events(on):
                    for k, v in events_by_step(runner, writer.write_many, prompts, E).items():
                        steps[on][k] += v
        parts: dict[bool, list[dict[str, float]]] = {on: [] for on in kernels}  # where a listened step's time goes
        for _ in range(args.event_runs):
            for on in kernels:
                with compiled_events(on):
                    parts[on].append(event_parts(runner, writer.write_many, prompts, E))
        for on in kernels:
            key = name if on else f"{name}_torch"
            results[f"{key}_parts"] = {label: median([p[label] for p in parts[on]]) for label in parts[on][0]}
            results[key] = {"pairs": len(steps[on]["off_cpu"])}
            for clock in ("cpu", "wall"):
                off, listened = steps[on][f"off_{clock}"], steps[on][f"on_{clock}"]
                ratios = [b / a - 1 for a, b in zip(off, listened)]  # extra time of the listened step
                lo, hi = quartiles(ratios)
                results[key][clock] = {"off_ms": round(1e3 * median(off), 2), "on_ms": round(1e3 * median(listened), 2),
                                       "overhead": round(median(ratios), 4), "overhead_q1": round(lo, 4),
                                       "overhead_q3": round(hi, 4)}
    if args.sink_split:
        binary = TraceWriter(trace_path + binary_trace.SUFFIX, runner.cache.header())
        sinks = {"json": writer.write_many, "msgpack": binary.write_many, "discard": lambda events: None}
        for name, prompts in (("sinks_batch1", batch1), ("sinks_batch8", batch8)):
            results[name] = sink_split(runner, sinks, prompts, E, args.sink_split)
        binary.close()
    for name, prompts in (("digests_batch1", batch1), ("digests_batch8", batch8)):
        for mode in ("sample", "full"):
            results[f"{name}_{mode}_share"] = digest_share(runner, writer.write_many, prompts, E, mode)
            if args.digest_pairs:
                results[f"{name}_{mode}"] = digests_paired(runner, writer.write_many, prompts, E, mode,
                                                           args.digest_pairs)
    writer.close()
    results["event_tokens"] = E
    results["trace_bytes"] = os.path.getsize(trace_path)
    results["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    results["rss_end_mb"] = _rss_mb()
    results["rss_end_anon_mb"], results["rss_end_file_mb"] = _rss_mb("RssAnon"), _rss_mb("RssFile")
    results["load_after"] = os.getloadavg()[0]
    runner.close()
    if args.json:
        print(json.dumps(results))
        return 0
    for name, _, _ in scenarios if not args.only_events else ():
        for clock in ("cpu", "wall"):
            r = results[name][clock]
            print(f"{name} ({clock} clock): transformers {r['transformers']:.2f} tok/s, runner {r['runner']:.2f} tok/s, "
                  f"speedup {r['speedup']:.2f}x (median of {args.repeats} pairs; quartiles "
                  f"{r['speedup_q1']:.2f}-{r['speedup_q3']:.2f})")
    for kind, pairs in (("layers", args.layer_pairs), ("pages", args.page_pairs)):
        for name, _, _ in scenarios if pairs else ():
            r = results[f"{name}_{kind}"]["wall"]
            base, ours = _AGAINST[kind]
            print(f"{name} {kind} (wall clock): {base} {r['baseline']:.2f} tok/s, {ours} {r['runner']:.2f} tok/s, "
                  f"speedup {r['speedup']:.2f}x (median of {pairs} pairs; quartiles {r['speedup_q1']:.2f}-"
                  f"{r['speedup_q3']:.2f})")
    for name in [n for n in results if n.startswith("events_batch") and not n.endswith("_parts")]:
        p = results[f"{name}_parts"]
        print(f"{name} inside the event path: {p['total']:.3f} ms a listened step (" +
              ", ".join(f"{label} {ms:.3f}" for label, ms in p.items() if label != "total") + "; medians)")
        for clock in ("cpu", "wall"):
            r = results[name][clock]
            print(f"{name} on vs off ({clock} clock): step {r['off_ms']:.1f} ms off, {r['on_ms']:.1f} ms on, "
                  f"overhead {100 * r['overhead']:+.1f}% (median of {results[name]['pairs']} neighbouring step "
                  f"pairs; quartiles {100 * r['overhead_q1']:+.1f}% to {100 * r['overhead_q3']:+.1f}%)")
    for name in ("sinks_batch1", "sinks_batch8") if args.sink_split else ():
        r = results[name]["wall"]
        parts = [f"{sink} {v['extra_ms']:+.3f} ms ({100 * v['share']:+.1f}%; {100 * v['share_q1']:+.1f}% to "
                 f"{100 * v['share_q3']:+.1f}%)" for sink, v in r.items() if sink != "off_ms"]
        print(f"{name} (wall clock, median of {results[name]['cycles']} cycles; quartiles): step {r['off_ms']:.1f} ms "
              "unlistened, listened by " + ", ".join(parts))
    for name in ("digests_batch1", "digests_batch8"):
        for mode in ("sample", "full"):
            r = results[f"{name}_{mode}_share"]
            print(f"{name} {mode}: {r['digest_ms']:.3f} ms per step inside the digest code, "
                  f"{100 * r['share']:.2f}% of a {r['step_ms']:.1f} ms step ({r['steps']} steps, "
                  f"{r['calls_per_step']} timed calls a step)")
            for clock in ("cpu", "wall") if args.digest_pairs else ():
                r = results[f"{name}_{mode}"][clock]
                print(f"{name} {mode} vs off, every event on ({clock} clock): {r['off_tok_s']:.2f} -> "
                      f"{r[mode + '_tok_s']:.2f} tok/s, overhead {100 * r['overhead']:+.1f}% (median of "
                      f"{args.digest_pairs} whole-run pairs; quartiles {100 * r['overhead_q1']:+.1f}% to "
                      f"{100 * r['overhead_q3']:+.1f}%)")
    if args.bound_repeats:
        b = results["bound"]
        print(f"bandwidth bound ({args.dtype}): one row through every projection reads {b['weight_mb']:.0f} MB in "
              f"{b['ms']:.2f} ms (median of {args.bound_repeats}): {b['gb_s']:.1f} GB/s, so batch 1 <= "
              f"{b['tok_s']:.1f} tok/s")
        r = results["batch1_bound_share"]["wall"]
        print(f"batch1 against the bound measured beside each run (wall clock): bound {r['bound']:.1f} tok/s, runner "
              f"{r['runner']:.1f} tok/s, {100 * r['share']:.0f}% of the bound (median of {args.repeats} pairs; "
              f"quartiles {100 * r['share_q1']:.0f}-{100 * r['share_q3']:.0f}%)")
    print(f"peak RSS {results['peak_rss_mb']} MB (after loading {results['rss_after_load_mb']} MB, at the end "
          f"{results['rss_end_mb']} MB: {results['rss_end_anon_mb']} MB own, {results['rss_end_file_mb']} MB of mapped "
          f"files), dtype {args.dtype}, threads {results['threads']}, new tokens {N}, "
          f"trace {results['trace_bytes']} bytes, load average {results['load_before']:.1f} -> {results['load_after']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
