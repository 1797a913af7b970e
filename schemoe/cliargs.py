"""Shared by the sub-command modules: the parser every command uses (defaults and choices shown
in --help; errors on one line; flag checks attached per flag and run right after parsing), the
error guard that turns a command's expected failures into one error line, and the comma-list
types.

Every flag value is checked in the process that parsed it, before any rank starts or any process
is spawned: a range per flag (`Check`, attached with `Parser.add_checks`: FLAG_CHECKS, the one
table of the flags several commands share, then the command's own), then what a command knows
only from several flags (its own validate function, raising ValueError through `guard`).
`schemoe train` applies FLAG_CHECKS through TrainConfig (train/checks.py), in the same words.
Either way the user reads one line, `schemoe bench layer: error: --model-dim must be >= 1, got 0`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import shlex
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

__all__ = [
    "FLAG_CHECKS",
    "Check",
    "HelpFormatter",
    "Parser",
    "add_layer_shape",
    "flag_problem",
    "float_list",
    "for_flag",
    "guard",
    "int_list",
    "names",
    "show_default",
]


def show_default(default: object) -> str | None:
    """How `--help` spells a default: lists comma-joined (as the flags take them), None, False
    and empty lists not at all (nothing to show: the help text says what happens instead)."""
    if default is None or default is False or default is argparse.SUPPRESS or default == []:
        return None
    if isinstance(default, list | tuple):
        return ",".join(str(v) for v in default)
    return str(default)


def names(text: str) -> list[str]:
    """A comma list as typed ("a, b,,c" -> ["a", "b", "c"]); "" -> [] (a Check refuses it)."""
    return [t.strip() for t in text.split(",") if t.strip()]


def int_list(text: str) -> list[int]:
    """A comma list of ints ("1,2" -> [1, 2]); argparse reports "invalid int_list value"."""
    return [int(v) for v in names(text)]


def float_list(text: str) -> list[float]:
    """A comma list of numbers ("1,1.5" -> [1.0, 1.5]); argparse reports "invalid float_list
    value"."""
    return [float(v) for v in names(text)]


def add_layer_shape(
    add: Callable[..., object],
    *,
    tokens: int | None,
    model_dim: int | None,
    hidden_dim: int | None,
    capacity_factor: float,
    shared_help: str,
    tokens_help: str = "tokens per rank",
    hidden_dest: str = "hidden_dim",
) -> None:
    """The flags of one MoE layer's shape, for the commands that take one (`bench layer`,
    `profile simulate`): one spelling and one meaning each. `add` is a parser's (or argument
    group's) add_argument; a default of None means the command requires the flag."""

    def needed(text: str, default: object) -> str:
        return f"{text} (required)" if default is None else text

    add("--tokens", type=int, default=tokens, help=tokens_help)
    add("--model-dim", type=int, default=model_dim, help=needed("model dim M", model_dim))
    add("--hidden-dim", dest=hidden_dest, type=int, default=hidden_dim,
        help=needed("expert hidden dim H", hidden_dim))  # fmt: skip
    add("--experts", type=int, default=None, help="E (default: 2 per rank)")
    add("--top-k", type=int, default=2, help="experts per token k")
    add("--capacity-factor", type=float, default=capacity_factor, help="f; 0 = dropless")
    add("--shared-hidden", type=int, default=0, metavar="HS", help=shared_help)


@dataclass(frozen=True)
class Check:
    """What a flag's value may be: a number >= lo (> lo when strict) and <= hi, finite; a comma
    list (a list value) must name at least one value, each of them in range. Check() only
    refuses an empty list; a value of None (an optional flag not given) is not checked. `why`,
    when given, ends the message: what the bound protects or what to type instead."""

    lo: float = -math.inf
    hi: float = math.inf
    strict: bool = False
    why: str = ""

    def problem(self, v: object) -> str | None:
        """None when `v` fits, else what it must be ("must be >= 1")."""
        if isinstance(v, list | tuple):
            if not v:
                return "must name at least one value"
            bad = [self.problem(x) for x in v]
            return next((f"{p} (each)" for p in bad if p), None)
        if isinstance(v, bool) or not isinstance(v, int | float):
            return None
        finite = isinstance(v, int) or math.isfinite(v)  # an int past float's range is finite
        above = v > self.lo if self.strict else v >= self.lo
        if finite and above and v <= self.hi:
            return None
        want = [f"{'>' if self.strict else '>='} {_num(self.lo)}"] if math.isfinite(self.lo) else []
        want += [f"<= {_num(self.hi)}"] if math.isfinite(self.hi) else []
        want += ["finite"] if isinstance(v, float) else []
        return f"must be {' and '.join(want)}" + (f" ({self.why})" if self.why else "")


def _num(bound: float) -> str:
    """A bound as written in its Check: an int in full (4294967295), a float as %g (1e+09)."""
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


# The range of every flag that means the same in each command having it (`schemoe train`, the
# benches, `profile`, `simulate`): one table, so a value refused by one is refused by all, in the
# same words. The parsers attach it (`Parser.add_checks`); TrainConfig applies it to its fields
# (train/checks.py). A command's own tables add the flags only it has.
FLAG_CHECKS: dict[str, Check] = {
    "--nproc": Check(1),
    "--ranks-per-node": Check(1),
    "--threads": Check(1),
    "--timeout": Check(
        1, 1e9, why="seconds: below 1 a rank gives up while the others start"),
    "--seed": Check(0, 2**32 - 1),
    "--model-dim": Check(1),
    "--hidden-dim": Check(1),
    "--experts": Check(1),
    "--top-k": Check(1),
    "--capacity-factor": Check(0, why="0 for dropless"),
    "--chunks": Check(1),
    "--tokens": Check(1),
    "--layers": Check(1),
    "--heads": Check(1),
    "--moe-every": Check(1),
    "--batch": Check(1),
    "--warmup": Check(0),
    "--repeats": Check(1),
    "--bucket-mb": Check(0, strict=True),
    "--trials": Check(0),
    "--shortlist": Check(
        1, why="the candidates --policy auto times; for the cost model's first choice, untimed, "
        "use --trials 0"),
}  # fmt: skip


def flag_problem(flag: str, v: object, check: Check | None = None) -> str | None:
    """The error line for `flag` given `v` ("--seed must be >= 0 and <= 4294967295, got -1"),
    or None when `v` fits; the check is `check`, else FLAG_CHECKS's (none there: None)."""
    check = check or FLAG_CHECKS.get(flag)
    if check is None or v is None or not (problem := check.problem(v)):
        return None
    return f"{flag} {problem}, got {_typed(v)}"


def _typed(v: object) -> str:
    """A value as the command line spells it: lists comma-joined, '' for nothing, floats as %g
    (0, not 0.0)."""
    if isinstance(v, list | tuple):
        return ",".join(_typed(x) for x in v) or "''"
    return f"{v:g}" if isinstance(v, float) else str(v)


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
    them of the parser's own class) do too. An error is one line, "PROG: error: MESSAGE" (no
    usage block), exit status 2; `add_checks` attaches a Check per flag, run after parsing.
    `@FILE` stands for the arguments written in FILE (shell words, `#` comments), so a
    configuration can live in a file: `schemoe train @examples/qwen3_moe.args --steps 80`."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs) -> None:
        kwargs.setdefault("fromfile_prefix_chars", "@")
        super().__init__(*args, formatter_class=formatter_class, **kwargs)
        self.record_explicit = False  # set by a command that needs to know what was typed
        self.checks: dict[str, tuple[str, Check]] = {}  # flag -> (dest, its check)

    def add_checks(self, checks: Mapping[str, Check]) -> None:
        """Check each flag of FLAG_CHECKS, then of `checks` (its spelling -> Check; it wins for a
        flag in both) this parser has, right after parsing; a flag it lacks is skipped, so one
        table serves commands sharing spellings."""
        for flag, check in (FLAG_CHECKS | dict(checks)).items():
            if flag in self._option_string_actions:
                self.checks[flag] = (self._option_string_actions[flag].dest, check)

    def convert_arg_line_to_args(self, arg_line: str) -> list[str]:
        return shlex.split(arg_line, comments=True)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")

    def parse_known_args(self, args=None, namespace=None):
        """As ArgumentParser's, then every attached Check; with `record_explicit`, the result's
        `explicit` attribute is the sorted dests given on the command line (a flag typed with
        its default value counts)."""
        ns, rest = super().parse_known_args(args, namespace)
        for flag, (dest, check) in self.checks.items():
            if line := flag_problem(flag, getattr(ns, dest, None), check):
                self.error(line)
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


@contextlib.contextmanager
def for_flag(flag: str) -> Iterator[None]:
    """A ValueError raised inside is raised again with the flag whose value caused it in front:
    `with for_flag("--algorithms"): ALGORITHMS.get(name)` -> "--algorithms: unknown all-to-all
    algorithm 'x'; known: ...". ImportError (an optional package the value needs) too."""
    try:
        yield
    except (ValueError, ImportError) as e:
        raise ValueError(f"{flag}: {e}") from None


def guard(
    prog: str, fn: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    """`fn`, except that ValueError, RuntimeError, OSError (PermissionError, FileNotFoundError,
    NotADirectoryError, TimeoutError, ...) and FloatingPointError (a diverged run's
    NonFiniteError) print "`prog`: error: ..." on one line to stderr and return exit status 2
    instead of a traceback. The result pickles when `fn` does (the parsed arguments, which carry
    it, are handed to spawned ranks)."""
    return functools.partial(_call, prog, fn)


def _call(prog: str, fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return fn(args)
    except (ValueError, RuntimeError, OSError, FloatingPointError) as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
