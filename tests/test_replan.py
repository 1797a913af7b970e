"""The re-planner: pricing a routing picture, switching with threshold and hysteresis, every rank
agreeing, and a re-planned run equal to the same plans forced at the same steps."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from moe_cases import step_without_host_sync
from schemoe import (
    ExpertConfig,
    GateConfig,
    MoEConfig,
    MoELayer,
    ParallelConfig,
    ScheduleConfig,
    trace,
)
from schemoe.costmodel.hardware import Hardware, Link
from schemoe.train import loop
from schemoe.tuning import replan
from schemoe.tuning.picture import Picture, on_grid, plan_for
from schemoe.tuning.replan import Replanner, schedule_of
from schemoe.tuning.switch import plan_name
from train_cases import tiny

E, M, H = 4, 16, 32
# A made-up cluster on which r and policy matter at these tiny shapes: slow links and compute,
# cheap fixed costs (the presets' fixed costs hide every difference at this size).
TOY = Hardware(name="toy", nodes=1, ranks_per_node=2, intra=Link(1e-5, 1e7),
               inter=Link(1e-5, 1e7), flops=1e8, gemm_alpha=1e-5, memory=1e10,
               task_overhead=1e-4)  # fmt: skip
TOKENS = 64  # tokens per rank per call in the scripted pictures


def _config(policy: str = "sequential", chunks: int = 1, f: float = 0.0) -> MoEConfig:
    return MoEConfig(
        gate=GateConfig(num_experts=E, top_k=2, capacity_factor=f),
        experts=ExpertConfig(model_dim=M, hidden_dim=H),
        schedule=ScheduleConfig(policy=policy, chunks=chunks),
    )


def _even(calls: int = 1) -> Picture:
    """Both ranks send k T / E choices to every expert, per call."""
    n = 2 * TOKENS // E * calls
    return Picture(((n,) * E, (n,) * E), (calls, calls), (TOKENS * calls, TOKENS * calls))


def _skewed(calls: int = 1) -> Picture:
    """Every choice of both ranks goes to rank 0's experts."""
    n = TOKENS * calls
    return Picture(((n, n, 0, 0), (n, n, 0, 0)), (calls, calls), (TOKENS * calls, TOKENS * calls))


# ------------------------------------------------------------------ the picture and its price
def test_the_send_matrix_sums_each_destinations_experts_per_call():
    pic = Picture(((10, 10, 0, 0), (6, 2, 0, 4)), (2, 2), (10, 6))
    assert pic.send_PP == [[10.0, 0.0], [4.0, 2.0]]
    assert pic.load_E == [16, 12, 0, 4]


def test_a_skewed_picture_is_priced_at_the_busiest_ranks_volume_when_dropless():
    pic = Picture(((10, 10, 0, 0), (6, 2, 0, 0)), (1, 1), (10, 4))
    # rank 0 receives 20 + 8 = 28 rows per call, the most any rank sends or receives: 28 / k.
    assert pic.busiest() == 28 and pic.priced_tokens(2, dropless=True) == 14


def test_a_capacity_layer_is_priced_at_its_tokens_whatever_the_skew():
    assert _skewed(3).priced_tokens(2, dropless=False) == TOKENS


def test_an_even_picture_is_priced_at_its_own_tokens():
    assert _even(4).priced_tokens(2, dropless=True) == TOKENS and _even().skew() == 1.0


def test_a_picture_without_one_row_per_rank_names_the_row_counts():
    with pytest.raises(ValueError, match="2, 1 and 2 rows"):
        Picture(((1, 1), (1, 1)), (1,), (1, 1))


def test_plan_for_gives_no_gain_when_the_best_plan_is_the_running_one():
    hw = TOY.with_topology(1, 2)
    best, _, _ = plan_for(_config(), TOKENS, hw, "lossless")
    again, _, gain = plan_for(best, TOKENS, hw, "lossless")
    assert again == best and gain == 0.0


def test_dropped_keeps_up_to_the_capacity_of_each_expert_per_rank():
    # T = 8 per call, k = 2, E = 4: f = 1 gives C = 4 rows per expert; expert 0 asks for 8.
    pic = Picture(((8, 4, 4, 0),), (1,), (8,))
    assert pic.dropped(1.0, 2) == pytest.approx(4 / 16) and pic.dropped(2.0, 2) == 0.0


# ------------------------------------------------------------------ the capacity factor, opt-in
def _one_rank_skew() -> Picture:
    """One rank, every choice on experts 0 and 1: f = 2 keeps them all."""
    return Picture(((TOKENS, TOKENS, 0, 0),), (1,), (TOKENS,))


def _capacity_run(factors: tuple[float, ...]) -> list[tuple]:
    layer = MoELayer(_config(f=1.0))
    rp = Replanner(layer, every=10, capacity_factors=factors, hardware=TOY)
    for step in (10, 20, 30):
        rp.decide(step, {0: _one_rank_skew()})
    even = Picture(((TOKENS // 2,) * E,), (1,), (TOKENS,))
    for step in (40, 50):
        rp.decide(step, {0: even})
    return [(s.step, s.new.get("capacity_factor")) for s in rp.history]


def test_an_opted_in_capacity_layer_raises_f_under_skew_and_lowers_it_when_even():
    assert _capacity_run((1.0, 1.5, 2.0)) == [(21, 2.0), (51, 1.0)]


def test_a_capacity_layer_keeps_its_f_unless_opted_in():
    assert all(f is None for _, f in _capacity_run(()))


def test_configure_takes_another_f_in_capacity_mode_but_not_dropless():
    layer = MoELayer(_config(f=1.0))
    layer.configure(_config(f=2.0))
    assert layer.running.gate.capacity_factor == 2.0
    with pytest.raises(ValueError, match="capacity-mode f"):
        layer.configure(_config(f=0.0))


# ------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"every": 0}, "every must be an int >= 1, got 0"),
        ({"every": 2.5}, "every must be an int >= 1, got 2.5"),
        ({"confirm": 0}, "confirm must be an int >= 1, got 0"),
        ({"threshold": 1.0}, r"threshold must be a number in \[0, 1\), got 1.0"),
        ({"threshold": -0.1}, r"threshold must be a number in \[0, 1\), got -0.1"),
        ({"budget": "cheap"}, "budget must be one of .* got 'cheap'"),
        ({"start": -1}, "start must be an int >= 0, got -1"),
        ({"capacity_factors": (1.0, 0.0)}, r"capacity_factors .* got \(1.0, 0.0\)"),
        ({"max_drop": 1.5}, r"max_drop must be a number in \[0, 1\), got 1.5"),
        ({"schedule": {0: {}}}, "a schedule step must be an int >= 1, got 0"),
        ({"schedule": {3: {5: _config()}}}, "layer 5 is not a MoE layer index"),
        ({"schedule": {3: {0: _config("auto")}}}, "fixed policy"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_a_bad_replanner_argument_raises_value_error_naming_it(kwargs, named):
    with pytest.raises(ValueError, match=named):
        Replanner(MoELayer(_config()), **kwargs)


def test_a_step_that_does_not_advance_names_the_last_one():
    rp = Replanner(MoELayer(_config()), start=4)
    with pytest.raises(ValueError, match=r"> the last one \(4\), got 4"):
        rp.step(4)


# ------------------------------------------------------------------ scripted pictures, 2 ranks
# Decision points every 10 steps see: even, skewed, even, skewed, skewed, skewed, even.
SCRIPT = [(10, "even"), (20, "skewed"), (30, "even"), (40, "skewed"), (50, "skewed"),
          (60, "skewed"), (70, "even")]  # fmt: skip


def _scripted(rank, world, confirm, threshold_x):
    hw = TOY.with_topology(1, 2)
    start, _, _ = plan_for(_config(), TOKENS, hw, "lossless")  # the even picture's best plan
    tokens = _skewed().priced_tokens(2, dropless=True)
    _, _, gain = plan_for(start, tokens, hw, "lossless")
    assert gain > 0  # on TOY the skewed picture has another best plan
    layer = MoELayer(start)
    rp = Replanner(layer, every=10, threshold=gain * threshold_x, confirm=confirm, hardware=TOY)
    for step, kind in SCRIPT:
        rp.decide(step, {0: _even() if kind == "even" else _skewed()})
    return [(s.step, s.old, s.new, round(s.predicted_gain, 12)) for s in rp.history]


@pytest.mark.parametrize(
    ("confirm", "threshold_x", "steps"),
    [(2, 0.5, [51]), (1, 0.5, [21]), (2, 2.0, [])],
    ids=["two-wins-in-a-row", "one-win", "gain-under-threshold"],
)
def test_scripted_skew_switches_at_the_expected_steps_and_the_ranks_agree(
    ranks, confirm, threshold_x, steps
):
    every = ranks(2).run(_scripted, confirm, threshold_x)
    assert every[0] == every[1]  # the same decisions on both ranks
    assert [s for s, *_ in every[0]] == steps


# ------------------------------------------------------------------ a run, replanned vs forced
class _Tiny(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.inp = nn.Linear(M, M)
        self.moe = nn.ModuleList([MoELayer(cfg, seed=1), MoELayer(cfg, seed=2)])

    def forward(self, x):
        h, aux = self.inp(x), 0.0
        for m in self.moe:
            y, a = m(h)
            h, aux = h + y, aux + a
        return h, aux


def _train(rank, world, schedule, steps=8):
    torch.manual_seed(0)
    model = _Tiny(_config("tutel", 8))  # slow on TOY at this size: the re-planner leaves it
    if schedule is None:
        rp = Replanner(model, every=2, threshold=0.05, confirm=2, hardware=TOY)
    else:
        rp = Replanner(model, every=2, schedule=schedule)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(1, steps + 1):
        x = torch.randn(TOKENS, M, generator=g)
        h, aux = model(x)
        loss = h.pow(2).mean() + aux
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        rp.step(step)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params, rp.history


def _replanned_then_forced(rank, world):
    losses, params, history = _train(rank, world, None)
    f_losses, f_params, f_history = _train(rank, world, schedule_of(history))
    return (
        [(s.step, s.layer, s.new) for s in history],
        [(s.step, s.layer, s.new) for s in f_history],
        losses == f_losses,
        all(torch.equal(params[n], f_params[n]) for n in params),
    )


def test_a_replanned_run_equals_the_run_with_its_plans_forced_at_the_same_steps(ranks):
    every = ranks(2).run(_replanned_then_forced)
    switches, forced = every[0][:2]
    assert switches and forced == switches  # it switched, and forcing replays the same switches
    assert every[1][0] == switches  # both ranks took the same decisions
    for rank, (*_, same_losses, same_params) in enumerate(every):
        assert same_losses and same_params, (
            f"rank {rank}: losses {same_losses}, params {same_params}"
        )


def test_forced_plans_at_the_first_step_apply_at_construction():
    layer = MoELayer(_config("tutel", 4))
    target = dataclasses.replace(_config(), schedule=ScheduleConfig(policy="schemoe", chunks=2))
    rp = Replanner(layer, schedule={1: {0: target}, 3: {0: _config()}})
    assert layer.running == target and [s.step for s in rp.history] == [1]
    rp.step(1)
    assert layer.running == target
    rp.step(2)  # the plan of step 3 runs from step 3 on
    assert layer.running == _config() and [s.step for s in rp.history] == [1, 3]


def test_a_trace_shows_which_plan_each_layer_ran_at_each_step():
    model = _Tiny(_config("tutel", 4))
    target = dataclasses.replace(_config(), schedule=ScheduleConfig(policy="schemoe", chunks=2))
    rp = Replanner(model, schedule={3: {1: target}})
    with trace.record() as tl:
        for step in range(1, 5):
            model(torch.randn(TOKENS, M))
            rp.step(step)
    plans = [e for e in tl.events if e.resource.startswith("plan")]  # beside the layers' tasks
    spans = [(e.resource, e.task) for e in plans]
    first, second = plan_name(_config("tutel", 4)), plan_name(target)
    assert spans[::2] == [("plan L0", f"L0 {first}")] * 4
    assert spans[1::2] == [("plan L1", f"L1 {first}")] * 2 + [("plan L1", f"L1 {second}")] * 2
    assert all(a.end <= b.start + 1e-9 for a, b in zip(plans[::2], plans[2::2]))
    tasks = [e for e in tl.events if not e.resource.startswith("plan")]
    assert all(plans[0].start <= e.start and e.end <= plans[-1].end for e in tasks)


# ------------------------------------------------------------------ schemoe train --replan
@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--replan-every", "0"], "--replan-every must be >= 1, got 0"),
        (["--replan", "--micro-chunks", "2"], "--micro-chunks 2 cannot run --replan"),
    ],
    ids=["every-0", "with-micro-chunks"],
)
def test_a_bad_replan_flag_names_it(argv, named):
    with pytest.raises(ValueError, match=named):
        tiny(*argv)


def test_train_with_replan_switches_a_slow_plan_and_logs_the_switch(tmp_path, capsys, monkeypatch):
    # The planning record: TOY, not a quick profile of this machine (seconds, and a machine's
    # figures); the rest is the run's own path.
    monkeypatch.setattr(replan, "plan_record", lambda topo, *a, **k: (TOY, None))
    log = tmp_path / "m.jsonl"
    out = loop.train(0, 1, tiny("--steps", "6", "--replan", "--replan-every", "2", "--policy",
                             "tutel", "--chunks", "8", "--eval-seqs", "0", "--log-file",
                             str(log)))  # fmt: skip
    (switch,) = out["replans"]
    assert switch["step"] == 5 and switch["old"]["chunks"] == 8 and switch["predicted_gain"] > 0
    assert out["moe_layers"] == [switch["new"]]
    rows = [json.loads(ln)["replan"] for ln in log.read_text().splitlines() if "replan" in ln]
    assert [r["measured_gain"] is None for r in rows] == [True, False]  # made, then measured
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("replan:")]
    assert len(lines) == 1 and "from step 5 (was tutel r=8 naive none" in lines[0]


def test_train_with_replan_capacity_factors_switches_f_by_its_drop_budget(monkeypatch, capsys):
    monkeypatch.setattr(replan, "plan_record", lambda topo, *a, **k: (TOY, None))
    out = loop.train(0, 1, tiny("--steps", "4", "--replan", "--replan-every", "2",
                                "--capacity-factor", "1.25", "--replan-capacity-factors", "3,4",
                                "--replan-max-drop", "0", "--eval-seqs", "0"))  # fmt: skip
    # No drop at all: f = 3 is the smallest that keeps every choice (one process, E = 2).
    assert [(s["step"], s["new"]["capacity_factor"]) for s in out["replans"]] == [(5, 3.0)]
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("replan:")]
    assert "none f=3 from step 5 (was schemoe r=2 naive none f=1.25;" in line


# ------------------------------------------------------------------ the window
def _calls(layer: MoELayer, n: int) -> None:
    for _ in range(n):
        y, aux = layer(torch.randn(TOKENS, M))
        (y.sum() + aux).backward()


def test_the_first_window_starts_when_the_replanner_is_attached():
    layer = MoELayer(_config())
    layer.record_routing = True  # as the metrics turn it on before the re-planner exists
    _calls(layer, 2)
    rp = Replanner(layer, every=3, hardware=TOY)
    _calls(layer, 3)
    rp.step(3)
    pic = rp.pictures[0]
    assert pic.calls_P == (3,) and sum(pic.counts_PE[0]) == 3 * TOKENS * 2  # k = 2 choices


def test_taking_the_load_metrics_does_not_empty_the_replanners_window():
    layer = MoELayer(_config())
    rp = Replanner(layer, every=2, hardware=TOY)
    _calls(layer, 1)
    assert layer.take_load_metrics() is not None
    _calls(layer, 1)
    rp.step(2)
    assert sum(rp.pictures[0].counts_PE[0]) == 2 * TOKENS * 2


def test_eval_calls_are_not_in_the_window():
    layer = MoELayer(_config())
    rp = Replanner(layer, every=1, hardware=TOY)
    _calls(layer, 1)
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(TOKENS, M))
    rp.step(1)
    assert rp.pictures[0].calls_P == (1,) and rp.pictures[0].tokens_P == (TOKENS,)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_watched_calls_make_no_host_sync_and_are_timed_at_the_decision_point():
    cfg = dataclasses.replace(
        _config("tutel", 2, f=1.25), parallel=ParallelConfig(uniform_tokens=True)
    )
    layer = MoELayer(cfg).cuda()
    rp = Replanner(layer, every=2, hardware=TOY)
    x = torch.randn(TOKENS, M, device="cuda", requires_grad=True)
    layer(x)[0].sum().backward()  # warm
    step_without_host_sync(layer, x)
    rp.step(1)
    rp.step(2)  # the decision point: events read, tally gathered
    assert rp.pictures[0].calls_P == (2,) and rp._watch[0].before_s > 0


@pytest.mark.parametrize("tokens", [1, 14, 31, 32, 100, 1000, 1024, 1025, 4096, 123_457])
def test_priced_tokens_round_up_to_a_grid_within_one_step_of_4_4_percent(tokens):
    t = on_grid(tokens)
    assert tokens <= t <= math.ceil(tokens * 2 ** (1 / 16)) + 1
    assert on_grid(t) == t  # a grid point is its own price
    if tokens < 32:
        assert t == tokens
