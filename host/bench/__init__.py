"""Benchmarks that print figures against a baseline measured in the same run.

Every benchmark module offers ``add_arguments(parser)`` (calling :func:`add_common`) and
``run(args)``; heavy imports happen inside ``run`` so ``thc --help`` stays fast.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="write results as JSON to FILE (stdout when no FILE is given)")
    parser.add_argument("--quick", action="store_true", help="small sizes, for smoke tests")


def emit_json(args: argparse.Namespace, result: dict) -> None:
    """Write ``result`` where ``--json`` asked for it."""
    if args.json is None:
        return
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.json == "-":
        sys.stdout.write(text + "\n")
    else:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
        print(f"wrote {args.json}")
