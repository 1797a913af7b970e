"""Shared by the sub-command modules: turn a command's expected failures into an error line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

__all__ = ["guard"]


def guard(
    prog: str, fn: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    """`fn`, except that ValueError, RuntimeError, PermissionError, FileNotFoundError and
    TimeoutError print "`prog`: error: ..." to stderr and return exit status 2 instead of a
    traceback."""

    def call(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (ValueError, RuntimeError, PermissionError, FileNotFoundError, TimeoutError) as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2

    return call
