"""``kvdoctor doctor``: what this machine supports — GPU and NVML, py-spy and ptrace,
torch/CUDA and transformers, free disk for the disk tier, the embedded model.

It describes the machine and exits 0 whatever it finds; only a usage error exits 2.
"""

from __future__ import annotations

import argparse
import json

NAME = "doctor"
HELP = "show what this machine supports: GPU/NVML, py-spy/ptrace, torch/CUDA, disk tier, embedded model"

_MARK = {True: "ok", False: "NO", None: "--"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--disk-dir", metavar="DIR", help="where the disk tier would spill (default: the system temp dir)")
    p.add_argument("--no-dump-test", action="store_true",
                   help="judge ptrace from settings only, without dumping a throwaway child with py-spy")


def run(args: argparse.Namespace) -> int:
    from ..probes.machine import inspect_machine

    items = inspect_machine(disk_dir=args.disk_dir, try_dump=not args.no_dump_test)
    if args.json:
        print(json.dumps({"items": [i.to_dict() for i in items]}, default=str))
        return 0
    width = max(len(i.name) for i in items)
    for item in items:
        print(f"{_MARK[item.ok]:>2}  {item.name:<{width}}  {item.summary}")
        if item.fix and item.ok is not True:
            print(f"    {'':<{width}}  fix: {item.fix}")
        elif item.fix:
            print(f"    {'':<{width}}  note: {item.fix}")
    return 0
