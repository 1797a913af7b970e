"""`schemoe <command> ...`: each command lives in its own module that provides
`register(subparsers)`; the parser it adds sets `func(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

# Modules that add sub-commands, in help order.
COMMANDS = [
    "schemoe.train",
    "schemoe.checkpoint",
    "schemoe.testbed.cli",
    "schemoe.bench.cli",
    "schemoe.profiler.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="schemoe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in COMMANDS:
        importlib.import_module(mod).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
