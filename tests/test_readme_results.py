"""The docs' result tables are `schemoe bench report`'s output: pasting again from the two committed
report runs changes nothing, and every figure of the report is shown in one of `paste.TARGETS`.
The README stays a five-minute read: at most 20 KB, the two set-up commands first, a package tree
that lists exactly the folders and root modules of schemoe/ under their tiers, and raw-output
links that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from schemoe.bench import paste, regen
from schemoe.bench.figures import FIGURES
from schemoe.tiers import TIERS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
README = ROOT / "README.md"
PKG = ROOT / "schemoe"
_INSTALL = "python3 -m venv .venv && .venv/bin/pip install -r requirements-dev.txt -e . && "
SETUP = (_INSTALL + ".venv/bin/schemoe train", _INSTALL + ".venv/bin/python -m pytest -q")


@pytest.mark.parametrize("name", paste.TARGETS)
def test_pasting_the_committed_report_runs_again_changes_nothing(name):
    """Each block against the two runs its `Runs: 1 = `A`, 2 = `B`` line names (docs/results/A, B)."""
    text = (ROOT / name).read_text()
    by_runs: dict[tuple[str, str], list[str]] = {}
    for figure, body in paste.bodies(text).items():
        runs = re.search(r"^Runs: 1 = `([^`]+)`, 2 = `([^`]+)`", body, re.MULTILINE)
        assert runs, f"{name}: the block of {figure} names no runs: paste it"
        by_runs.setdefault(runs.groups(), []).append(figure)
    for runs, names in by_runs.items():
        found = regen.blocks(RESULTS / runs[0], RESULTS / runs[1])
        assert paste.paste(text, found, name, names) == text, (
            f"{name}: run `schemoe bench report --compare docs/results/{runs[0]} "
            f"docs/results/{runs[1]} --paste {name} --only {','.join(names)}` again"
        )


def test_every_figure_of_the_report_is_shown_in_exactly_one_paste_target():
    shown = [n for name in paste.TARGETS for n in paste.marked((ROOT / name).read_text())]
    assert sorted(shown) == sorted(f.name for f in FIGURES)


def test_the_readme_holds_no_pasted_block_only_the_headline_ratios():
    assert paste.marked(README.read_text()) == []


def test_the_readme_is_at_most_20_kb():
    size = len(README.read_bytes())
    assert size <= 20 * 1024, f"README.md is {size} bytes; move detail to docs/"


def test_the_readme_opens_with_the_two_setup_commands():
    lines = README.read_text().splitlines()
    fence = lines.index("```bash")
    assert fence <= 2, "the set-up commands come first"
    assert tuple(lines[fence + 1 : fence + 3]) == SETUP


def _tree() -> list[tuple[str, str]]:
    """(tier, entry) for each line of the README's package tree: `dist/`, `config.py`, ..."""
    text = README.read_text()
    block = re.search(r"```text\nschemoe/\n(.*?)```", text, re.DOTALL)
    assert block, "README.md has no ```text block starting with `schemoe/`"
    out, tier = [], None
    for line in block.group(1).splitlines():
        if m := re.match(r"^  # (\w+)$", line):
            tier = m.group(1)
        elif m := re.match(r"^  (\S+)", line):
            out.append((tier, m.group(1)))
    return out


def _on_disk() -> set[str]:
    folders = {f"{d.name}/" for d in PKG.iterdir() if (d / "__init__.py").is_file()}
    return folders | {p.name for p in PKG.glob("*.py")}


def test_the_readme_tree_lists_every_folder_and_root_module_of_schemoe_and_nothing_else():
    listed = [e for _, e in _tree()]
    assert len(listed) == len(set(listed)), "an entry is listed twice"
    assert set(listed) == _on_disk(), (
        f"missing: {sorted(_on_disk() - set(listed))}, gone: {sorted(set(listed) - _on_disk())}"
    )


def test_the_readme_tree_puts_each_entry_under_its_tier_in_tier_order():
    tier_of = {name: tier for tier, names in TIERS for name in names}
    tier_of["__init__"] = "layer"  # the package itself (tiers.tier_of)
    order = [tier for tier, _ in TIERS]
    seen = []
    for tier, entry in _tree():
        assert tier == tier_of[entry.removesuffix("/").removesuffix(".py")], entry
        if not seen or seen[-1] != tier:
            seen.append(tier)
    assert seen == order


def test_every_raw_output_the_readme_links_exists():
    links = re.findall(r"\]\((docs/results/[^)]+)\)", README.read_text())
    assert links, "the README's results table links no raw output"
    assert [p for p in links if not (ROOT / p).is_file()] == []
