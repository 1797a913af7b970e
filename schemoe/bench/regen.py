"""`schemoe bench report`: regenerate every figure of docs/results.md and the other docs in one run.

Figures (`schemoe.bench.figures`) run one after another, each command a subprocess
(`python -m schemoe.cli ...`); a testbed figure brings the testbed up before its commands and
always down after them. Each command's stdout goes to OUT/<file> under one header line (start
time, UTC, and the command), its stderr to OUT/<file>.stderr; OUT/REPORT.md gets per figure the
commands, the table, the raw files and the wall time. A figure that fails is marked failed there
and the run goes on. `--compare DIR1 DIR2` puts two runs' tables side by side: a claim stands
only where it holds in both; with `--paste [FILE...]` it writes each figure's commands and
compared table into the files' marked blocks (`schemoe.bench.paste`; no FILE: `paste.TARGETS`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

from . import paste
from .figures import CLI, FIGURES, Figure, Step, by_name
from .tables import Table

__all__ = [
    "add_arguments", "blocks", "commands", "compare", "compare_figure", "dry_run", "run",
    "run_figures", "select",
]  # fmt: skip

# runner(argv, stdout file, stderr file, env or None, timeout s) -> exit code; files opened for append
Runner = Callable[[list[str], Path, Path, "dict | None", float], int]


def subprocess_runner(argv: list[str], out: Path, err: Path, env: dict | None, timeout: float) -> int:  # fmt: skip
    with open(out, "a") as o, open(err, "a") as e:
        try:
            return subprocess.run(
                argv, check=False, stdout=o, stderr=e, env=env, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            e.write(f"\n# killed after {timeout:g} s (--timeout)\n")
            return 124


def select(only: Sequence[str] | None, testbed: bool) -> list[Figure]:
    """The figures to run: --only's (all must exist) or all; testbed figures need --testbed."""
    figs = by_name(only) if only else [f for f in FIGURES if testbed or f.where is None]
    need = [f.name for f in figs if f.where is not None]
    if need and not testbed:
        raise ValueError(f"figure(s) {', '.join(need)} run on the testbed: add --testbed (as root)")
    return figs


def _argv(step: Step, out: Path, home: Path) -> list[str]:
    return [sys.executable, *(a.format(out=out, home=home) for a in step.argv)]


def _show(argv: Sequence[str]) -> str:
    return shlex.join(["python", *argv[1:]])


def dry_run(figs: Sequence[Figure], out: Path) -> list[str]:
    """Every command in the order the run would start it, testbed up/down included."""
    lines = []
    for f in figs:
        home = out / "home" / f.name
        lines.append(f"# {f.name}: {f.title} (~{f.minutes:g} min)")
        if f.where:
            lines.append(_show([sys.executable, *f.where.up_argv()]))
        for s in f.steps:
            env = f"HOME={home} " if s.fresh_home else ""
            lines.append(f"{env}{_show(_argv(s, out, home))} > {out / s.out}")
        if f.where:
            lines.append(_show([sys.executable, "-m", "schemoe.cli", "testbed", "down"]))
    return lines


def commands(f: Figure) -> list[str]:
    """`f`'s commands as a user types them: `schemoe ...`, DIR for the report's output folder."""
    home = f"DIR/home/{f.name}"
    lines = [_wrap(["schemoe", *f.where.up_argv()[2:]])] if f.where else []
    for s in f.steps:
        argv = [a.format(out="DIR", home=home) for a in s.argv]
        argv = ["schemoe", *argv[2:]] if tuple(argv[:2]) == CLI else ["python", *argv]
        env = [f"HOME={home}"] if s.fresh_home else []
        lines.append(_wrap([*env, *map(shlex.quote, argv), f"> DIR/{s.out}"]))
    if f.where:
        lines.append("schemoe testbed down")
    return lines


def _wrap(words: Sequence[str], width: int = 100) -> str:
    """Shell words joined into lines of at most `width` (where words allow), continued with \\."""
    lines, cur = [], ""
    for w in words:
        if cur and len(cur) + 1 + len(w) > width - 2:
            lines.append(cur + " \\")
            cur = "    " + w
        else:
            cur = f"{cur} {w}" if cur else w
    return "\n".join([*lines, cur])


def _commit() -> str:
    """The checkout's commit the run measures (`git describe`), or why it is not known."""
    try:
        r = subprocess.run(["git", "describe", "--always", "--dirty"], check=False,
                           capture_output=True, text=True, timeout=10,
                           cwd=Path(__file__).resolve().parent)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({type(e).__name__})"
    return r.stdout.strip() if r.returncode == 0 else "unknown (not a git checkout)"


def _stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _run_figure(f: Figure, out: Path, runner: Runner, timeout: float) -> tuple[str, str]:
    """Run one figure's commands; (status, table markdown or why there is none)."""
    home = out / "home" / f.name
    bed_log = out / f"{f.name}.testbed.txt"
    failed = None
    try:
        if f.where:
            up = [sys.executable, *f.where.up_argv()]
            if runner(up, bed_log, bed_log, None, 120) != 0:
                return "failed", f"`{_show(up)}` failed: see {bed_log.name}"
        for s in f.steps:
            argv = _argv(s, out, home)
            env = None
            if s.fresh_home:
                home.mkdir(parents=True, exist_ok=True)
                env = {**os.environ, "HOME": str(home)}
            with open(out / s.out, "w") as o:
                o.write(f"# started {_stamp()}: {_show(argv)}\n")
            (out / f"{s.out}.stderr").write_text("")
            rc = runner(argv, out / s.out, out / f"{s.out}.stderr", env, timeout)
            if rc != 0:
                failed = f"`{_show(argv)}` exited {rc}: see {s.out}.stderr"
                break
    finally:
        if f.where:
            runner([sys.executable, "-m", "schemoe.cli", "testbed", "down"], bed_log, bed_log, None, 120)  # fmt: skip
    try:
        table = render(f.table([(out / n).read_text() for n in f.outputs]))
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        return "failed", failed or f"no table: {type(e).__name__}: {e}"
    if failed:  # e.g. a rank that died at exit after writing its result: say so, show what it wrote
        return "failed", f"{failed}\n\nThe table from the outputs as they were written:\n\n{table}"
    return "ok", table


def render(t: Table) -> str:
    lines = [t.markdown()]
    if t.claims:
        lines.append("")
        lines += [f"- {c.text}: {'holds' if c.holds else 'does not hold'} ({c.value})" for c in t.claims]  # fmt: skip
    return "\n".join(lines)


def run_figures(figs: Sequence[Figure], out: Path, runner: Runner = subprocess_runner,
                timeout: float = 3600.0) -> Path:  # fmt: skip
    """Run `figs` in order into `out`; write and return out/REPORT.md (after every figure)."""
    out.mkdir(parents=True, exist_ok=True)
    total = sum(f.minutes for f in figs)
    head = f"started {_stamp()} at commit {_commit()}; estimate {total:g} min for {len(figs)} figure(s)"  # fmt: skip
    parts = [f"# schemoe bench report\n\n{head}\n"]
    report = out / "REPORT.md"
    for f in figs:
        t0, start = time.monotonic(), _stamp()
        status, body = _run_figure(f, out, runner, timeout)
        took = (time.monotonic() - t0) / 60
        where = f"testbed `{f.where.describe()}`" if f.where else "loopback, this host"
        cmds = "\n".join(dry_run([f], out)[1:])
        parts.append(
            f"## {f.name}: {f.title}\n\n**{status}**; {where}; started {start}, took {took:.1f} min "
            f"(estimate {f.minutes:g})\n\n```bash\n{cmds}\n```\n\n{body}\n\nraw: "
            + ", ".join(f"`{n}`" for n in f.outputs) + "\n"
        )  # fmt: skip
        report.write_text("\n".join(parts))
    report.write_text("\n".join(parts))
    return report


def compare_figure(f: Figure, dir1: Path, dir2: Path) -> str | None:
    """One figure's two runs: its table cell by cell ("a / b" where they differ) and each claim's
    verdict; None when either run lacks one of its outputs."""
    if not all((d / n).exists() for d in (dir1, dir2) for n in f.outputs):
        return None
    try:
        t1, t2 = (f.table([(d / n).read_text() for n in f.outputs]) for d in (dir1, dir2))
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return f"no table in one of the runs: {type(e).__name__}: {e}\n"
    lines = []
    if list(t1.columns) != list(t2.columns):  # not cell for cell: one after the other
        lines += ["run 1:\n", t1.markdown(), "\nrun 2:\n", t2.markdown(), ""]
    else:  # rows matched by their first cell; a row only one run has says which
        rows2 = {r[0]: r for r in t2.rows}
        rows = []
        for r in t1.rows:
            o = rows2.get(r[0])
            merged = [a if a == b else f"{a} / {b}" for a, b in zip(r, o)] if o else r
            rows.append(["1, 2" if o else "1", *merged])
        first = {r[0] for r in t1.rows}
        rows += [["2", *r] for r in t2.rows if r[0] not in first]
        lines += [Table(["run", *t1.columns], rows).markdown(), ""]
    c2 = {c.text: c for c in t2.claims}
    for c in t1.claims:
        o = c2.get(c.text)
        both = c.holds and o is not None and o.holds
        seen = f"{c.value} / {o.value}" if o else f"{c.value} / absent"
        lines.append(f"- {c.text} ({seen}): {'holds in both' if both else 'does NOT hold in both'}")  # fmt: skip
    return "\n".join(lines) + "\n"


def compare(dir1: Path, dir2: Path) -> str:
    """Both runs' tables, cell by cell ("a / b" where they differ), and each claim's verdict."""
    lines = [
        f"# schemoe bench report: {dir1} vs {dir2}\n",
        (
            "Cells show run 1 / run 2 where they differ; `run` says which runs have the row. "
            "Rule: a claim stands only where it holds in both runs.\n"
        ),
    ]
    for f in FIGURES:
        body = compare_figure(f, dir1, dir2)
        if body is not None:
            lines.append(f"## {f.name}: {f.title}\n\n{body}")
    return "\n".join(lines)


def blocks(dir1: Path, dir2: Path) -> dict[str, str]:
    """Per figure present in both runs, what `--paste` puts in a file: its commands (as a user
    types them, DIR for the output folder), which runs the cells show, the compared table."""
    out = {}
    for f in FIGURES:
        body = compare_figure(f, dir1, dir2)
        if body is None:
            continue
        cmds = "\n".join(commands(f))
        out[f.name] = (
            f"```bash\n{cmds}\n```\n\nRuns: 1 = `{dir1.name}`, 2 = `{dir2.name}` (`{f.name}` in "
            f"their REPORT.md); a cell reads `1 / 2` where they differ.\n\n{body}"
        )
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="folder for raw outputs and REPORT.md (with "
                   "--compare: a file for the comparison, else it is printed)")  # fmt: skip
    p.add_argument("--only", default=None, help="comma-separated figure names (see --list); "
                   "with --paste: paste only their blocks")  # fmt: skip
    p.add_argument("--testbed", action="store_true", help="include the testbed figures (root)")
    p.add_argument("--list", action="store_true", help="print each figure, where, estimate")
    p.add_argument("--dry-run", action="store_true", help="print every command; run nothing")
    p.add_argument("--timeout", type=float, default=3600.0, help="kill a command after S s")
    p.add_argument("--compare", nargs=2, metavar=("DIR1", "DIR2"), default=None,
                   help="two report folders: tables side by side, claims that hold in both")  # fmt: skip
    p.add_argument("--paste", nargs="*", metavar="FILE", default=None,
                   help="with --compare: replace each <!-- report:NAME --> block of these "
                   "markdown files with that figure's commands and compared table (no FILE: "
                   f"{' '.join(paste.TARGETS)}, from the repository root)")  # fmt: skip


def run(args: argparse.Namespace, runner: Runner = subprocess_runner, euid: int | None = None) -> int:  # fmt: skip
    if args.paste is not None and not args.compare:
        raise ValueError("--paste needs --compare DIR1 DIR2 (the runs whose tables it pastes)")
    if args.paste is not None:
        found = blocks(Path(args.compare[0]), Path(args.compare[1]))
        files = [Path(p) for p in args.paste or paste.TARGETS]
        only = [n for n in args.only.split(",") if n] if args.only else []
        by_name(only)  # unknown names: the error lists the known ones
        olds = {p: p.read_text() for p in files}
        unmarked = [n for n in only if not any(n in paste.marked(t) for t in olds.values())]
        if unmarked:
            raise ValueError(f"--only {','.join(unmarked)}: no <!-- report:NAME --> mark for it in {' '.join(map(str, files))}")  # fmt: skip
        texts = {p: paste.paste(t, found, str(p), only) for p, t in olds.items()}  # all or none
        for p, text in texts.items():
            p.write_text(text)
            print(f"{p}: pasted {', '.join(paste.marked(text, only)) or 'nothing (no marks)'}")
        return 0
    if args.compare:
        text = compare(Path(args.compare[0]), Path(args.compare[1]))
        if args.out:
            Path(args.out).write_text(text)
        else:
            print(text)
        return 0
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    only = [n for n in args.only.split(",") if n] if args.only else None
    figs = select(only, args.testbed or args.list)
    if args.list:
        for f in figs:
            where = f"testbed {f.where.describe()}" if f.where else "loopback"
            print(f"{f.name:28} {where:70} ~{f.minutes:g} min")
        print(f"total ~{sum(f.minutes for f in figs):g} min (estimate)")
        return 0
    if not args.out:
        raise ValueError("--out DIR is needed (where the raw outputs and REPORT.md go)")
    out = Path(args.out).resolve()
    if args.dry_run:
        print("\n".join(dry_run(figs, out)))
        return 0
    euid = os.geteuid() if euid is None else euid
    need = [f.name for f in figs if f.where]
    if need and euid != 0:
        raise ValueError(f"figure(s) {', '.join(need)} need the testbed, which needs root; "
                         "run as root or leave out --testbed")  # fmt: skip
    print(f"report: {len(figs)} figure(s), ~{sum(f.minutes for f in figs):g} min (estimate)")
    print(f"wrote {run_figures(figs, out, runner, args.timeout)}")
    return 0
