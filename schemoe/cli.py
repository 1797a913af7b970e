"""`schemoe <command> ...`: each command lives in its own module that provides
`register(subparsers)`; the parser it adds sets `func(args) -> int`."""

from __future__ import annotations

import importlib
import sys

from . import __version__
from ._cli_util import Parser

__all__ = ["build_parser", "main"]

# Modules that add sub-commands, in help order.
COMMANDS = [
    "schemoe.train",
    "schemoe.checkpoint",
    "schemoe.testbed.cli",
    "schemoe.bench.cli",
    "schemoe.profiler.cli",
]

DESCRIPTION = """\
Mixture-of-Experts training with expert parallelism on torch.distributed: train a model,
export checkpoints, benchmark layers and steps, fit and query the cost model, and emulate a
multi-node cluster. `schemoe COMMAND --help` lists each command's flags and defaults."""


def build_parser() -> Parser:
    parser = Parser(prog="schemoe", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"schemoe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in COMMANDS:
        importlib.import_module(mod).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
