"""`schemoe simulate --ctmoe`: the CT-MoE-like GPT on the paper's cluster (costmodel/ctmoe.py)."""

from __future__ import annotations

import json

from schemoe import cli
from schemoe.costmodel.ctmoe import BUCKET_BYTES, CTMOE_LAYERS, PAPER_MS, ctmoe_shape
from schemoe.costmodel.hardware import preset
from schemoe.costmodel.stack import predict_stack_step


def test_ctmoe_prints_a_row_per_layer_count_with_every_policy_next_to_the_paper(capsys):
    assert cli.main(["simulate", "--ctmoe", "--preset", "paper-32gpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert "ASSUMED shape" in lines[0] and out["shape"]["experts"] == 32
    rows = out["rows"]
    assert [r["layers"] for r in rows] == list(CTMOE_LAYERS)
    hw = preset("paper-32gpu")
    for row in rows:
        n = row["layers"]
        table = next(ln for ln in lines if ln.split()[:1] == [str(n)])  # the printed row
        paper = PAPER_MS[n]
        assert f"{paper['tutel']}/{paper['fastermoe']}/{paper['schemoe']}" in table
        for pol in ("sequential", "tutel", "schemoe", "stack", "stack_scheduled"):
            assert row[pol]["ms"] > 0 and f"{row[pol]['ms']:.1f}" in table, (n, pol)
        # tutel's best r includes r = 1 (= sequential); the stack's best m includes m = 1
        assert row["tutel"]["ms"] <= row["sequential"]["ms"]
        st = row["stack"]
        assert st["ms"] <= st["m1_ms"]
        m1 = predict_stack_step(hw, ctmoe_shape(n, 32), st["policy"], "naive", st["chunks"],
                                micro=1, bucket_bytes=BUCKET_BYTES)  # fmt: skip
        assert abs(st["m1_ms"] - m1.step_s * 1e3) < 0.06  # the m = 1 twin, priced independently
        assert row["ratio_paper"] == round(paper["schemoe"] / paper["tutel"], 3)
        assert row["ratio_predicted"] == round(row["schemoe"]["ms"] / row["tutel"]["ms"], 3)
    # deeper models take longer under every policy
    for pol in ("sequential", "tutel", "schemoe", "schemoe_shipped", "stack", "stack_scheduled"):
        ms = [r[pol]["ms"] for r in rows]
        assert ms == sorted(ms), pol


def test_ctmoe_refuses_the_shape_flags_it_does_not_use(capsys):
    assert cli.main(["simulate", "--ctmoe", "--model-dim", "512", "--layers", "4"]) == 2
    err = capsys.readouterr().err
    assert "--ctmoe prices its own assumed shape; drop --model-dim, --layers" in err


def test_simulate_without_ctmoe_needs_the_model_dims(capsys):
    assert cli.main(["simulate", "--tokens", "64", "--hidden-dim", "128"]) == 2
    assert "simulate needs --model-dim and --hidden-dim" in capsys.readouterr().err
