"""`schemoe <command> ...`: each command lives in its own module that provides
`register(subparsers)`; the parser it adds sets `func(args) -> int`. The commands are imported
here, so the import graph is the real one."""

from __future__ import annotations

import signal
import sys

from . import __version__
from .bench import cli as bench_cli
from .checkpoint import store as checkpoint_cli
from .cliargs import Parser
from .dist.lifeline import Interrupted
from .profile import cli as profile_cli
from .testbed import cli as testbed_cli
from .train import command as train_cli

__all__ = ["build_parser", "main"]

# Modules that add sub-commands, in help order.
COMMANDS = [train_cli, checkpoint_cli, testbed_cli, bench_cli, profile_cli]

DESCRIPTION = """\
Mixture-of-Experts training with expert parallelism on torch.distributed: train a model,
export checkpoints, benchmark layers and steps, fit and query the cost model, and emulate a
multi-node cluster. `schemoe COMMAND --help` lists each command's flags and defaults."""


def build_parser() -> Parser:
    parser = Parser(prog="schemoe", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"schemoe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in COMMANDS:
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except Interrupted as e:  # its ranks are stopped: one line, exit 128 + signal
        print(f"schemoe {args.command}: {e}", file=sys.stderr, flush=True)
        return int(e.code)
    except KeyboardInterrupt:  # Ctrl-C outside a run of ranks (reading a checkpoint, ...)
        print(f"schemoe {args.command}: interrupted by SIGINT", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
