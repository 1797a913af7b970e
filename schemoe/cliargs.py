"""Shared by the sub-command modules: the error guard that turns a command's expected failures
into one error line, and the help formatter every parser uses (defaults and choices shown)."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

__all__ = ["HelpFormatter", "Parser", "guard", "show_default"]


def show_default(default: object) -> str | None:
    """How `--help` spells a default: lists comma-joined (as the flags take them), None, False
    and empty lists not at all (nothing to show: the help text says what happens instead)."""
    if default is None or default is False or default is argparse.SUPPRESS or default == []:
        return None
    if isinstance(default, list | tuple):
        return ",".join(str(v) for v in default)
    return str(default)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks (they are written as docstrings); every option's help
    ends with "(default: X)" when it has a default worth showing. Choices show in the metavar."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = show_default(action.default)
        if shown is None or not action.option_strings or "%(default)" in text:
            return text
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help uses HelpFormatter; its sub-parsers (add_subparsers makes
    them of the parser's own class) do too."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)
        self.record_explicit = False  # set by a command that needs to know what was typed

    def parse_known_args(self, args=None, namespace=None):
        """As ArgumentParser's; with `record_explicit`, the result's `explicit` attribute is the
        sorted dests given on the command line (a flag typed with its default value counts)."""
        ns, rest = super().parse_known_args(args, namespace)
        if self.record_explicit:
            saved = {act: act.default for act in self._actions}
            try:
                for act in self._actions:
                    act.default = None  # no flag yields None when typed
                seen, _ = super().parse_known_args(args, None)
            finally:
                for act, default in saved.items():
                    act.default = default
            dests = {act.dest for act in self._actions}
            ns.explicit = sorted(k for k, v in vars(seen).items() if v is not None and k in dests)
        return ns, rest


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
