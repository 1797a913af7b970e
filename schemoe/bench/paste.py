"""`schemoe bench report --compare DIR1 DIR2 --paste [FILE...]`: the two runs' tables into markdown.

A file marks where a figure goes with two HTML comments, each on a line of its own (invisible
once rendered; the same text inside a line is not a mark); everything
between them is replaced by the figure's block (`regen.blocks`: its commands, which runs the
cells show, the compared table and each claim's verdict), everything outside is left as it is:

    <!-- report:layer_400mbit -->
    ...
    <!-- /report:layer_400mbit -->

So the tables in the docs are the report's output, not copies of it: pasting again from the same
runs changes nothing (a test checks that for the committed files, each block against the two runs
its `Runs:` line names). `--only NAMES` pastes those figures alone, from other runs than the rest
(a figure measured later than the full report). `TARGETS` are the files that
hold every figure between them (relative to the repository root): `--paste` with no FILE pastes
into them.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

__all__ = ["TARGETS", "bodies", "marked", "paste"]

TARGETS = ("docs/results.md", "docs/costmodel.md", "docs/reliability.md")

_OPEN = re.compile(r"^<!-- report:([A-Za-z0-9_]+) -->$", re.MULTILINE)
_BLOCK = re.compile(
    r"^<!-- report:([A-Za-z0-9_]+) -->\n(.*?)^<!-- /report:\1 -->$", re.DOTALL | re.MULTILINE
)


def marked(text: str, only: Collection[str] = ()) -> list[str]:
    """The figure names `text` marks, in order (with `only`, those of them it names)."""
    return [n for n in _OPEN.findall(text) if not only or n in only]


def bodies(text: str) -> dict[str, str]:
    """{figure name: what stands between its marks}, for every closed block of `text`."""
    return {m.group(1): m.group(2) for m in _BLOCK.finditer(text)}


def paste(
    text: str, blocks: Mapping[str, str], where: str = "the text", only: Collection[str] = ()
) -> str:
    """`text` with every marked block replaced by `blocks[name]` (with `only`, the marks it names;
    the others are left as they are, from the runs they name). ValueError, naming `where` and the
    names, for a mark without its closing mark or a figure `blocks` lacks (e.g. failed or missing
    in one of the runs): nothing is half pasted."""
    whole = bodies(text)
    unclosed = [n for n in marked(text) if n not in whole]
    if unclosed:
        raise ValueError(f"{where}: <!-- report:NAME --> without <!-- /report:NAME -->: {', '.join(unclosed)}")  # fmt: skip
    wanted = marked(text, only)
    missing = [n for n in wanted if n not in blocks]
    if missing:
        raise ValueError(f"{where}: no block for {', '.join(missing)} (not in both runs, or not a figure)")  # fmt: skip

    def one(m: re.Match) -> str:
        name = m.group(1)
        if name not in wanted:
            return m.group(0)
        return f"<!-- report:{name} -->\n{blocks[name].rstrip()}\n<!-- /report:{name} -->"

    return _BLOCK.sub(one, text)
