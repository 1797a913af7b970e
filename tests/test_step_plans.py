"""Whole-step plans (costmodel/plans.py), the one decision for the step (tuning/stepplan.py) and
`bench step --auto-step` (bench/autostep.py): the grid, the pricing each caller shares, the
choice and its reason, every rank taking rank 0's choice, and the bench run's columns and
refusals. No timing assertions: which plan is fastest on this box is whatever it is."""

from __future__ import annotations

import json

import pytest
from test_bench_bound import TINY, _parse

from schemoe.bench import autostep
from schemoe.bench import step as bench_step
from schemoe.costmodel import preset, profiles
from schemoe.costmodel.plans import StepPlan, plan_grid, predict_plan, rank_plans
from schemoe.costmodel.stack import predict_stack_step
from schemoe.costmodel.step import StepShape, predict_step
from schemoe.dist.topology import Topology
from schemoe.profile.steps import shape_of
from schemoe.train import checks
from schemoe.tuning.stepplan import choose_step, decide

SHAPE = StepShape(batch=8, seq_len=64, model_dim=256, hidden=512, layers=4, experts=8, top_k=2)
HW = preset("local").with_topology(2, 2)
OPTIONS = {"algorithm": "naive", "grad_algorithm": "hier", "bucket_bytes": 2**20}


def _grid(world: int = 4, **kw) -> list[StepPlan]:
    axes = {"policies": ("sequential", "fastermoe", "schemoe"), "chunks": (1, 4, 8),
            "micro_chunks": (1, 2, 3), "grad_syncs": ("ddp", "scheduled"),
            "grad_compressors": ("none", "bf16")} | kw  # fmt: skip
    return plan_grid(*axes.values(), world=world, batch=8)


def test_the_grid_keeps_the_given_order_and_leaves_out_what_cannot_run():
    plans = _grid()
    assert plans[0] == StepPlan("sequential", 1, 1, "ddp", "none")
    assert plans[1] == StepPlan("sequential", 1, 1, "ddp", "bf16")
    assert not [p for p in plans if p.micro_chunks == 3]  # 3 does not divide the batch of 8
    assert not [p for p in plans if p.policy == "fastermoe" and p.chunks == 8]  # 8 peer groups > 4
    assert [p for p in plans if p.policy == "schemoe" and p.chunks == 8]
    assert len(plans) == 3 * 3 * 2 * 2 * 2 - 2 * 2 * 2  # less fastermoe's r = 8


def test_a_plans_name_is_bench_steps_row_name():
    assert StepPlan("schemoe", 4, 1, "scheduled", "bf16").name == "schemoe/r4/scheduled/bf16"
    assert StepPlan("sequential", 1, 2, "ddp", "none").name == "sequential/r1/m2/ddp/none"


def test_one_pricing_serves_every_caller_m1_by_the_step_model_and_m2_by_the_stack_model():
    m1 = StepPlan("schemoe", 4, 1, "scheduled", "bf16")
    want = predict_step(HW, SHAPE, "schemoe", "naive", 4, grad_sync="scheduled",
                        grad_compress="bf16", grad_algorithm="hier", bucket_bytes=2**20)  # fmt: skip
    assert predict_plan(HW, SHAPE, m1, **OPTIONS) == want
    m2 = StepPlan("schemoe", 4, 2, "ddp", "none")
    want = predict_stack_step(HW, SHAPE, "schemoe", "naive", 4, micro=2, grad_sync="ddp",
                              grad_compress="none", grad_algorithm="flat", bucket_bytes=2**20)  # fmt: skip
    assert predict_plan(HW, SHAPE, m2, **OPTIONS).step_s == want.step_s  # DDP's all-reduce: flat


def test_plans_are_ranked_fastest_first_and_the_choice_is_the_first_with_its_reason():
    plans = _grid(micro_chunks=(1, 2))
    ranked = rank_plans(HW, SHAPE, plans, **OPTIONS)
    times = [p.step_s for _, p in ranked]
    assert times == sorted(times) and {p for p, _ in ranked} == set(plans)
    choice = decide(HW, SHAPE, plans, **OPTIONS)
    assert choice.plan == ranked[0][0] and len(choice.ranked) == len(plans)
    assert choice.predicted_ms == pytest.approx(ranked[0][1].step_s * 1e3, abs=1e-3)
    nxt, last = choice.ranked[1][0], choice.ranked[-1][0]
    assert choice.reason.startswith(f"{choice.plan.name}: predicted {choice.predicted_ms:.1f} ms")
    assert f"next {nxt.name}" in choice.reason and f"slowest {last.name}" in choice.reason
    assert f"of {len(plans)} candidates" in choice.reason
    only = decide(HW, SHAPE, plans[:1], **OPTIONS)
    assert only.plan == plans[0] and only.reason.endswith("(the only candidate)")
    with pytest.raises(ValueError, match="at least one candidate plan"):
        decide(HW, SHAPE, [], **OPTIONS)


def _choose(rank: int, world: int) -> tuple[str, float]:
    # Each rank holds another record: only rank 0's decides, every rank builds the same step.
    hw = preset("local" if rank == 0 else "paper-32gpu").with_topology(1, world)
    topo = Topology.from_group(None, world)
    choice = choose_step(SHAPE, _grid(world, micro_chunks=(1, 2)), topo, hardware=hw, **OPTIONS)
    return choice.plan.name, choice.predicted_ms


def test_every_rank_takes_rank_0s_choice(ranks):
    got = ranks(2).run(_choose)
    own = decide(
        preset("local").with_topology(1, 2), SHAPE, _grid(2, micro_chunks=(1, 2)), **OPTIONS
    )
    assert got[0] == got[1] == (own.plan.name, own.predicted_ms)


# ------------------------------------------------------------------ bench step --auto-step
def _profile(tmp_path, nodes: int, rpn: int) -> str:
    path = str(tmp_path / "profiles.json")
    key = profiles.save(preset("local").with_topology(nodes, rpn), path)
    assert key == f"{nodes}x{rpn}@inter=unshaped,intra=unshaped"
    return path


def test_auto_step_prices_every_row_and_reports_its_choice_against_the_best_row(capfd, tmp_path):
    path = _profile(tmp_path, 1, 2)
    args = _parse(["bench", "step", "--nproc", "2", *TINY, "--policies", "sequential,schemoe",
                   "--chunks", "1,2", "--micro-chunks", "1,2", "--grad-syncs", "ddp,scheduled",
                   "--grad-windows", "1,2", "--auto-step", "--profile", path])  # fmt: skip
    assert args.func(args) == 0
    lines = capfd.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    rows, auto = out["results"], out["auto_step"]
    priced = [r for r in rows if r["grad_window"] == 1]
    assert len(priced) == 2 * 2 * 2 * 2 and all(r["predicted_ms"] > 0 for r in priced)
    assert all(r["predicted_ms"] is None for r in rows if r["grad_window"] != 1)
    plans = [autostep.plan_of(r) for r in priced]
    hw = profiles.load("1x2@inter=unshaped,intra=unshaped", path)
    want = decide(hw, shape_of(out_config(lines)), plans,
                  algorithm="naive", grad_algorithm="flat", bucket_bytes=2**20)  # fmt: skip
    assert auto["chosen"] == want.plan.name and auto["plan"] == want.plan.row()
    assert auto["reason"] == want.reason
    by_name = {autostep.plan_of(r).name: r["median_ms"] for r in priced}
    assert auto["measured_ms"] == by_name[auto["chosen"]]
    assert auto["best_ms"] == min(by_name.values()) == by_name[auto["best"]]
    assert auto["vs_best"] == pytest.approx(auto["measured_ms"] / auto["best_ms"], abs=1e-4)
    line = next(ln for ln in lines if ln.startswith("# auto step"))
    assert want.reason in line and f"the best row {auto['best']}" in line


def out_config(lines: list[str]) -> dict:
    """The `# config:` header of a bench output as a dict of numbers and names."""
    text = next(ln for ln in lines if ln.startswith("# config:"))[len("# config:") :]
    pairs = (kv.split("=", 1) for kv in text.split())
    return {k: (float(v) if "." in v else int(v)) if v[0].isdigit() else v for k, v in pairs}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policies", "auto"], "--auto-step with --policies auto: auto's step choice ranks"),
        (["--grad-accum", "2"], "--auto-step with --grad-accum 2: the step's cost model prices"),
        ([], "--auto-step: no profile '1x2@inter=unshaped,intra=unshaped' in --profile"),
    ],
)
def test_auto_step_refuses_before_any_rank_starts(capfd, tmp_path, argv, message):
    path = _profile(tmp_path, 2, 1)  # another topology's record: not this run's
    args = _parse(["bench", "step", "--nproc", "2", *TINY, "--auto-step", "--profile", path, *argv])
    assert args.func(args) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    if not argv:
        assert (
            "it holds: 2x1@inter=unshaped,intra=unshaped" in err[0] and "schemoe profile" in err[0]
        )


def test_bench_step_counts_every_rows_model_against_the_memory(capfd, monkeypatch):
    monkeypatch.setattr(checks, "available_memory", lambda: 2**20)  # 1 MiB available
    monkeypatch.setattr(bench_step, "check_optional", lambda args: None)  # CI has no DeepSpeed
    args = _parse(["bench", "step", "--nproc", "2", *TINY, "--policies", "sequential,schemoe",
                   "--grad-syncs", "ddp,scheduled", "--grad-windows", "1,2", "--peer", "deepspeed"])  # fmt: skip
    assert bench_step.row_count(args) == 2 * (1 + 2) + 1  # DDP rows once, scheduled per window
    assert args.func(args) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the grid's 7 rows" in err[0] and "more than the 0.0 GiB" in err[0]
