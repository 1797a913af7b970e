"""The README's and docs' result tables are `schemoe bench report`'s output: pasting again from the
two committed report runs changes nothing, and every figure of the report is shown somewhere."""

from __future__ import annotations

from pathlib import Path

from schemoe.bench import paste, regen
from schemoe.bench.figures import FIGURES

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
RUNS = (RESULTS / "report_2026-12-04_run1", RESULTS / "report_2026-12-04_run2")
DOCS = [ROOT / "README.md", ROOT / "docs" / "costmodel.md", ROOT / "docs" / "reliability.md"]


def test_the_readme_and_docs_tables_are_the_committed_report_runs_output_for_every_figure():
    found = regen.blocks(*RUNS)
    shown = []
    for p in DOCS:
        text = p.read_text()
        assert paste.paste(text, found, str(p)) == text, f"{p}: run the --paste command again"
        shown += paste.marked(text)
    assert sorted(shown) == sorted(f.name for f in FIGURES)
