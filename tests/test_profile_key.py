"""Profile keys name the topology and the links a profile was measured under; readers get only
the record of the key they ask for; `validate` refuses another key; `auto` without a stored
profile measures a quick one once and stores it under the run's key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from schemoe import ExpertConfig, GateConfig, MoEConfig, MoELayer, ScheduleConfig, cli
from schemoe.costmodel import profiles
from schemoe.costmodel.hardware import preset
from schemoe.dist.links import Links
from schemoe.tuning import measure as probe
from schemoe.tuning.auto import AutoTuner
from schemoe.tuning.measure import UNCALIBRATED

SHAPED = Links(inter_bps=4e8)
RANK_LINKS = Links(inter_bps=3e8, intra_bps=1e8)


# ------------------------------------------------------------------ keys
@pytest.mark.parametrize(
    "links,text",
    [
        (Links(), "inter=unshaped,intra=unshaped"),
        (SHAPED, "inter=4e+08,intra=unshaped"),
        (RANK_LINKS, "inter=3e+08,intra=1e+08"),
        (Links(3e8, 1e8, "separate"), "inter=3e+08,intra=1e+08/separate"),
        (Links(None, 1e8), "inter=unshaped,intra=1e+08"),
    ],
)
def test_a_key_names_topology_and_both_link_rates_and_parses_back(links, text):
    key = profiles.cache_key(2, 4, links)
    assert key == f"2x4@{text}"
    assert profiles.parse_key(key) == (2, 4, links)


@pytest.mark.parametrize("old,links", [("2x2@4e+08", SHAPED), ("2x2@unshaped", Links())])
def test_an_old_key_without_an_intra_rate_reads_as_intra_unshaped(old, links):
    assert profiles.parse_key(old) == (2, 2, links)


@pytest.mark.parametrize(
    "bad,match",
    [("2x2", "NODESxRANKS"), ("twox2@unshaped", "NODESxRANKS"), ("2x2@fast", "'fast'"),
     ("2x2@inter=4e8", "inter=RATE"), ("2x2@inter=4e8,intra=1e8/both", "'both'"),
     ("2x2@inter=-1,intra=unshaped", "-1")],
)  # fmt: skip
def test_a_bad_key_is_refused_naming_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        profiles.parse_key(bad)


def _state(tmp_path, **kw) -> str:
    bed = {"nodes": 2, "rate_bps": 3e8, "latency_s": 0.0, "addresses": ["10.77.0.1", "10.77.1.1"]}
    path = tmp_path / "testbed.json"
    path.write_text(json.dumps({**bed, **kw}))
    return str(path)


def test_a_run_on_the_testbed_reads_its_rates_from_the_state_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.77.0.1")
    assert Links.of_run(_state(tmp_path)) == Links(3e8)
    ranks = _state(tmp_path, intra_rate_bps=1e8, ranks_per_node=2, intra_link="separate")
    assert Links.of_run(ranks) == Links(3e8, 1e8, "separate")


def test_a_run_off_the_testbed_is_unshaped_even_while_one_is_up(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert Links.of_run(_state(tmp_path)) == Links()
    assert Links.of_run(str(tmp_path / "none.json")) == Links()


# ------------------------------------------------------------------ the store
def _hw(links: Links, name: str = "hw"):
    return dataclasses.replace(
        preset("local"), name=name, link_rate_bps=links.inter_bps,
        intra_rate_bps=links.intra_bps, intra_link=links.intra_link,
    )  # fmt: skip


def test_profiles_measured_with_and_without_intra_shaping_do_not_mix(tmp_path):
    path = str(tmp_path / "p.json")
    plain, ranked = _hw(Links(3e8), "plain"), _hw(RANK_LINKS, "ranked")
    assert profiles.save(plain, path) != profiles.save(ranked, path)
    assert profiles.load(profiles.cache_key(2, 2, Links(3e8)), path) == plain
    assert profiles.load(profiles.cache_key(2, 2, RANK_LINKS), path) == ranked
    assert profiles.load(profiles.cache_key(2, 2, Links(3e8, 2e8)), path) is None
    assert profiles.load(profiles.cache_key(2, 2, Links(3e8, 1e8, "separate")), path) is None


def test_a_store_with_old_keys_still_reads_as_intra_unshaped(tmp_path):
    path = tmp_path / "old.json"
    record = preset("local").to_json()
    path.write_text(json.dumps({"2x2@4e+08": {**record, "link_rate_bps": 4e8}}))
    hw = profiles.load("2x2@inter=4e+08,intra=unshaped", str(path))
    assert hw is not None and hw.links == SHAPED
    assert profiles.keys(str(path)) == ["2x2@inter=4e+08,intra=unshaped"]


# ------------------------------------------------------------------ validate
def _bench_output(tmp_path, key: str, hidden_key: str = "hidden_dim") -> str:
    row = {"policy": "schemoe", "algorithm": "naive", "compressor": "none", "chunks": 2,
           "median_ms": 50.0}  # fmt: skip
    path = tmp_path / "bench.txt"
    path.write_text(
        f"# schemoe bench layer\n# config: tokens=512 model_dim=64 {hidden_key}=128 top_k=2 "
        "dtype=float32 experts=4 f=1.25 warmup=1 repeats=3\n"
        + json.dumps({"results": [row], "profile_key": key})
        + "\n"
    )
    return str(path)


def test_validate_refuses_a_profile_of_other_links_naming_both_keys(tmp_path, capsys):
    prof = str(tmp_path / "p.json")
    profiles.save(_hw(Links(3e8)), prof)
    run_key = profiles.cache_key(2, 2, SHAPED)
    assert cli.main(["validate", f"{_bench_output(tmp_path, run_key)}={prof}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert run_key in err and "2x2@inter=3e+08,intra=unshaped" in err


@pytest.mark.parametrize("hidden_key", ["hidden_dim", "hidden"])  # today's header, the old one
def test_validate_predicts_on_the_profile_of_the_runs_key(tmp_path, capsys, hidden_key):
    prof = str(tmp_path / "p.json")
    profiles.save(_hw(Links(3e8)), prof)
    profiles.save(_hw(SHAPED), prof)  # the run's, among others
    run_key = profiles.cache_key(2, 2, SHAPED)
    bench = _bench_output(tmp_path, run_key, hidden_key)
    assert cli.main(["validate", f"{bench}={prof}"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["configurations"] == 1 and out["points"][0]["hidden"] == 128


def test_validate_prices_a_real_bench_layer_output_of_the_report(capsys):
    """A bench layer output as `schemoe bench report` wrote it, with the profile it measured."""
    run = Path(__file__).resolve().parent.parent / "docs/results/report_2026-12-03_run1"
    arg = f"{run / 'costmodel_s1.txt'}={run / 'costmodel_s1.profile.json'}"
    assert cli.main(["validate", arg]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["configurations"] == 30 and out["median_abs_error"] < 0.15


# ------------------------------------------------------------------ auto's quick profile
def _model() -> nn.Module:
    cfg = MoEConfig(
        gate=GateConfig(num_experts=4, top_k=2, capacity_factor=1.0),
        experts=ExpertConfig(model_dim=16, hidden_dim=32),
        schedule=ScheduleConfig(policy="auto", trials=0),
    )
    return nn.Sequential(MoELayer(cfg), MoELayer(cfg))


def _tune(model: nn.Module, path: str, links: Links) -> AutoTuner:
    tuner = AutoTuner(model, profile_path=path, links=links)
    x = torch.randn(32, 16)
    for layer in model:
        x = layer(x)[0]
    assert not tuner.tuning
    return tuner


def _auto_measures_once_per_key(rank, world, path):
    calls, real = [], probe.measure

    def counted(*args, **kw):
        calls.append(kw["links"])
        return real(*args, **kw)

    probe.measure = counted
    try:
        first = _tune(_model(), path, SHAPED)  # two layers, one key: one measurement
        after_first = len(calls)
        second = _tune(_model(), path, SHAPED)  # a new tuner reads the stored profile
        after_second = len(calls)
        third = _tune(_model(), path, RANK_LINKS)  # other links: its own measurement
    finally:
        probe.measure = real
    stored = profiles.load(profiles.cache_key(1, world, SHAPED), path)
    return {
        "counts": (after_first, after_second, len(calls)),
        "measured": [first.measured, second.measured, third.measured],
        "keys": profiles.keys(path),
        "stored_links": stored.links if stored else None,
    }


def test_auto_without_a_profile_measures_once_stores_it_under_the_runs_key_and_reuses_it(
    ranks, tmp_path
):
    path = str(tmp_path / "store.json")
    out = ranks(2).run(_auto_measures_once_per_key, path, run_timeout=120)
    shaped, ranked = profiles.cache_key(1, 2, SHAPED), profiles.cache_key(1, 2, RANK_LINKS)
    for rank in out:
        assert rank["counts"] == (1, 1, 2)
        first, second, third = rank["measured"]
        assert [m["key"] for m in first] == [shaped] and first[0]["seconds"] > 0
        assert second == [] and [m["key"] for m in third] == [ranked]
        assert rank["keys"] == [shaped, ranked] and rank["stored_links"] == SHAPED
    assert out[0]["measured"][0] == out[1]["measured"][0]  # rank 0's fit and time, on both


def test_simulate_on_a_store_of_several_profiles_needs_the_key_it_wants(tmp_path, capsys):
    prof = str(tmp_path / "p.json")
    profiles.save(_hw(Links(3e8)), prof)
    profiles.save(_hw(SHAPED), prof)
    argv = [
        "simulate",
        "--profile",
        prof,
        "--tokens",
        "256",
        "--model-dim",
        "64",
        "--hidden-dim",
        "128",
    ]
    assert cli.main(argv) == 2
    assert "--key" in capsys.readouterr().err
    assert cli.main([*argv, "--key", profiles.cache_key(2, 2, SHAPED)]) == 0


def test_a_rate_fitted_on_samples_that_fall_with_size_stays_positive():
    sizes = [1e3, 1e4, 1e5]
    assert profiles.fit_rate(sizes, [1e-3 + b * 1e-8 for b in sizes]) == pytest.approx(1e-8)
    # A busy box: the smallest copy was the slowest. The largest sample's rate, not a negative.
    assert profiles.fit_rate(sizes, [3e-3, 2e-3, 1e-3]) == pytest.approx(1e-3 / 1e5)


def test_a_gemm_fit_on_one_sample_shape_puts_all_time_on_the_flops():
    assert profiles.fit_gemm([2, 2], [1e9, 1e9], [0.1, 0.1]) == (0.0, pytest.approx(1e10))


def test_validate_says_when_the_runs_profile_is_autos_uncalibrated_quick_one(tmp_path, capsys):
    prof = str(tmp_path / "p.json")
    profiles.save(dataclasses.replace(_hw(SHAPED), notes=f"quick, {UNCALIBRATED}"), prof)
    run_key = profiles.cache_key(2, 2, SHAPED)
    assert cli.main(["validate", f"{_bench_output(tmp_path, run_key)}={prof}"]) == 0
    assert f"# {run_key}: a quick profile" in capsys.readouterr().out
