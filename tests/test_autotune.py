"""Policy "auto": the model's shortlist, the measured trials, and the layer that runs them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from moe_cases import close, global_weights, inputs, run_layer, run_reference
from schemoe import ExpertConfig, GateConfig, MoEConfig, MoELayer, ScheduleConfig
from schemoe.costmodel import prediction
from schemoe.costmodel.hardware import Link, preset
from schemoe.costmodel.model import LayerShape
from schemoe.costmodel.profiles import fit_link
from schemoe.tuning import choose as tune
from schemoe.tuning.auto import AutoTuner, Trials

E, M, H = 8, 12, 20


def _config(trials=2, shortlist=3) -> MoEConfig:
    return MoEConfig(
        gate=GateConfig(num_experts=E, top_k=2, capacity_factor=1.0),
        experts=ExpertConfig(model_dim=M, hidden_dim=H),
        schedule=ScheduleConfig(policy="auto", trials=trials, shortlist=shortlist),
    )


def _candidates(n: int) -> list[MoEConfig]:
    base = _config()
    return [
        dataclasses.replace(base, schedule=ScheduleConfig(policy="tutel", chunks=r))
        for r in (1, 2, 4, 8)[:n]
    ]


# ------------------------------------------------------------------ measured link curves
def test_a_link_with_points_interpolates_between_them_and_extends_the_end_segments():
    link = Link(alpha=0.0, beta=1e6, points=((1000, 0.002), (2000, 0.003), (4000, 0.007)))
    assert link.time(1500) == pytest.approx(0.0025)
    assert link.time(4000) == pytest.approx(0.007)
    assert link.time(6000) == pytest.approx(0.011)  # the last segment's 2e-6 s/B
    assert link.time(500) == pytest.approx(0.0015)  # the first segment's line
    assert link.time(10) == pytest.approx(0.002 - 990e-6)
    steep = Link(alpha=0.0, beta=1e6, points=((1000, 0.001), (2000, 0.003)))
    assert steep.time(10) == pytest.approx(0.001 * 10 / 1000)  # never below t0 b / b0
    assert link.time(0) == 0.0
    plain = Link(alpha=0.001, beta=1e6)
    assert plain.time(1000) == pytest.approx(0.002)


@pytest.mark.parametrize(
    "points",
    [((1000, 0.002),), ((2000, 0.002), (1000, 0.003)), ((1000, 0.003), (2000, 0.002))],
)
def test_a_link_refuses_points_that_are_not_a_growing_curve(points):
    with pytest.raises(ValueError, match="link points"):
        Link(alpha=0.0, beta=1e6, points=points)


def test_fit_link_keeps_the_median_per_size_as_a_non_decreasing_curve():
    link = fit_link([1000, 1000, 1000, 2000, 4000], [0.005, 0.001, 0.002, 0.0015, 0.004])
    assert link.points == ((1000.0, 0.002), (2000.0, 0.002), (4000.0, 0.004))
    assert link.beta > 0
    hw = dataclasses.replace(preset("local"), inter=link)
    assert type(hw).from_json(hw.to_json()) == hw  # curves survive the profile cache


def test_fit_link_on_samples_that_fall_with_size_keeps_a_flat_curve_and_a_finite_rate():
    # A fast loopback link: the smallest transfer happened to be the slowest (seen in profiles).
    link = fit_link([65536, 262144, 1048576], [0.0044, 0.0019, 0.0024])
    assert link.points == ((65536.0, 0.0044), (262144.0, 0.0044), (1048576.0, 0.0044))
    assert (link.alpha, link.beta) == (0.0, pytest.approx(1048576 / 0.0044))


# ------------------------------------------------------------------ the shortlist
def test_the_shortlist_holds_one_candidate_per_partition_and_chunk_count_fastest_first():
    hw = preset("local")
    preds = tune.explore(hw, LayerShape(1024, 256, 1024, 8), chunk_grid=tune.AUTO_CHUNKS)
    short = tune.shortlist(preds, 4)
    assert len(short) == 4
    keys = [(tune.POLICIES.get(p.policy).partition, p.chunks) for p in short]
    assert len(set(keys)) == 4
    assert [p.step_s for p in short] == sorted(p.step_s for p in short)
    assert short[0].step_s == min(p.step_s for p in preds)
    assert {p.chunks for p in short} <= set(tune.AUTO_CHUNKS)


def test_the_shortlist_prefers_a_fixed_policy_unless_search_is_clearly_faster():
    P = prediction.Prediction
    preds = [
        P("search", "naive", ("none", "none"), 2, 0.100, 0.0, 0.0),
        P("schemoe", "naive", ("none", "none"), 2, 0.1004, 0.0, 0.0),
        P("search", "naive", ("none", "none"), 4, 0.090, 0.0, 0.0),
        P("tutel", "naive", ("none", "none"), 4, 0.095, 0.0, 0.0),
    ]
    got = [(p.policy, p.chunks) for p in tune.shortlist(preds, 4)]
    assert got == [("search", 4), ("schemoe", 2)]


def test_the_shortlist_breaks_near_ties_toward_schemoe_and_keeps_a_clear_winner():
    P = prediction.Prediction
    none = ("none", "none")
    preds = [
        P("tutel", "naive", none, 8, 0.4220, 0.0, 0.0),  # link-bound: the model ties them
        P("schemoe", "pipe", none, 8, 0.4221, 0.0, 0.0),
        P("tutel", "naive", none, 4, 0.500, 0.0, 0.0),  # a clear winner stays
        P("schemoe", "naive", none, 4, 0.520, 0.0, 0.0),
    ]
    got = [(p.policy, p.algorithm, p.chunks) for p in tune.shortlist(preds, 4)]
    assert got == [("schemoe", "pipe", 8), ("tutel", "naive", 4)]


def test_choose_shortlist_returns_that_many_distinct_configurations():
    picks = tune.choose_shortlist(_config(), 1024, (2, 2), preset("local"), n=3)
    assert isinstance(picks, list) and len(picks) == 3
    assert len({(c.schedule.policy, c.schedule.chunks) for c in picks}) == 3
    assert tune.choose(_config(), 1024, (2, 2), preset("local")) == picks[0]


# ------------------------------------------------------------------ trials
def test_trials_run_round_robin_skip_the_warm_up_round_and_keep_the_fastest_median():
    cands = _candidates(3)
    trials = Trials(cands, samples=2)
    seconds = {0: [9.0, 3.0, 3.2], 1: [9.0, 2.0, 2.4], 2: [0.1, 5.0, 5.0]}  # warm-up first
    order = []
    while (i := trials.next()) is not None:
        order.append(i)
        trials.add(seconds[i][order.count(i) - 1] / 2)  # forward, then backward
        trials.add(seconds[i][order.count(i) - 1] / 2)
    assert order == [0, 1, 2] * 3
    assert trials.calls == 9
    assert trials.medians() == pytest.approx([3.1, 2.2, 5.0])
    assert trials.decide() == 1
    # `reduce` (the max over ranks) decides: another rank saw candidate 1 slow.
    assert trials.decide(lambda m: [max(a, b) for a, b in zip(m, [0, 4.0, 0])]) == 0


def test_trials_refuse_to_decide_early_and_bad_arguments():
    with pytest.raises(ValueError, match="candidates"):
        Trials(_candidates(1), 2)
    with pytest.raises(ValueError, match="samples"):
        Trials(_candidates(2), 0)
    trials = Trials(_candidates(2), 1)
    trials.next()
    with pytest.raises(RuntimeError, match="before every sample"):
        trials.decide()


@pytest.mark.parametrize("field,value", [("trials", -1), ("shortlist", 0)])
def test_schedule_config_names_a_bad_trial_setting(field, value):
    with pytest.raises(ValueError, match=field):
        ScheduleConfig(policy="auto", **{field: value})


# ------------------------------------------------------------------ the layer
def _layer_trials(rank, world):
    cfg = _config(trials=2, shortlist=3)
    torch.manual_seed(3)
    layer = MoELayer(cfg)
    tuner = AutoTuner(layer, hardware=preset("local"))
    weights = global_weights(layer, 3)
    layer.load_global_state(weights)
    tokens = [40 + 9 * r for r in range(world)]  # uneven: rank 0's count is the model's
    xs, gys = inputs(world, tokens, M, 3)
    ry, _, rgx, rgrads = run_reference(weights, cfg, xs, gys)
    calls, ran = 0, set()
    while tuner.tuning:
        y, _, gx, grads = run_layer(layer, xs[rank], gys[rank])
        ran.add(repr(layer.running))  # the candidate this call ran
        calls += 1
        close(y, ry[rank].detach(), f"output, call {calls}")
        close(gx, rgx[rank], f"input grad, call {calls}")
        for name in ("w1_EMH", "w2_EHM"):
            full = name if name in grads else f"experts.{name}"
            close(grads[full], rgrads[full][layer.expert_slice()], f"{full}, call {calls}")
    # shortlist x (1 warm-up + 2 measured) calls, then the call that decides.
    assert calls == 3 * 3 + 1 and len(ran) == 3
    chosen = layer.running.summary()
    assert repr(layer.running) in ran and chosen["policy"] != "auto"
    assert [row["chosen"] for row in tuner.report].count(True) == 1
    every = [None] * world
    dist.all_gather_object(every, chosen)
    assert all(c == chosen for c in every)  # the ranks agree
    run_layer(layer, xs[rank], gys[rank])
    assert layer.running.summary() == chosen  # and it stays
    return True


def test_an_auto_layer_times_its_shortlist_then_every_rank_keeps_the_same_fastest(ranks):
    assert all(ranks(2).run(_layer_trials))


def test_an_auto_layer_without_trials_runs_the_models_first_choice_at_once():
    layer = MoELayer(_config(trials=0))
    tuner = AutoTuner(layer, hardware=preset("local"))
    assert tuner.tuning and layer.running is None
    y, _ = layer(torch.randn(16, M))
    assert y.shape == (16, M) and not tuner.tuning
    assert layer.running.summary()["policy"] != "auto"


def test_an_auto_layer_without_a_tuner_says_how_to_attach_one():
    layer = MoELayer(_config(trials=0))
    with pytest.raises(RuntimeError, match="AutoTuner"):
        layer(torch.randn(16, M))


def test_configure_refuses_an_unresolved_or_foreign_configuration():
    layer = MoELayer(_candidates(1)[0])
    with pytest.raises(ValueError, match="resolved"):
        layer.configure(_config())
    other = dataclasses.replace(
        _candidates(1)[0], experts=ExpertConfig(model_dim=M, hidden_dim=H + 1)
    )
    with pytest.raises(ValueError, match="schedule, collective and compression only"):
        layer.configure(other)


def test_a_search_layer_runs_only_with_a_cost_model_which_the_tuner_gives_it():
    base = dataclasses.replace(_config(), schedule=ScheduleConfig(policy="search", chunks=2))
    with pytest.raises(RuntimeError, match="AutoTuner"):
        MoELayer(base)(torch.randn(16, M))
    with pytest.raises(ValueError, match="needs a cost model"):
        MoELayer(_candidates(1)[0]).configure(base)
    layer = MoELayer(base)
    AutoTuner(layer, hardware=preset("local"))
    y, _ = layer(torch.randn(16, M))
    assert y.shape == (16, M) and layer.running == base
