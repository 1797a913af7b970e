"""`schemoe bench report`: the figures' table makers on the committed raw outputs, the dry run's
testbed pairing, --only, the runner past a failing figure, and --compare of two runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from schemoe.bench import figures, paste, regen
from schemoe.bench.figures import FIGURES

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
VALIDATE = '{"configurations": 30, "median_abs_error": 0.142, "worst_abs_error": 0.234, "points": []}'  # fmt: skip
COMMITTED = [f for f in FIGURES if f.committed]


@pytest.mark.parametrize("fig", COMMITTED, ids=[f.name for f in COMMITTED])
def test_every_figure_with_a_committed_output_makes_a_table_from_it(fig):
    texts = [(RESULTS / n).read_text() if n else "" for n in fig.committed]
    if fig.name.startswith("costmodel"):  # its validate output was not committed
        texts[2] = VALIDATE
    table = fig.table(texts)
    assert table.rows and all(len(r) == len(table.columns) for r in table.rows)
    md = table.markdown()
    assert md.count("\n") == len(table.rows) + 1


def test_the_layer_table_has_the_readme_rows_and_ratios():
    fig = figures.by_name(["layer_400mbit"])[0]
    t = fig.table([(RESULTS / "layer_2node_400mbit.txt").read_text()])
    rows = {r[0]: r for r in t.rows}
    assert rows["sequential r=1 (baseline)"][3] == "1.00x"
    assert rows["best schemoe"][1:] == ["naive r=4", "306.3", "1.44x"]
    assert rows["DeepSpeed-MoE"][3] == "1.12x"


def test_a_step_table_says_whether_any_row_went_below_its_lower_bound():
    def bench(*rows):
        keys = {"policy": "schemoe", "chunks": 4, "grad_sync": "ddp", "grad_compress": "none",
                "network_share": 0.5}  # fmt: skip
        return json.dumps({"results": [{**keys, "median_ms": m, "lower_bound_ms": b} for m, b in rows]})  # fmt: skip

    fig = figures.by_name(["step_300mbit"])[0]
    (ok,) = [c for c in fig.table([bench((300, 200), (250, 200))]).claims if "bound" in c.text]
    assert ok.holds and ok.value == "1.25x"  # the closest row: 250 / 200
    (low,) = [c for c in fig.table([bench((300, 200), (190, 200))]).claims if "bound" in c.text]
    assert not low.holds and low.value == "0.95x"


def test_the_train_and_overhead_makers_read_their_json_lines():
    line = json.dumps({"losses": [3.0] * 5 + [2.0] * 10})
    t = figures.by_name(["train_compress_accuracy"])[0].table(
        [line, json.dumps({"losses": [2.02] * 10})] + [line] * 4
    )
    assert [r[0] for r in t.rows] == list(figures.COMPRESSORS)
    assert t.rows[1][2] == "+1.0%" and t.claims[0].holds
    o = figures.by_name(["overhead"])[0].table(
        ['x\n{"scheduler_us_per_task": 1.4, "layer_us_per_extra_task": 74.0}']
    )
    assert o.rows[0][1] == "1.4 us"


def test_dry_run_brings_every_testbed_down_before_the_next_one_comes_up():
    lines = regen.dry_run(FIGURES, Path("/tmp/out"))
    up = False
    ups = 0
    for line in lines:
        if "testbed up" in line:
            assert not up, line
            up, ups = True, ups + 1
        elif "testbed down" in line:
            assert up, line
            up = False
    assert not up and ups == sum(1 for f in FIGURES if f.where)


def test_only_with_an_unknown_name_names_it_and_the_known_ones():
    with pytest.raises(ValueError, match="nope.*known: layer_400mbit"):
        regen.select(["overhead", "nope"], testbed=True)
    with pytest.raises(ValueError, match="--testbed"):
        regen.select(["layer_400mbit"], testbed=False)


def _args(**kw) -> argparse.Namespace:
    base = {"out": None, "only": None, "testbed": False, "list": False, "dry_run": False}
    base |= {"timeout": 60.0, "compare": None, "paste": None}
    return argparse.Namespace(**{**base, **kw})


def test_testbed_figures_are_refused_up_front_when_not_root(tmp_path):
    calls = []
    with pytest.raises(ValueError, match="root"):
        regen.run(_args(out=str(tmp_path), only="layer_400mbit", testbed=True),
                  runner=lambda *a: calls.append(a) or 0, euid=1000)  # fmt: skip
    assert calls == []


def test_the_runner_goes_on_past_a_failing_figure_and_marks_it_failed(tmp_path):
    figs = figures.by_name(["layer_400mbit", "overhead"])
    seen = []

    def fake(argv, out, err, env, timeout):
        seen.append(argv[1:])
        if "layer" in argv:
            return 3
        if "schemoe.bench.overhead" in argv:
            with open(out, "a") as f:
                f.write('{"scheduler_us_per_task": 1.5, "layer_us_per_extra_task": 70.0}\n')
        return 0

    report = regen.run_figures(figs, tmp_path, fake).read_text()
    assert "## layer_400mbit" in report and "**failed**" in report and "exited 3" in report
    assert "## overhead" in report and "**ok**" in report and "1.5 us" in report
    downs = [a for a in seen if a[-2:] == ["testbed", "down"]]
    assert len(downs) == 1  # the testbed came down although the figure failed
    assert (tmp_path / "overhead.txt").read_text().startswith("# started ")


def test_a_figure_whose_command_dies_after_its_output_stays_failed_but_shows_the_table(tmp_path):
    def fake(argv, out, err, env, timeout):  # the result written, then a non-zero exit
        with open(out, "a") as f:
            f.write('{"scheduler_us_per_task": 1.5, "layer_us_per_extra_task": 70.0}\n')
        return 134

    report = regen.run_figures(figures.by_name(["overhead"]), tmp_path, fake).read_text()
    assert "**failed**" in report and "exited 134" in report
    head = report.splitlines()[2]
    assert " at commit " in head and "unknown" not in head  # this checkout's commit, named
    assert "The table from the outputs as they were written" in report and "1.5 us" in report


def _run_dir(path: Path, seq: float, schemoe: float) -> Path:
    path.mkdir()
    rows = [
        {"policy": "sequential", "algorithm": "naive", "compressor": "none", "chunks": 1,
         "median_ms": seq, "p10_ms": seq, "p90_ms": seq},
        {"policy": "schemoe", "algorithm": "naive", "compressor": "none", "chunks": 4,
         "median_ms": schemoe, "p10_ms": schemoe, "p90_ms": schemoe},
        {"policy": "deepspeed", "algorithm": "deepspeed", "compressor": "none", "chunks": 1,
         "median_ms": 400.0, "p10_ms": 400.0, "p90_ms": 400.0},
    ]  # fmt: skip
    (path / "layer_2node_400mbit.txt").write_text(json.dumps({"results": rows}) + "\n")
    return path


def test_compare_shows_both_ratios_and_which_claims_hold_in_both(tmp_path):
    a = _run_dir(tmp_path / "a", 440.0, 320.0)  # schemoe 1.38x, DeepSpeed 1.10x
    b = _run_dir(tmp_path / "b", 380.0, 300.0)  # schemoe 1.27x, DeepSpeed 0.95x
    text = regen.compare(a, b)
    assert "1.38x / 1.27x" in text and "holds in both runs" in text
    assert "- best schemoe faster than sequential r=1 (1.38x / 1.27x): holds in both" in text
    assert "- DeepSpeed-MoE faster than sequential r=1 (1.10x / 0.95x): does NOT hold in both" in text  # fmt: skip
    assert "a2a_2gbit" not in text  # only figures present in both runs
    out = tmp_path / "cmp.md"
    regen.run(_args(compare=[str(a), str(b)], out=str(out)))
    assert out.read_text() == text


def test_compare_marks_rows_one_run_lacks_and_keeps_unlike_tables_apart(tmp_path):
    """A run without DeepSpeed's row; the committed first and second runs of the auto figures
    (auto chose another configuration on shape 1: one row, both cells) and of the 10 Gbit/s
    all-to-alls (the older output has no intra/inter parts: one table after the other)."""
    a = _run_dir(tmp_path / "a", 440.0, 320.0)
    b = _run_dir(tmp_path / "b", 380.0, 300.0)
    raw = b / "layer_2node_400mbit.txt"
    js = json.loads(raw.read_text())
    raw.write_text(json.dumps({"results": js["results"][:2]}) + "\n")  # no DeepSpeed row
    text = regen.compare(a, b)
    assert "| 1 | DeepSpeed-MoE | its own | 400.0 | 1.10x |" in text
    assert "(1.10x / absent): does NOT hold in both" in text
    root = Path(__file__).resolve().parent.parent / "docs" / "results"
    text = regen.compare(root, root / "report_2026-12-03_partial")
    shape1 = text.split("## auto_noprofile_shape1")[1].split("## ")[0]
    assert (
        "| 1, 2 | T=1024 M=256 H=1024 E=8 | schemoe r=4 / fastermoe r=4 | 424.4 / 374.0 |" in shape1
    )
    a2a = text.split("## a2a_10gbit")[1].split("## ")[0]
    assert "run 1:" in a2a and "run 2:" in a2a


DOC = """# Results

Before.

<!-- report:layer_400mbit -->
an old table
<!-- /report:layer_400mbit -->

After.
"""


def test_paste_puts_the_commands_and_compared_table_between_the_marks_and_nothing_else(tmp_path):
    a = _run_dir(tmp_path / "a", 440.0, 320.0)
    b = _run_dir(tmp_path / "b", 380.0, 300.0)
    found = regen.blocks(a, b)
    assert list(found) == ["layer_400mbit"]  # only figures both runs have
    text = paste.paste(DOC, found)
    assert text.startswith("# Results\n\nBefore.\n\n<!-- report:layer_400mbit -->\n```bash\n")
    assert text.endswith("<!-- /report:layer_400mbit -->\n\nAfter.\n")
    assert "an old table" not in text and "1.38x / 1.27x" in text
    assert "schemoe bench layer --testbed" in text and "> DIR/layer_2node_400mbit.txt" in text
    assert "Runs: 1 = `a`, 2 = `b`" in text
    assert "(1.10x / 0.95x): does NOT hold in both" in text
    assert paste.paste(text, found) == text  # pasting again from the same runs changes nothing


def test_paste_refuses_a_figure_without_a_block_or_a_mark_without_its_end():
    with pytest.raises(ValueError, match="README.md: no block for layer_400mbit"):
        paste.paste(DOC, {}, "README.md")
    with pytest.raises(ValueError, match="without <!-- /report:NAME -->: overhead"):
        paste.paste("<!-- report:overhead -->\nx\n", {"overhead": "y"})
    assert paste.marked(DOC) == ["layer_400mbit"]
    assert paste.marked("say `<!-- report:NAME -->` in a line") == []  # only a line of its own


def test_the_paste_option_writes_every_file_or_none(tmp_path):
    a = _run_dir(tmp_path / "a", 440.0, 320.0)
    b = _run_dir(tmp_path / "b", 380.0, 300.0)
    good, bad = tmp_path / "good.md", tmp_path / "bad.md"
    good.write_text(DOC)
    bad.write_text("<!-- report:overhead -->\n\n<!-- /report:overhead -->\n")  # not in the runs
    with pytest.raises(ValueError, match="bad.md: no block for overhead"):
        regen.run(_args(compare=[str(a), str(b)], paste=[str(good), str(bad)]))
    assert good.read_text() == DOC  # nothing half pasted
    regen.run(_args(compare=[str(a), str(b)], paste=[str(good)]))
    assert "1.38x / 1.27x" in good.read_text()
    with pytest.raises(ValueError, match="--paste needs --compare"):
        regen.run(_args(paste=[str(good)]))


def test_paste_only_replaces_the_named_figures_and_leaves_the_other_blocks_from_their_runs(
    tmp_path,
):
    a = _run_dir(tmp_path / "a", 440.0, 320.0)
    b = _run_dir(tmp_path / "b", 380.0, 300.0)
    doc = tmp_path / "doc.md"
    other = "<!-- report:overhead -->\nfrom other runs\n<!-- /report:overhead -->\n"
    doc.write_text(DOC + other)  # `overhead` is in neither run: pasted alone it would fail
    regen.run(_args(compare=[str(a), str(b)], paste=[str(doc)], only="layer_400mbit"))
    text = doc.read_text()
    assert "1.38x / 1.27x" in text and text.endswith(other)
    with pytest.raises(ValueError, match="unknown figure"):
        regen.run(_args(compare=[str(a), str(b)], paste=[str(doc)], only="nope"))
    doc.write_text(DOC)
    with pytest.raises(ValueError, match="--only overhead: no <!-- report:NAME --> mark"):
        regen.run(_args(compare=[str(a), str(b)], paste=[str(doc)], only="overhead"))
    assert doc.read_text() == DOC


def test_paste_without_files_pastes_into_the_docs_that_hold_the_figures(tmp_path, monkeypatch):
    a = _run_dir(tmp_path / "a", 440.0, 320.0)
    b = _run_dir(tmp_path / "b", 380.0, 300.0)
    monkeypatch.chdir(tmp_path)
    for name in paste.TARGETS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("no marks\n")
    (tmp_path / paste.TARGETS[0]).write_text(DOC)
    regen.run(_args(compare=[str(a), str(b)], paste=[]))  # `--paste` given with no FILE
    assert "1.38x / 1.27x" in (tmp_path / paste.TARGETS[0]).read_text()
    assert (tmp_path / paste.TARGETS[1]).read_text() == "no marks\n"


def test_commands_are_what_a_user_types_wrapped_at_100_columns():
    for f in FIGURES:
        lines = "\n".join(regen.commands(f)).splitlines()
        assert all(len(line) <= 100 for line in lines if " " in line.strip()), f.name
        assert not any("{out}" in line or "{home}" in line or "python -m schemoe.cli" in line for line in lines)  # fmt: skip
        assert lines[0].startswith("schemoe testbed up") == bool(f.where)
        assert (lines[-1] == "schemoe testbed down") == bool(f.where)
