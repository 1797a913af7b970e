"""Cost functions, the search policy, the tuner, the profiler's fits and the CLI contract."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from schemoe import ExpertConfig, GateConfig, MoEConfig, ScheduleConfig, cli
from schemoe.costmodel import a2a, hardware, model, prediction, profiles
from schemoe.costmodel.hardware import Hardware, Link
from schemoe.scheduling import COMPUTE, TaskGraph, make_schedule, search, simulator
from schemoe.tuning import choose as tune
from schemoe.tuning.calibrate import fit_sharing
from schemoe.tuning.plan import resolve


def _hw(**kw) -> Hardware:
    base = {
        "name": "t",
        "nodes": 2,
        "ranks_per_node": 2,
        "intra": Link(1e-4, 1e9),
        "inter": Link(2e-4, 1e8),
        "flops": 1e10,
        "gemm_alpha": 1e-5,
        "memory": 1e9,
        "codecs": {"fp16": (1e-9, 1e-9), "bf16": (1e-9, 1e-9)},
        "task_overhead": 1e-5,
    }
    return Hardware(**{**base, **kw})


def test_link_time_is_alpha_plus_bytes_over_beta_and_free_when_empty():
    link = Link(alpha=1e-3, beta=1e6)
    assert link.time(2e6) == pytest.approx(1e-3 + 2.0)
    assert link.time(0) == 0.0
    with pytest.raises(ValueError, match="beta"):
        Link(alpha=0, beta=0)


def test_naive_sums_the_link_classes_on_nccl_and_overlaps_them_on_gloo():
    sends = [1e6] * 4  # P = 4, M = 2: one intra peer; the node sends 2 ranks x 2 peers x 1 MB
    t_intra, t_inter = 1e-4 + 1e6 / 1e9, 2e-4 + 4e6 / 1e8
    assert a2a.a2a_naive(_hw(backend="gloo"), sends) == pytest.approx(max(t_intra, t_inter))
    assert a2a.a2a_naive(_hw(backend="nccl"), sends) == pytest.approx(t_intra + t_inter)
    assert a2a.a2a_pipe(_hw(), sends) == pytest.approx({"intra": t_intra, "inter": t_inter})


def test_pairwise_pays_one_step_per_peer_with_the_nic_shared_by_the_local_ranks():
    hw = _hw()
    # P = 4, M = 2, offsets 1..3: o = 1 is intra for l = 0 and inter for l = 1 (k = 1),
    # o = 2 inter for both (k = 2), o = 3 inter for l = 0 only (rank 1 + 3 = rank 0; k = 1).
    want = hw.inter.time(1e6) + hw.inter.time(2e6) + hw.inter.time(1e6)
    assert a2a.a2a_pairwise(hw, [1e6] * 4) == pytest.approx(want)


def test_hierarchical_algorithms_add_their_local_phases_to_the_same_nic_bytes():
    hw, sends = _hw(), [1e6] * 4
    nic = hw.inter.time(4e6)
    assert a2a.a2a_hier2d(hw, sends) == pytest.approx(
        hw.intra.alpha + hw.intra.time(2e6) + 4e6 / hw.memory + nic
    )
    assert a2a.a2a_leader(hw, sends) == pytest.approx(
        hw.intra.alpha + 2 * hw.intra.time(4e6) + 2 * 2 * 4e6 / hw.memory + nic
    )


def test_expert_time_counts_gemm_calls_and_flops_backward_twice():
    hw = _hw()
    f = 2.0 * 100 * 64 * 128 * 2
    assert model.expert_time(hw, 100, 64, 128) == pytest.approx(2e-5 + f / 1e10)
    assert model.expert_time(hw, 100, 64, 128, backward=True) == pytest.approx(4e-5 + 2 * f / 1e10)
    assert model.expert_flops(100, 64, 128, "swiglu") == pytest.approx(1.5 * f)


def test_compressed_transfers_shrink_by_the_plug_ins_wire_ratio():
    shape = model.LayerShape(tokens=512, model_dim=64, hidden_dim=128, experts=4)
    g = TaskGraph(2)
    plain = model.CostModel(_hw(), shape).task_costs(g).durations
    half = model.CostModel(_hw(), shape, compressors=("fp16", "fp16")).task_costs(g).durations
    a = next(t for t in g.tasks if t.is_comm)
    assert model.wire_ratio("fp16", 64) == 0.5
    assert half[a] < plain[a]
    with pytest.raises(ValueError, match="known"):
        _hw().codec("zfp")


def _random_costs(g: TaskGraph, rng: random.Random) -> dict:
    return {t: rng.uniform(0.05, 3.0) * (rng.uniform(1, 4) if t.is_comm else 1) for t in g.tasks}


def test_search_is_never_worse_than_schemoe_over_random_costs_and_sometimes_better():
    rng = random.Random(7)
    better = 0
    for trial in range(40):
        r = rng.randint(1, 4)
        g = TaskGraph(
            r, rng.choice([("net",), ("intra", "inter")]), rng.choice(["forward", "backward"])
        )
        costs = _random_costs(g, rng)
        t_ref, _ = simulator.run(make_schedule("schemoe", g), g, costs)
        t_best, _ = simulator.run(make_schedule("search", g, costs), g, costs)
        assert t_best <= t_ref + 1e-12, trial
        better += t_best < t_ref - 1e-9
    assert better > 0


def test_search_without_costs_falls_back_to_the_schemoe_order():
    g = TaskGraph(3)
    assert make_schedule("search", g).order == make_schedule("schemoe", g).order


def test_interleavings_keep_each_chain_in_order_and_count_the_multinomial():
    g = TaskGraph(2)
    orders = list(search.interleavings(search._chains(g)))
    assert len(orders) == 252  # 10! / (5! 5!)
    assert orders[0] == list(make_schedule("sequential", g).order[COMPUTE])


def _config(**kw) -> MoEConfig:
    return MoEConfig(
        gate=GateConfig(num_experts=4, top_k=2, capacity_factor=1.0),
        experts=ExpertConfig(model_dim=256, hidden_dim=512),
        **kw,
    )


def test_tune_picks_one_chunk_sequential_when_communication_is_free():
    free = _hw(intra=Link(0.0, 1e30), inter=Link(0.0, 1e30))
    cfg = tune.choose(_config(), 1024, (2, 2), free)
    assert (cfg.schedule.policy, cfg.schedule.chunks) == ("sequential", 1)
    assert cfg.compression.forward == "none"  # lossless budget


def test_tune_picks_several_chunks_and_an_overlapping_policy_when_communication_dominates():
    slow = _hw(
        intra=Link(1e-6, 1e9),
        inter=Link(1e-6, 2e8),
        task_overhead=0.0,
        flops=1e12,
        codecs={"fp16": (1e-10, 1e-10), "bf16": (1e-10, 1e-10)},
    )
    cfg = tune.choose(_config(), 2048, (2, 2), slow)
    assert cfg.schedule.chunks > 1 and cfg.schedule.policy != "sequential"
    lossy = tune.choose(_config(), 2048, (2, 2), slow, accuracy_budget="fp16")
    assert lossy.compression.forward in ("fp16", "bf16")
    with pytest.raises(ValueError, match="accuracy_budget"):
        tune.choose(_config(), 2048, (2, 2), slow, accuracy_budget="some")


def test_resolve_leaves_fixed_configs_alone_and_replaces_auto():
    cfg = _config()
    assert resolve(cfg, 1024, (2, 2), hardware=_hw()) == [cfg]
    auto = dataclasses.replace(cfg, schedule=ScheduleConfig(policy="auto"))
    (out,) = resolve(auto, 1024, (2, 2), hardware=_hw())
    assert out.schedule.policy != "auto" and out.gate == cfg.gate


def test_profile_fits_recover_alpha_beta_and_gemm_rate_from_synthetic_timings():
    xs = [1e5, 1e6, 4e6, 1.6e7]
    link = profiles.fit_link(xs, [3e-4 + x / 2.5e9 for x in xs])
    assert link.alpha == pytest.approx(3e-4) and link.beta == pytest.approx(2.5e9)
    rng = random.Random(1)
    noisy = profiles.fit_link(xs, [(3e-4 + x / 2.5e9) * rng.uniform(0.98, 1.02) for x in xs])
    assert noisy.beta == pytest.approx(2.5e9, rel=0.05)
    g, f = [2, 4, 2, 4], [1e9, 2e9, 4e9, 8e9]
    alpha, flops = profiles.fit_gemm(g, f, [gi * 5e-5 + fi / 3e10 for gi, fi in zip(g, f)])
    assert alpha == pytest.approx(5e-5) and flops == pytest.approx(3e10)


def test_profiles_are_cached_by_topology_and_link_rate(tmp_path):
    path = str(tmp_path / "p.json")
    a = _hw(name="a", link_rate_bps=4e8)
    b = _hw(name="b", nodes=4, link_rate_bps=1e9)
    assert profiles.save(a, path) == "2x2@inter=4e+08,intra=unshaped"
    profiles.save(b, path)
    assert profiles.load("2x2@inter=4e+08,intra=unshaped", path) == a
    assert profiles.load("4x2@inter=1e+09,intra=unshaped", path) == b
    assert profiles.load("2x2@inter=1e+09,intra=unshaped", path) is None
    assert profiles.load("2x2@inter=unshaped,intra=unshaped", path) is None


def test_presets_describe_the_paper_cluster_and_an_h100_pod_and_round_trip_json():
    paper = hardware.preset("paper-32gpu")
    assert (paper.world, paper.backend) == (32, "nccl")
    # PipeMoE's fitted 32-GPU all-to-all: 2.09e-4 s + 3.55e-10 s/B x S.
    S = 64e6
    t = a2a.a2a_naive(paper, [S / 32] * 32)
    assert t == pytest.approx(2.09e-4 + 3.55e-10 * S, rel=0.02)
    assert hardware.preset("h100-64gpu").world == 64
    for hw in hardware.PRESETS.values():
        assert Hardware.from_json(json.loads(hw.dumps())) == hw
    with pytest.raises(ValueError, match="known: h100-64gpu, local, paper-32gpu"):
        hardware.preset("tpu")


def test_simulate_command_ends_with_the_json_contract(capsys, tmp_path):
    png = tmp_path / "g.png"
    argv = (
        "simulate --preset paper-32gpu --layers 2 --tokens 2048 --model-dim 1024 --hidden-dim 1024"
    )
    rc = cli.main([*argv.split(), "--max-chunks", "4", "--png", str(png)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["preset"] == "paper-32gpu"
    rows = {r["policy"]: r for r in out["results"]}
    assert {"sequential", "tutel", "fastermoe", "schemoe", "search"} <= set(rows)
    for r in out["results"]:
        assert set(r) == {"policy", "algorithm", "compressor", "chunks", "predicted_ms"}
        assert r["predicted_ms"] > 0
    assert rows["search"]["predicted_ms"] <= rows["schemoe"]["predicted_ms"] + 1e-9
    assert out["chosen"]["predicted_ms"] == min(r["predicted_ms"] for r in out["results"])
    assert png.stat().st_size > 1000


def test_simulate_systems_and_ablation_ladder_on_the_paper_cluster(capsys):
    # The paper's ablation layer (the ScheMoE paper): each ScheMoE part takes time off the step.
    argv = "simulate --preset paper-32gpu --tokens 16384 --model-dim 8192 --hidden-dim 8192"
    argv += " --top-k 1 --capacity-factor 1.2 --budget lossy --max-chunks 2 --systems --ablation"
    assert cli.main(argv.split()) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    steps = [r["step"] for r in out["ablation"]]
    assert steps == ["naive", "+ zfp", "+ pipe", "+ scheduling"]
    ms = [r["predicted_ms"] for r in out["ablation"]]
    assert ms[0] > ms[1] >= ms[2] > ms[3] > 0
    last = out["ablation"][-1]
    assert (last["policy"], last["algorithm"], last["compressor"], last["chunks"]) == (
        "schemoe",
        "pipe",
        "zfp",
        2,
    )
    systems = {r["policy"]: r for r in out["systems"]}
    assert set(systems) == {"tutel", "fastermoe", "schemoe"}
    assert systems["schemoe"]["predicted_ms"] < systems["tutel"]["predicted_ms"]


def test_simulate_rejects_an_unknown_preset_with_the_known_names(capsys):
    argv = "simulate --preset nope --tokens 8 --model-dim 8 --hidden-dim 8"
    assert cli.main(argv.split()) == 2
    assert "known:" in capsys.readouterr().err


def test_cpu_ranks_sharing_cores_compute_faster_the_more_the_others_wait():
    shared = _hw(host_ranks=4, host_cores=2)
    assert model.sharing_scale(shared, 1.0) == 1.0  # as profiled: all four computing
    assert model.sharing_scale(shared, 0.0) == 0.5  # alone: a whole core instead of half
    assert model.sharing_scale(_hw(), 0.0) == 1.0  # own device: no sharing
    # A communicating rank keeps comm_cpu of a core busy, waiting or overlapped with compute.
    chatty = _hw(host_ranks=4, host_cores=2, comm_cpu=0.5)
    assert model.sharing_scale(chatty, 0.0) == 0.75  # k = 1 + 4 x 0.5 = 3 busy, of 4
    assert model.sharing_scale(chatty, 1.0, comm=0.5) == (1 + 3 + 4 * 0.5 * 0.5) / 4
    with pytest.raises(ValueError, match="comm_cpu"):
        _hw(comm_cpu=1.5)
    shape = model.LayerShape(tokens=1024, model_dim=256, hidden_dim=1024, experts=4)
    fast = prediction.predict(shared, shape, "sequential")
    assert fast.step_s < prediction.predict(_hw(), shape, "sequential").step_s


def test_skew_adds_to_every_transfer_and_the_profiler_recovers_it_with_comm_cpu():
    shape = model.LayerShape(tokens=1024, model_dim=256, hidden_dim=1024, experts=4)
    own = _hw()  # ranks on devices of their own: sequential exposes every transfer
    for r in (1, 4):
        graph = TaskGraph(r, model.CostModel(own, shape).links)
        transfers = sum(1 for t in graph.tasks if t.is_comm) * 2  # forward and backward
        base = prediction.predict(own, shape, "sequential", chunks=r).step_s
        late = prediction.predict(_hw(skew=0.003), shape, "sequential", chunks=r).step_s
        assert late - base == pytest.approx(0.003 * transfers)
    with pytest.raises(ValueError, match="skew"):
        _hw(skew=-0.001)
    # CPU ranks sharing cores: comm_cpu and skew both slow a step, r = 4 has 4x the transfers;
    # the two layer steps the profiler times give both back (calibrate.fit_sharing).
    shared = _hw(host_ranks=4, host_cores=2)
    true = dataclasses.replace(shared, comm_cpu=0.3, skew=0.004)
    t1 = prediction.predict(true, shape, "sequential").step_s
    t4 = prediction.predict(true, shape, "sequential", chunks=4).step_s
    got = fit_sharing(shared, shape, t1, t4)
    assert (got.comm_cpu, got.skew) == (
        pytest.approx(0.3, abs=1e-4),
        pytest.approx(0.004, abs=1e-6),
    )


def test_profile_on_two_spawned_ranks_caches_a_usable_record(tmp_path, capsys):
    path = str(tmp_path / "prof.json")
    argv = "profile --nproc 2 --ranks-per-node 1 --quick --model-dim 64 --hidden-dim 128 --path"
    described = "--link-rate 300mbit --intra-rate 100mbit"  # what the network is: the key's
    assert cli.main([*argv.split(), path, *described.split()]) == 0
    assert profiles.keys(path) == ["2x1@inter=3e+08,intra=1e+08"]
    hw = profiles.load("2x1@inter=3e+08,intra=1e+08", path)
    assert hw is not None and hw.flops > 0 and hw.inter.beta > 0 and "fp16" in hw.codecs
    assert (hw.link_rate_bps, hw.intra_rate_bps) == (3e8, 1e8)
    shape = model.LayerShape(tokens=256, model_dim=64, hidden_dim=128, experts=2)
    assert prediction.predict(hw, shape, "schemoe", chunks=2).step_s > 0


@pytest.mark.parametrize(
    "flags, want",
    [
        (["--layers", "-3"], "--layers must be >= 1, got -3"),
        (["--tokens", "-5"], "--tokens must be >= 1, got -5"),
        (["--experts", "8", "--top-k", "40"], "top_k=40 must be <= num_experts=8"),
        (
            ["--capacity-factor", "-1"],
            "--capacity-factor must be >= 0 and finite (0 for dropless), got -1",
        ),
        (
            ["--capacity-factor", "inf"],
            "--capacity-factor must be >= 0 and finite (0 for dropless), got inf",
        ),
        (["--max-chunks", "0"], "--max-chunks must be >= 1, got 0"),
    ],
)
def test_simulate_refuses_a_bad_shape_in_one_line_instead_of_printing_negative_times(
    flags, want, capsys
):
    base = ["simulate", "--tokens", "1024", "--model-dim", "256", "--hidden-dim", "1024"]
    try:  # a flag's range is checked at parse (argparse exits 2), the shape's after it
        code = cli.main([*base, *flags])
    except SystemExit as e:
        code = e.code
    assert code == 2
    out, err = capsys.readouterr()
    assert out == "" and want in err and "Traceback" not in err
