"""`schemoe bench replan` on two local ranks (tiny shapes, a few steps; no timing asserted), its
phase grammar and routing bias, and its refusals of bad flags."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys

import pytest
import torch

from schemoe import cli
from schemoe.bench.drift import Phase, Run, parse_phases, phase_bias
from schemoe.config import ExpertConfig, GateConfig, MoEConfig, ScheduleConfig
from schemoe.costmodel import profiles
from schemoe.costmodel.hardware import Hardware, Link

# A made-up cluster on which the plan matters at these tiny shapes (as tests/test_replan.py's):
# stored under the loopback run's key, so the bench plans on it instead of a quick profile.
TOY = Hardware(name="toy", nodes=1, ranks_per_node=2, intra=Link(1e-5, 1e7),
               inter=Link(1e-5, 1e7), flops=1e8, gemm_alpha=1e-5, memory=1e10,
               task_overhead=1e-4)  # fmt: skip
PHASES = "balanced,zipf:3,zipf:1.2:rotate"
# zipf:3 puts both of a token's choices on rank 0's experts (seed 0's order): TOY prices that
# about 4 % faster on another plan than balanced routing's, hence the low threshold.
TINY = ["--nproc", "2", "--tokens", "48", "--model-dim", "16", "--hidden-dim", "32",
        "--experts", "4", "--phases", PHASES, "--phase-steps", "4", "--rotate-every", "2",
        "--replan-every", "2", "--replan-confirm", "1", "--replan-threshold", "0.01", "--overhead-steps", "4",
        "--candidates", "1", "--timeout", "120"]  # fmt: skip


@contextlib.contextmanager
def _stdout_to(path):
    """fd 1 (this process's and the ranks' it spawns) into `path` for the block."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


def _tiny_run(tmp, *extra: str) -> dict:
    """One tiny run's JSON line, on TOY (the runs take seconds: the cases below share them)."""
    store = str(tmp / "profiles.json")
    assert profiles.save(TOY, store) == "1x2@inter=unshaped,intra=unshaped"
    out = tmp / "out.txt"
    with _stdout_to(out):
        rc = cli.main(["bench", "replan", *TINY, *extra, "--profile", store])
    lines = out.read_text().strip().splitlines()
    assert rc == 0, lines[-5:]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    return _tiny_run(tmp_path_factory.mktemp("bench_replan"))


# Capacity mode: step 0's routing (zipf:3: both choices on two experts) needs f = 2 to drop
# nothing; balanced routing drops under 10 % at a lower f, so the replanner lowers it.
CAPACITY = ["--phases", "zipf:3,balanced", "--phase-steps", "4,8", "--capacity-factor", "1",
            "--capacity-factors", "1,1.25,1.5,2", "--max-drop", "0.1"]  # fmt: skip


@pytest.fixture(scope="module")
def capacity(tmp_path_factory):
    return _tiny_run(tmp_path_factory.mktemp("bench_replan_capacity"), *CAPACITY)


def test_in_capacity_mode_fixed0_takes_the_f_step_0s_routing_needs(capacity):
    assert capacity["fixed0"].endswith("/f2")
    zipf = capacity["runs"]["fixed0"][0]
    assert (zipf["phase"], zipf["drop"]) == ("zipf:3", 0.0)


def test_in_capacity_mode_the_replanner_lowers_f_when_routing_evens_out(capacity):
    lowered = [s for s in capacity["switches"] if s["new"].get("capacity_factor", 2) < 2]
    assert lowered and all(s["step"] > 4 for s in lowered)  # in the balanced phase
    assert capacity["runs"]["replan"][1]["plans"] != capacity["runs"]["fixed0"][1]["plans"]


def test_the_hindsight_plan_of_a_phase_is_the_fastest_within_the_drop_budget(capacity):
    for h in capacity["hindsight"]:
        rows = [r for rs in capacity["runs"].values() for r in rs if r["phase"] == h["phase"]
                and r["run"] != "replan" and r["drop"] <= 0.1]  # fmt: skip
        assert h["phase_ms"] == min(r["phase_ms"] for r in rows)


def test_a_runs_dropped_fraction_per_step_is_its_layers_load_metrics():
    cfg = MoEConfig(gate=GateConfig(num_experts=4, top_k=2, capacity_factor=1.0, logit_bias=True),
                    experts=ExpertConfig(model_dim=16, hidden_dim=32),
                    schedule=ScheduleConfig(policy="sequential"))  # fmt: skip
    run = Run("r", cfg, cfg, layers=2, seed=0, lr=0.0)
    g = torch.Generator().manual_seed(0)
    run.warm(torch.randn(64, 16, generator=g))
    for m in run.layers:
        m.take_load_metrics()  # the warm step's
    want = []
    for s in (3.0, 0.5):
        run.prepare(
            torch.randn(64, 16, generator=g), phase_bias(Phase("zipf", s), 0, 1, [0, 1, 2, 3])
        )
        run.step()
        per = [m.take_load_metrics() for m in run.layers]
        want.append(1 - sum(p.kept for p in per) / sum(p.choices for p in per))
    assert run.dropped() == pytest.approx(want) and want[0] > 0.3


def test_the_json_has_every_run_and_every_phase(summary):
    names = [p.name for p in parse_phases(PHASES)]
    assert summary["phases"] == names
    for run in ("fixed0", "replan"):
        assert [r["phase"] for r in summary["runs"][run]] == names
    assert [h["phase"] for h in summary["hindsight"]] == names
    assert {"fixed0", "replan", "hindsight"} <= set(summary["totals_ms"])
    assert set(summary["overhead_ms"]) == {"overhead:fixed0", "overhead:replan"}


def test_the_replan_runs_switches_are_recorded_with_their_steps(summary):
    switches = summary["switches"]
    assert switches, "on TOY the skewed phase has another best plan"
    for s in switches:
        assert s["step"] > 1 and s["layer"] in (0, 1) and s["old"] != s["new"]
    assert [s["step"] for s in switches] == sorted(s["step"] for s in switches)


def test_the_hindsight_set_holds_every_plan_the_replanner_switched_to(summary):
    runs = set(summary["runs"])
    for s in summary["switches"]:
        n = s["new"]
        name = f"{n['policy']}/r{n['chunks']}/{n['algorithm']}/{n['compression']}"
        assert name == summary["fixed0"] or f"fixed:{name}" in runs


def test_the_ratios_are_the_runs_totals(summary):
    t = summary["totals_ms"]
    assert summary["speedup_vs_fixed0"] == pytest.approx(t["fixed0"] / t["replan"])
    assert summary["replan_vs_hindsight"] == pytest.approx(t["replan"] / t["hindsight"])
    o = summary["overhead_ms"]
    assert summary["overhead_pct"] == pytest.approx(
        (o["overhead:replan"] / o["overhead:fixed0"] - 1) * 100
    )


def test_the_replan_rows_carry_a_prediction_and_its_ratio(summary):
    for row in summary["runs"]["replan"]:
        assert row["predicted_ms"] > 0
        assert row["ratio"] == pytest.approx(row["predicted_ms"] / row["median_ms"])


# ------------------------------------------------------------------ the scenario's pieces
def test_phases_parse_balanced_zipf_and_rotating_zipf():
    assert parse_phases("zipf:1.2:rotate, balanced,zipf:2") == [
        Phase("zipf", 1.2, True),
        Phase("balanced"),
        Phase("zipf", 2.0, False),
    ]


def test_a_zipf_bias_is_minus_s_log_rank_over_the_order_and_rotates_by_one():
    order = [2, 0, 3, 1]
    b = phase_bias(Phase("zipf", 2.0, True), 0, 5, order)
    assert b.tolist() == pytest.approx([-2 * math.log(2), -2 * math.log(4), 0.0, -2 * math.log(3)])
    moved = phase_bias(Phase("zipf", 2.0, True), 5, 5, order)  # hottest: order[(0 + 1) % 4]
    assert moved[0] == 0.0 and moved[2] == pytest.approx(-2 * math.log(4))


def test_a_balanced_phase_has_no_bias():
    assert phase_bias(Phase("balanced"), 3, 2, [1, 0]).tolist() == [0.0, 0.0]


# ------------------------------------------------------------------ bad flags
REFUSED = [
    (["--phases", "zipf"], "--phases: phase 'zipf': expected balanced, zipf:S or zipf:S:rotate"),
    (["--phases", "zipf:-1"], "--phases: phase 'zipf:-1'"),
    (["--phases", "uniform"], "--phases: phase 'uniform'"),
    (["--phase-steps", "0"], "--phase-steps must be >= 1 (each), got 0"),
    (["--phase-steps", "10,10,10"], "--phase-steps 10,10,10: give one count or one per phase (2"),
    (["--phase-steps", "10,7"], "--phase-steps 7 must be a multiple of --replan-every 5"),
    (
        ["--capacity-factors", "1,2"],
        "--capacity-factors 1,2 needs capacity mode: give --capacity-f",
    ),
    (["--capacity-factors", "0,2", "--capacity-factor", "1"], "--capacity-factors must be > 0"),
    (["--max-drop", "1"], "--max-drop must be >= 0 and <= 0.99 and finite, got 1"),
    (["--overhead-every", "0"], "--overhead-every must be >= 1, got 0"),
    (["--phase-steps", "7"], "--phase-steps 7 must be a multiple of --replan-every 5"),
    (["--rotate-every", "0"], "--rotate-every must be >= 1, got 0"),
    (["--replan-every", "0"], "--replan-every must be >= 1, got 0"),
    (["--replan-threshold", "1"], "--replan-threshold must be < 1, got 1"),
    (["--replan-threshold", "-0.1"], "--replan-threshold must be >= 0"),
    (["--replan-confirm", "0"], "--replan-confirm must be >= 1, got 0"),
    (["--overhead-steps", "0"], "--overhead-steps must be >= 1, got 0"),
    (["--candidates", "0"], "--candidates must be >= 1, got 0"),
    (["--layers", "0"], "--layers must be >= 1, got 0"),
    (["--lr", "-1"], "--lr must be >= 0"),
    (["--experts", "3"], "--experts 3 must be divisible by the 2 ranks"),
    (["--top-k", "9"], "--top-k 9 must be <= the 4 experts"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_bad_flag_gives_one_line_naming_it(argv, message, capfd):
    try:
        rc = cli.main(["bench", "replan", "--nproc", "2", *argv])
    except SystemExit as e:  # a flag's own range: the parser's error
        rc = e.code
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err


def test_the_replan_runs_decision_and_other_steps_split_all_its_steps(summary):
    decision, other = summary["replan_steps"]
    steps = summary["step_ms"]["replan"]
    assert (decision["phase"], other["phase"]) == ("decision", "other")
    assert decision["steps"] + other["steps"] == len(steps) == 3 * 4  # 3 phases x 4 steps
    assert decision["phase_ms"] + other["phase_ms"] == pytest.approx(sum(steps), abs=0.1)
