"""The README's and docs' code runs as written: every ```python block executes (the blocks of a
file in order, in one namespace, single process, CPU), and every `schemoe ...` command line in a
```bash block or an indented example parses with the real argparse parser (not run).

A block that cannot run on one process is marked with `<!-- snippet: skip (reason) -->` on the
line before it. docs/architecture.md's tier table quotes `schemoe.tiers.TIERS`, the one place the
order is written: a test holds the two equal."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from schemoe import cli
from schemoe.tiers import TIERS

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(<!-- snippet: skip[^>]*-->\n)?```(\w*)\n(.*?)```", re.DOTALL)


def _blocks(lang: str) -> list[tuple[Path, int, str, bool]]:
    out = []
    for f in FILES:
        text = f.read_text()
        for m in FENCE.finditer(text):
            if m.group(2) == lang:
                line = text.count("\n", 0, m.start(2)) + 1
                out.append((f, line, m.group(3), bool(m.group(1))))
    return out


PYTHON = _blocks("python")


def _name(f: Path, line: int) -> str:
    return f"{f.relative_to(ROOT)}:{line}"


@pytest.mark.parametrize("index", range(len(PYTHON)), ids=[_name(f, n) for f, n, _, _ in PYTHON])
def test_python_block_runs_as_written(index, tmp_path, monkeypatch):
    f, _, _, skip = PYTHON[index]
    if skip:
        pytest.skip("marked <!-- snippet: skip -->")
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "__snippet__"}
    # The blocks before it in the same file first: a page's blocks build on each other.
    for g, n, code, skipped in PYTHON[: index + 1]:
        if g == f and not skipped:
            exec(compile(code, _name(g, n), "exec"), ns)  # noqa: S102


def _command_lines(text: str) -> list[str]:
    """Command lines (continuations joined, comments dropped) that invoke schemoe."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for raw in joined.splitlines():
        for s in re.split(r"\s*(?:;|&&|\|\|)\s*", raw.strip()):  # one command per segment
            if re.match(r"^(\.venv/bin/)?schemoe\s", s):
                out.append(s)
    return out


def _shell_commands() -> list[tuple[str, str]]:
    cmds = []
    for f in FILES:
        text = f.read_text()
        for m in FENCE.finditer(text):
            if m.group(2) == "bash":
                cmds += [(_name(f, text.count("\n", 0, m.start()) + 1), c) for c in
                         _command_lines(m.group(3))]  # fmt: skip
        # indented examples (4 spaces), as docs/training.md shows its commands; a synopsis
        # ("[--flag X]", "<module>") is not a command line
        for block in re.findall(r"(?:^    .*\n)+", text, re.MULTILINE):
            lines = _command_lines("\n".join(ln[4:] for ln in block.splitlines()))
            cmds += [(f"{_name(f, 0)} (indented)", c) for c in lines if not re.search(r"[\[<]", c)]
    return cmds


COMMANDS = _shell_commands()


def _argv(command: str) -> list[str]:
    tokens = shlex.split(command, comments=True)
    for i, t in enumerate(tokens):  # the shell's redirections and pipes end the command
        if t in (">", ">>", "|", "2>", "&&", ";"):
            tokens = tokens[:i]
            break
    return tokens[1:]


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[c[:60] for _, c in COMMANDS])
def test_schemoe_command_line_in_the_docs_parses(where, command):
    parser = cli.build_parser()
    argv = _argv(command)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: `{command}` does not parse (exit {e.code})")
    # `schemoe testbed run ... -- -m schemoe CMD ...`: the inner command parses too.
    target = getattr(args, "target", None) or []
    if target[:1] == ["--"]:
        target = target[1:]
    if target[:2] in (["-m", "schemoe"], ["-m", "schemoe.cli"]):
        try:
            parser.parse_args(target[2:])
        except SystemExit as e:
            pytest.fail(f"{where}: inner `{' '.join(target)}` does not parse (exit {e.code})")


def test_the_docs_hold_python_blocks_and_schemoe_commands():
    assert len(PYTHON) >= 4 and len(COMMANDS) >= 10


def _tier_table(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """(tier, names) per row of the table under "## The tiers, bottom up": its first column and
    the backticked names of its second, a folder's trailing / dropped."""
    section = text.split("## The tiers, bottom up", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] in ("tier", "") or set(cells[0]) <= set("-"):
            continue
        rows.append((cells[0], tuple(n.rstrip("/") for n in re.findall(r"`([^`]+)`", cells[1]))))
    return rows


def test_the_architecture_tier_table_quotes_tiers_in_order():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert _tier_table(text) == [(tier, tuple(names)) for tier, names in TIERS]
