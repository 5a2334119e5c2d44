"""A clean corpus for the checks: SmolLM2 requests through kvdoctor's engine, every check live, and the
engine's faults on small workloads; reports false findings and recall.

A doctor that cries wolf gets switched off, so every check must stay silent on healthy runs of the
real engine, while each deliberate fault is still caught with the right sequence and block. This
script makes both measurable without committed traces: it builds its requests from text that ships
with Python (``pydoc_data.topics``) and the demo's chat prompts, and runs them through a set of
scenarios that cover what the engine can do:

- chat (the model's template) and raw prompts of 5 to 1500 tokens, greedy and sampled decoding;
- every codec (fp32, fp16, bf16, int8, nf4, mixed, one per tier), block-sparse top-k reads;
- preemption by swap through host and disk (small device and host tiers), and by recompute.

Each scenario runs its share of the requests through one ``Runner`` and ``Scheduler`` with every
check subscribed to the bus (a live ``Session``, the default configuration, so the shipped
attention profile of the embedded model applies). False findings are counted per rule and per 1000
sequence-steps (a sequence computed in one engine step: one prefill chunk or one decode token).

Recall runs each engine fault on a small workload of its own and counts it caught when its rule
fires naming a sequence (and block) that the engine's own state confirms; then two corruptions of
one layer's attention scores that no engine fault makes yet (keys at 2x and 4x their scale), which
the attention check must name with the right layer.

Usage::

    .venv/bin/python benchmarks/corpus.py                     # 500 requests, then the faults
    .venv/bin/python benchmarks/corpus.py --requests 40       # a quick subset (same scenarios)
    .venv/bin/python benchmarks/corpus.py --only int8,disk --requests 20 --skip-faults --json
    .venv/bin/python benchmarks/corpus.py --learn-profile prof.json --seed 1   # a profile from this corpus
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdoctor.engine.faults import CONTENT_FAULTS

MIN_PROMPT, MAX_PROMPT = 5, 1500


@dataclass(frozen=True)
class Scenario:
    """One engine configuration the corpus runs a share of its requests through."""

    name: str
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    codec: str | None = None  # kvdoctor.compression's --codec (brings an int8 calibration when needed)
    topk: int = 0
    max_batch: int = 6
    max_step_tokens: int = 512  # long prompts are prefilled in chunks
    pressure: bool = False  # requests arrive over time with random priorities: newcomers preempt, swapped ones abort
    abort_rate: float = 0.05  # under pressure: chance per step that a client abandons a swapped-out request
    fault: str | None = None
    verify: str = "full"  # every read's K/V checked against its digest: a clean corpus must not trip integrity
    note: str = ""


SCENARIOS = (
    Scenario("fp32", note="the model's dtype, roomy tiers"),
    Scenario("fp16", codec="fp16"),
    Scenario("bf16", codec="bf16"),
    Scenario("int8", codec="int8"),
    Scenario("nf4", codec="nf4"),
    Scenario("mixed", codec="mixed", note="unimportant blocks demoted to nf4 on the device"),
    Scenario("tiers", pressure=True, codec="device=fp16,host=int8,disk=nf4",
             engine={"device_blocks": 100, "host_blocks": 40, "disk_blocks": 512}, max_batch=8,
             note="a codec per tier; small device and host tiers: swaps to host and on to disk"),
    Scenario("disk", pressure=True, engine={"device_blocks": 100, "host_blocks": 24, "disk_blocks": 512}, max_batch=8,
             note="fp32, preemption through host and disk"),
    Scenario("recompute", pressure=True, engine={"device_blocks": 100, "host_blocks": 0}, max_batch=8,
             note="no slower tier: preempted requests are dropped and recomputed"),
    Scenario("topk", topk=4, note="block-sparse top-k reads (4 blocks + sink + window)"),
)


@dataclass
class Tally:
    """What a set of runs gave: findings per rule, and how much work they judged."""

    requests: int = 0
    seq_steps: int = 0
    steps: int = 0
    tokens: int = 0
    events: int = 0
    preempted: int = 0
    swaps: Counter = field(default_factory=Counter)  # swap_out events by destination tier
    seconds: float = 0.0
    findings: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    found: list = field(default_factory=list, repr=False)  # the findings themselves
    leaked: set = field(default_factory=set, repr=False)  # blocks the engine still held with no live owner at the end
    fault_hit: dict | None = field(default=None, repr=False)  # where a content fault corrupted bytes (engine's record)

    def add(self, other: "Tally") -> None:
        for name in ("requests", "seq_steps", "steps", "tokens", "events", "preempted", "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.findings.update(other.findings)
        self.swaps.update(other.swaps)
        for rule, text in other.examples.items():
            self.examples.setdefault(rule, text)

    def as_dict(self) -> dict[str, Any]:
        per_k = {rule: 1000.0 * n / max(self.seq_steps, 1) for rule, n in sorted(self.findings.items())}
        return {"requests": self.requests, "seq_steps": self.seq_steps, "steps": self.steps, "tokens": self.tokens,
                "events": self.events, "preempted": self.preempted, "swaps": dict(self.swaps),
                "seconds": round(self.seconds, 1),
                "findings": dict(sorted(self.findings.items())), "per_1000_seq_steps": per_k,
                "examples": self.examples}


# ---- requests ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One request: its prompt ids, how it was built, how it decodes."""

    ids: list[int]
    chat: bool
    greedy: bool
    max_new_tokens: int
    seed: int


def _text() -> str:
    from kvdoctor.engine.kv.codecs import calibration_text

    return calibration_text()


def make_requests(tokenizer: Any, n: int, seed: int, *, new_tokens: tuple[int, int]) -> list[Spec]:
    """``n`` requests, half chat and half raw, prompt lengths log-uniform in [5, 1500] tokens."""
    from kvdoctor.demo import PROMPTS

    rng = random.Random(seed)
    text_ids = tokenizer(_text())["input_ids"]
    topics = sorted(__import__("pydoc_data.topics", fromlist=["topics"]).topics)
    out = []
    for i in range(n):
        want = int(math.exp(rng.uniform(math.log(MIN_PROMPT), math.log(MAX_PROMPT))))
        chat = i % 2 == 0
        start = rng.randrange(0, len(text_ids) - MAX_PROMPT)
        if chat:
            # a question, with a passage to read when the prompt is to be long
            question = rng.choice(PROMPTS) if rng.random() < 0.5 else (
                f"Explain the Python topic '{rng.choice(topics)}' briefly.")
            ids = _chat(tokenizer, question)
            if want > len(ids) + 8:
                passage = tokenizer.decode(text_ids[start:start + want - len(ids)])
                ids = _chat(tokenizer, f"{question}\n\n{passage}")[:MAX_PROMPT]
        else:
            ids = list(text_ids[start:start + want])
        out.append(Spec(ids=[int(t) for t in ids], chat=chat, greedy=rng.random() < 0.5,
                        max_new_tokens=rng.randint(*new_tokens), seed=rng.randrange(1 << 30)))
    return out


def _chat(tokenizer: Any, content: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ---- running ----------------------------------------------------------------------------------------


def build_runner(lm: Any, scenario: Scenario):
    from kvdoctor.compression import engine_settings
    from kvdoctor.engine.serving.runner import Runner

    settings = {"block_size": 16, "device_blocks": 512, "host_blocks": 512, **scenario.engine}
    settings.update(engine_settings(scenario.codec, scenario.topk, lm))
    return Runner.create(lm.model, tokenizer=lm.tokenizer, fault=scenario.fault, verify=scenario.verify,
                         extra={"model": lm.name}, **settings)


def run_scenario(lm: Any, scenario: Scenario, specs: list[Spec], *, config: Any = None,
                 listeners: tuple = (), corrupt: Any = None, record: Recorder | None = None) -> Tally:
    """Every request of ``specs`` through one engine built for ``scenario``, checked live. ``corrupt``
    (a function of the scaled scores) is applied to the middle layer's attention from step 2 on;
    ``record`` keeps the run's events, tokens and findings for a before/after diff."""
    from kvdoctor.engine.serving.runner import SamplingParams
    from kvdoctor.engine.serving.scheduler import Request, Scheduler
    from kvdoctor.events import SwapOut
    from kvdoctor.session import Session

    runner = build_runner(lm, scenario)
    if corrupt is not None:
        # The hook the attention-nan fault uses, here with another corruption: what a mis-scaled or
        # zeroed K does to one layer's scores. Set on this cache only; the engine is not changed.
        middle = lm.config.num_hidden_layers // 2
        runner.cache.score_hook = lambda layer: corrupt if layer == middle and runner.bus.step >= 2 else None
    session = Session.on_bus(runner.bus, config, header=runner.cache.header())
    for listen in listeners + ((record.events,) if record is not None else ()):
        runner.bus.subscribe(listen)
    sched = Scheduler(runner, max_batch=scenario.max_batch, max_step_tokens=scenario.max_step_tokens)
    tally = Tally(requests=len(specs))
    runner.bus.subscribe(lambda evs: tally.swaps.update(str(getattr(e.dst, "value", e.dst))
                                                        for e in evs if type(e) is SwapOut))
    queue = list(reversed(specs))
    rng = random.Random(len(specs))
    t0 = time.perf_counter()
    while queue or sched.has_work():
        # Under pressure requests arrive a few at a time with random priorities, so a newcomer of higher
        # priority preempts running ones (swap to host, on to disk, or recompute) and some swapped-out
        # requests are abandoned by their clients, as in serving; otherwise every request is queued at once.
        while queue and (not scenario.pressure or len(sched.live) < scenario.max_batch + 2):
            spec = queue.pop()
            sampling = SamplingParams(greedy=True) if spec.greedy else SamplingParams(
                greedy=False, temperature=0.8, top_p=0.95, seed=spec.seed)
            sched.submit(Request(spec.ids, max_new_tokens=spec.max_new_tokens, sampling=sampling,
                                 priority=rng.randrange(3) if scenario.pressure else 0,
                                 ignore_eos=scenario.fault is not None))
        if scenario.pressure:
            swapped = [seq for seq, live in sched.live.items() if live.state == "swapped"]
            if swapped and rng.random() < scenario.abort_rate:
                sched.abort(rng.choice(swapped))
        result = sched.step()
        tally.steps += 1
        tally.seq_steps += len(result.rows)
        tally.tokens += result.num_tokens
        tally.preempted += len(result.preempted)
        if record is not None:
            record.tokens.extend([str(g.seq), g.token_ids, g.finish_reason] for g in result.finished)
    tally.seconds = time.perf_counter() - t0
    cache = runner.cache
    tally.leaked = cache.ownerless_blocks()
    tally.fault_hit = cache.faults.hit
    runner.close()
    session.close()
    tally.events = session.num_events
    tally.found = list(session.findings)
    if record is not None:
        record.save(scenario.name, tally.found)
    for f in session.findings:
        key = f"{f.check}/{f.rule}"
        tally.findings[key] += 1
        tally.examples.setdefault(key, f"[{scenario.name}] {f.message}")
    return tally


class Recorder:
    """A run's events (without wall-clock fields), finished tokens and findings, written to ``DIR/NAME.*``
    so two commits' runs of the same corpus can be compared with ``diff -r``: a refactoring that changes
    no behaviour leaves every file equal."""

    _CLOCK = ("t", "duration_ns")

    def __init__(self, directory: str) -> None:
        from pathlib import Path

        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lines: list[str] = []
        self.tokens: list[list] = []

    def events(self, events: list) -> None:
        from kvdoctor.events import to_dict

        for e in events:
            d = to_dict(e)
            if d["kind"] != "mem":  # memory probes read the process, not the engine
                self.lines.append(json.dumps({k: v for k, v in d.items() if k not in self._CLOCK}))

    def save(self, name: str, findings: list) -> None:
        (self.dir / f"{name}.events.jsonl").write_text("\n".join(self.lines) + "\n")
        (self.dir / f"{name}.tokens.json").write_text(json.dumps(self.tokens) + "\n")
        rows = [[f.check, f.rule, f.severity, str(f.seq), f.block, f.layer, f.step, f.message] for f in findings]
        (self.dir / f"{name}.findings.json").write_text("\n".join(map(json.dumps, rows)) + "\n")
        self.lines, self.tokens = [], []


# ---- recall on the engine's faults --------------------------------------------------------------------


@dataclass
class FaultResult:
    fault: str
    rule: str
    caught: bool
    right_target: bool
    findings: int
    detail: str


def _owned_by(finding: Any, seq: Any) -> bool:
    """The finding's block was allocated to or shared with ``seq``, as its history shows."""
    return any(e.get("seq") == seq and e.get("kind") in ("alloc", "share") for e in finding.evidence.get("history", ()))


def _target_layer(hits: list, lm: Any) -> bool:
    """Every finding names a sequence, and the first layer reported is the corrupted middle one."""
    return bool(hits) and min(f.layer for f in hits) == lm.config.num_hidden_layers // 2 and all(
        f.seq is not None for f in hits)


def run_fault(lm: Any, fault: str, rule: str, specs: list[Spec], corrupt: Any = None,
              record: Recorder | None = None) -> FaultResult:
    """``fault`` on a small workload that exercises it: a 12-block device tier and random priorities
    (preemption by swap, blocks that go down and come back up several times), clients abandoning
    swapped-out requests, batches of several rows, greedy decoding to the full length."""
    engine_fault = fault if corrupt is None else None
    scenario = Scenario(fault, engine={"device_blocks": 12, "host_blocks": 96, "disk_blocks": 0}, max_batch=4,
                        pressure=True, abort_rate=0.3 if fault == "leak-swapped" else 0.0, fault=engine_fault,
                        codec="nf4" if fault == "wrong-scale" else None)  # a scale exists only where codes are stored
    greedy = [Spec(s.ids, s.chat, True, s.max_new_tokens, s.seed) for s in specs]
    tally = run_scenario(lm, scenario, greedy, corrupt=corrupt, record=record)

    def matches(f: Any) -> bool:  # a rule "check/rule", or a whole check for the content faults
        return f"{f.check}/{f.rule}" == rule or f.check == rule

    hits = [f for f in tally.found if matches(f)]
    others = Counter(f"{f.check}/{f.rule}" for f in tally.found if not matches(f))
    if fault in CONTENT_FAULTS:
        # the first finding names the block, sequence, step (and layer) where the engine corrupted the bytes
        hit, first = tally.fault_hit, hits[0] if hits else None
        right = first is not None and hit is not None and (first.block, first.seq, first.step) == (
            hit["block"], hit["seq"], hit["step"]) and hit["layer"] in (None, first.layer)
    elif fault == "leak-swapped":
        # the engine itself still holds the forgotten blocks: each must be named, by its last owner
        right = bool(hits) and {f.block for f in hits} == tally.leaked and all(_owned_by(f, f.seq) for f in hits)
    elif fault == "attention-nan" or corrupt is not None:
        right = _target_layer(hits, lm)
    elif fault == "batch-misalign":
        right = bool(hits) and all(not _owned_by(f, f.seq) and f.evidence.get("owners") for f in hits)
    else:  # stale-version: the block the finding names is the sequence's, and the copy really was older
        right = bool(hits) and all(_owned_by(f, f.seq) and f.evidence["seen_version"] < f.evidence["last_write_version"]
                                   for f in hits)
    detail = (f"{len(hits)} x {rule}, naming {len({f.seq for f in hits})} of {tally.requests} sequences, "
              f"{tally.preempted} preemptions" + (f"; also {dict(others)}" if others else ""))
    return FaultResult(fault, rule, bool(hits), right, len(hits), detail)


FAULT_RULES = {
    "leak-swapped": "leak/unreachable-swapped",
    "stale-version": "stale/stale-swap-in",
    "batch-misalign": "batch/write-not-owned",
    "attention-nan": "attention/nonfinite",
    **{fault: "integrity" for fault in CONTENT_FAULTS},  # bytes wrong, every event right: only digests see it
}

# Corruptions of the middle layer's scaled scores (through the hook attention-nan uses): keys at 2x or
# 4x their scale (a wrong dequantisation scale). Keys read as zeros are left out on purpose: a prompt of
# repeated <|endoftext|> gives the same statistics, so attention is no evidence of them.
CORRUPTIONS = {
    "scores-x2": (lambda scores: scores.mul_(2.0), "attention/max-logit-outlier"),
    "scores-x4": (lambda scores: scores.mul_(4.0), "attention/max-logit-outlier"),
}


# ---- report ----------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "load": [round(x, 2) for x in os.getloadavg()],
            "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=500, help="requests in all, spread over the scenarios (default 500)")
    p.add_argument("--only", help="comma-separated scenario names (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the requests (prompts, lengths, sampling)")
    p.add_argument("--new-tokens", default="8,32", help="MIN,MAX new tokens per request (default 8,32)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a shared machine more threads spin and run slower)")
    p.add_argument("--skip-faults", action="store_true", help="only the clean corpus")
    p.add_argument("--skip-clean", action="store_true", help="only the faults")
    p.add_argument("--faults", help="comma-separated faults and corruptions to run (default: all)")
    p.add_argument("--learn-profile", metavar="OUT", help="also learn an attention profile from the corpus into OUT")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--record", metavar="DIR", help="write each run's events, tokens and findings to DIR (diff two commits)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lo, hi = (int(x) for x in args.new_tokens.split(","))
    scenarios = [s for s in SCENARIOS if not args.only or s.name in args.only.split(",")]
    if not scenarios:
        p.error(f"--only {args.only}: none of {', '.join(s.name for s in SCENARIOS)}")

    from kvdoctor.engine.model.model import load_model

    lm = load_model()
    t_start = time.perf_counter()
    out: dict[str, Any] = {"machine": machine(), "command": " ".join(sys.argv), "scenarios": {}}
    total = Tally()
    learner = None
    record = Recorder(args.record) if args.record else None
    if args.learn_profile:
        from kvdoctor.checks.attention_profile import ProfileBuilder

        learner = ProfileBuilder(model=lm.name)
    if not args.skip_clean:
        specs = make_requests(lm.tokenizer, args.requests, args.seed, new_tokens=(lo, hi))
        share = [specs[i::len(scenarios)] for i in range(len(scenarios))]
        for scenario, part in zip(scenarios, share):
            if not part:
                continue
            listeners = (learner.feed,) if learner is not None else ()
            tally = run_scenario(lm, scenario, part, listeners=listeners, record=record)
            total.add(tally)
            out["scenarios"][scenario.name] = tally.as_dict()
            print(f"{scenario.name:10} {tally.requests:4} requests {tally.seq_steps:6} seq-steps "
                  f"{tally.preempted:4} preempted, swaps out {dict(tally.swaps) or 0} {tally.seconds:6.1f}s "
                  f"findings {dict(tally.findings) or 0}",
                  file=sys.stderr, flush=True)
        out["total"] = total.as_dict()
    if learner is not None:
        learner.profile().save(args.learn_profile)
        print(f"wrote attention profile {args.learn_profile} ({learner.num_events} attn events)", file=sys.stderr)
    if not args.skip_faults:
        fault_specs = make_requests(lm.tokenizer, 40, args.seed + 1000, new_tokens=(12, 24))
        fault_specs = [s for s in fault_specs if len(s.ids) <= 120][:12]
        results = []
        runs = [(fault, rule, None) for fault, rule in FAULT_RULES.items()]
        runs += [(name, rule, fn) for name, (fn, rule) in CORRUPTIONS.items()]
        runs = [r for r in runs if not args.faults or r[0] in args.faults.split(",")]
        for fault, rule, corrupt in runs:
            r = run_fault(lm, fault, rule, fault_specs, corrupt, record)
            results.append(r)
            print(f"fault {fault:15} caught={r.caught} right_target={r.right_target} {r.detail}",
                  file=sys.stderr, flush=True)
        out["faults"] = [r.__dict__ for r in results]
    out["machine"]["load_end"] = [round(x, 2) for x in os.getloadavg()]
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(render(out))
    return 0


def render(out: dict[str, Any]) -> str:
    lines = [f"machine: {out['machine']}", ""]
    if "total" in out:
        t = out["total"]
        lines.append(f"clean corpus: {t['requests']} requests, {t['seq_steps']} sequence-steps, {t['steps']} steps, "
                     f"{t['tokens']} tokens, {t['events']} events, {t['preempted']} preemptions, {t['seconds']} s")
        lines.append("| scenario | requests | seq-steps | preempted | swaps out to host / disk | findings |")
        lines.append("|---|---|---|---|---|---|")
        for name, s in out["scenarios"].items():
            swaps = s["swaps"]
            lines.append(f"| {name} | {s['requests']} | {s['seq_steps']} | {s['preempted']} | "
                         f"{swaps.get('host', 0)} / {swaps.get('disk', 0)} | {sum(s['findings'].values())} |")
        lines.append("")
        lines.append("false findings per 1000 sequence-steps, by rule: "
                     + (", ".join(f"{r} {v:.3f}" for r, v in t["per_1000_seq_steps"].items()) or "none"))
        for rule, text in t["examples"].items():
            lines.append(f"  e.g. {rule}: {text}")
    for r in out.get("faults", ()):
        lines.append(f"fault {r['fault']:15} {'caught' if r['caught'] else 'MISSED':7} "
                     f"{'right target' if r['right_target'] else 'WRONG TARGET'}  {r['detail']}")
    lines.append(f"total {out['seconds']} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
