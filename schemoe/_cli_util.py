"""Shared by the sub-command modules: turn a command's expected failures into an error line."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

__all__ = ["guard"]


def guard(
    prog: str, fn: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    """`fn`, except that ValueError, RuntimeError, OSError (PermissionError, FileNotFoundError,
    NotADirectoryError, TimeoutError, ...) and FloatingPointError (a diverged run's
    NonFiniteError) print "`prog`: error: ..." to stderr and return exit status 2 instead of a
    traceback. The result pickles when `fn` does (the parsed arguments, which carry it, are
    handed to spawned ranks)."""
    return functools.partial(_call, prog, fn)


def _call(prog: str, fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return fn(args)
    except (ValueError, RuntimeError, OSError, FloatingPointError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
