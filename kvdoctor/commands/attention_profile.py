"""``kvdoctor attention-profile TRACE... -o OUT.json``: learn a model's normal attention from clean traces.

The attention check judges a trace against the ranges a model's layers show in clean runs.
kvdoctor ships them for its embedded SmolLM2; for another model, record a few clean traces
that cover the lengths and settings it serves (chat and raw prompts, short and long, the
codecs in use) and learn a profile from them::

    kvdoctor run --model ./my-model --prompt "..." --trace clean1.kvtrace      # or any producer's traces
    kvdoctor attention-profile clean*.kvtrace -o my-model.json
    kvdoctor check --trace serve.kvtrace --attention-profile my-model.json   # or attention_profile in the config

A profile is only as good as the runs it saw: a trace with an attention finding of its own
(``nonfinite``) is refused, since it is not clean.
"""

from __future__ import annotations

import argparse
import sys

NAME = "attention-profile"
HELP = "learn a model's normal attention ranges from clean traces, for `kvdoctor check --attention-profile`"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n\n", 1)[1]
    p.add_argument("traces", nargs="+", metavar="TRACE", help="clean traces of one model (.kvtrace or .kvtrace.gz)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.json", help="where to write the profile")
    p.add_argument("--model", help="the model's name in the profile (default: the first trace header's model)")


def run(args: argparse.Namespace) -> int:
    from ..checks import ProfileBuilder
    from ..errors import UsageError
    from ..events import attn_rows
    from ..trace import TraceReader

    readers = [TraceReader(path) for path in args.traces]  # every header read first: a bad trace fails at once
    models = {r.header.model for r in readers if r.header.model}
    if len(models) > 1 and not args.model:
        raise UsageError(f"the traces are of different models ({', '.join(sorted(models))}): one profile per model")
    builder = ProfileBuilder(model=args.model or next(iter(models), None))
    for reader in readers:
        for batch in reader.batches():
            for ev in attn_rows(batch):
                if ev.nonfinite:
                    raise UsageError(f"{reader.path}: non-finite attention at step {ev.step}, layer {ev.layer}: "
                                     "not a clean trace")
            builder.feed(batch)
    try:
        profile = builder.profile()
    except ValueError as exc:
        raise UsageError(f"{exc} in {', '.join(args.traces)}") from None
    try:
        profile.save(args.output)
    except OSError as exc:
        raise UsageError(f"cannot write {args.output}: {exc.strerror}") from None
    print(f"kvdoctor attention-profile: wrote {args.output}: {len(profile.layers)} layers, "
          f"{profile.num_events} attn events, model {profile.model or '(unnamed)'}", file=sys.stderr)
    return 0
