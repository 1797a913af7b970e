"""`schemoe bench step --measured-bound` (bench/bound.py): the eth0 counter reader on a fake sysfs
folder, the busiest direction over ranks, the measured columns, a tiny loopback run of both
passes, and the flags it refuses. No timing assertions: the ratios are whatever this box gives."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from schemoe.bench import bound, figures, regen, tables
from schemoe.bench import cli as bench_cli
from schemoe.bench.cli import BenchEnv
from schemoe.testbed import netns

TINY = ["--model-dim", "32", "--hidden-dim", "64", "--layers", "2", "--seq-len", "16",
        "--batch", "2", "--heads", "2", "--warmup", "1", "--repeats", "2", "--timeout", "120"]  # fmt: skip


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="schemoe")
    bench_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def _sysfs(folder: Path, tx: int, rx: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tx_bytes").write_text(f"{tx}\n")
    (folder / "rx_bytes").write_text(f"{rx}\n")
    return folder


def test_link_bytes_reads_tx_and_rx_from_a_statistics_folder(tmp_path):
    assert bound.link_bytes(str(_sysfs(tmp_path, 123456789012, 42))) == (123456789012, 42)


def test_link_bytes_names_the_file_that_holds_no_count(tmp_path):
    _sysfs(tmp_path, 1, 2)
    (tmp_path / "rx_bytes").write_text("n/a\n")
    with pytest.raises(ValueError, match="rx_bytes: expected a byte count, got 'n/a'"):
        bound.link_bytes(str(tmp_path))


def test_link_bytes_fails_when_the_folder_has_no_counters(tmp_path):
    with pytest.raises(FileNotFoundError):
        bound.link_bytes(str(tmp_path / "nothing"))


def test_counted_records_each_calls_counter_difference(tmp_path):
    moves = iter([(1000, 10), (2500, 700)])
    state = {"tx": 5, "rx": 7}
    _sysfs(tmp_path, state["tx"], state["rx"])

    def step_fn():  # a step that moves bytes: the counters grow while it runs
        dtx, drx = next(moves)
        state["tx"] += dtx
        state["rx"] += drx
        _sysfs(tmp_path, state["tx"], state["rx"])

    run, deltas = bound.counted(step_fn, str(tmp_path))
    run()
    run()
    assert deltas == [(1000, 10), (2500, 700)]


def _busiest_on_rank(rank: int, world: int, per_rank: list) -> list[float]:
    return bound.busiest_bytes(per_rank[rank], repeats=3)


def test_busiest_bytes_takes_the_median_of_the_timed_calls_and_the_max_over_ranks(ranks):
    # Row 0: rank 0's rx median 300 (its warm-up call of 9999 left out); rank 1's tx median 500.
    # Row 1: only rank 1 counts (rank 0 None, as a rank that is not a node's local rank 0).
    rank0 = [[(9999, 9999), (100, 200), (100, 300), (100, 400)], None]
    rank1 = [[(400, 1), (500, 1), (600, 1)], [(7, 8), (7, 8), (7, 8)]]
    out = ranks(2).run(_busiest_on_rank, [rank0, rank1])
    assert out[0] == out[1] == [500.0, 8.0]


def test_add_columns_bounds_each_row_by_the_larger_part():
    rows = [{"_n": "a", "median_ms": 300.0}, {"_n": "b", "median_ms": 120.0}]
    # 6.25e6 bytes at 1 Gbit/s = 50 ms; 2.5e7 bytes = 200 ms.
    bound.add_columns(rows, {"a": 100.0, "b": 100.0}, [6.25e6, 2.5e7], 1e9)
    assert rows[0]["network_measured_ms"] == pytest.approx(50.0)
    assert rows[0]["measured_bound_ms"] == 100.0 and rows[0]["bound_ratio"] == 3.0
    assert rows[1]["network_measured_ms"] == pytest.approx(200.0)
    assert rows[1]["bound_ratio"] == pytest.approx(0.6)
    assert rows[1]["link_bytes"] == 2.5e7


def test_add_columns_without_a_shaped_link_leaves_network_empty():
    rows = [{"_n": "a", "median_ms": 30.0}]
    bound.add_columns(rows, {"a": 20.0}, None, None)
    assert rows[0]["network_measured_ms"] is None and "link_bytes" not in rows[0]
    assert rows[0]["measured_bound_ms"] == 20.0 and rows[0]["bound_ratio"] == 1.5


def _bed(**kw) -> netns.Testbed:
    return netns.Testbed(nodes=2, rate_bps=6e8, latency_s=0.0, addresses=("10.77.0.1", "10.77.0.2"),
                   **kw)  # fmt: skip


def _counting(env: BenchEnv, rank: int, tmp_path: Path, **flags):
    args = argparse.Namespace(measured_bound=True, bound_pass=False, **flags)
    cands = {"row": lambda: None, "parts:compute1": lambda: None}
    counts = bound.count_rows(args, env, rank, cands, ["row"])
    return counts, cands


def test_on_the_testbed_only_local_rank_0_counts_and_only_the_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(bound, "COUNTERS", str(_sysfs(tmp_path, 0, 0)))
    counts, cands = _counting(BenchEnv(2, _bed()), 0, tmp_path)
    cands["row"]()
    cands["parts:compute1"]()
    assert counts == [[(0, 0)]]
    counts, _ = _counting(BenchEnv(2, _bed()), 1, tmp_path)
    assert counts == [None]


def test_one_rank_per_node_counts_on_every_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(bound, "COUNTERS", str(_sysfs(tmp_path, 0, 0)))
    counts, _ = _counting(BenchEnv(1, _bed()), 1, tmp_path)
    assert counts == [[]]


def test_nothing_is_counted_on_loopback_nor_with_rank_namespaces(tmp_path):
    assert _counting(BenchEnv(2, None), 0, tmp_path)[0] is None
    ranked = netns.Testbed(nodes=2, rate_bps=6e8, latency_s=0.0, addresses=("a", "b", "c", "d"),
                     intra_rate_bps=1e8, ranks_per_node=2)  # fmt: skip
    assert _counting(BenchEnv(2, ranked), 0, tmp_path)[0] is None


def test_the_compute_pass_runs_the_same_flags_on_loopback_and_prints_nothing():
    opts = {"testbed": True, "ranks_per_node": 1, "nproc": 2, "trace": "out", "chunks": [4]}
    local = bound.pass_options(opts, world=4, ranks_per_node=1)
    assert local == {"testbed": False, "ranks_per_node": 1, "nproc": 4, "trace": None,
                     "chunks": [4], "bound_pass": True}  # fmt: skip
    assert bound.with_compute(opts, {"a": 1.0})["compute_measured"] == {"a": 1.0}


def _measured_run(capfd, *argv: str) -> tuple[list[str], dict]:
    args = _parse(["bench", "step", "--nproc", "2", *TINY, "--measured-bound", *argv])
    assert args.func(args) == 0
    lines = capfd.readouterr().out.strip().splitlines()
    return lines, json.loads(lines[-1])


def test_a_loopback_measured_bound_run_gives_every_row_a_measured_compute_and_ratio(capfd):
    lines, out = _measured_run(capfd, "--policies", "sequential", "--chunks", "1",
                               "--grad-syncs", "ddp,scheduled")  # fmt: skip
    rows = out["results"]
    assert [(r["policy"], r["chunks"], r["grad_sync"]) for r in rows] == [
        ("sequential", 1, "ddp"),  # the baseline row gets its ratio too
        ("sequential", 1, "scheduled"),
    ]
    for r in rows:
        assert r["compute_measured_ms"] > 0 and r["network_measured_ms"] is None
        assert r["measured_bound_ms"] == r["compute_measured_ms"]
        assert r["bound_ratio"] == pytest.approx(r["median_ms"] / r["compute_measured_ms"])
        assert r["lower_bound_ms"] > 0  # the estimate stays beside it
    assert any("network = - (no shaped link)" in ln for ln in lines)
    table_head = next(ln for ln in lines if ln.lstrip().startswith("policy"))
    assert "network_measured_ms" in table_head and "bound_ratio" in table_head
    assert len([ln for ln in lines if ln.startswith("{")]) == 1  # the compute pass prints none


def test_a_loopback_run_splits_one_rank_per_node(capfd):
    _, out = _measured_run(capfd, "--ranks-per-node", "1", "--grad-syncs", "scheduled",
                           "--grad-algorithm", "hier")  # fmt: skip
    assert out["ranks_per_node"] == 1 and out["profile_key"].startswith("2x1@")
    assert out["results"][0]["bound_ratio"] > 0


def test_measured_bound_refuses_ranks_of_an_outside_launcher(capfd, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = _parse(["bench", "step", *TINY, "--measured-bound"])
    assert args.func(args) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--measured-bound needs a launcher of its own" in err[0]


def test_measured_bound_refuses_a_tuned_policy(capfd):
    args = _parse(["bench", "step", "--nproc", "2", *TINY, "--policies", "auto",
                   "--measured-bound"])  # fmt: skip
    assert args.func(args) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--measured-bound with --policies auto" in err[0]


def _row(policy: str, m: int, median: float, compute: float, net: float | None) -> dict:
    bound_ms = max(compute, net or 0.0)
    return {"policy": policy, "chunks": 1, "micro_chunks": m, "grad_sync": "ddp",
            "grad_compress": "none", "grad_window": 1, "median_ms": median,
            "compute_measured_ms": compute, "network_measured_ms": net,
            "measured_bound_ms": bound_ms, "bound_ratio": median / bound_ms}  # fmt: skip


def test_the_bound_table_shows_each_runs_baseline_best_rows_and_ratios():
    run_2x2 = [_row("sequential", 1, 600.0, 400.0, 300.0), _row("schemoe", 1, 500.0, 400.0, 300.0),
               _row("schemoe", 2, 550.0, 420.0, 300.0), _row("deepspeed", 1, 520.0, 380.0, 310.0)]  # fmt: skip
    run_2x1 = [_row("sequential", 1, 300.0, 150.0, 200.0), _row("schemoe", 2, 190.0, 150.0, 200.0)]
    texts = ["# header\n" + json.dumps({"results": r}) for r in (run_2x2, run_2x1)]
    table = tables.step_bound(texts, names=("2x2", "2x1"))
    assert [r[0] for r in table.rows] == [
        "2x2 baseline", "2x2 best at m=1", "2x2 best at m=2", "2x2 DeepSpeed-MoE + DDP",
        "2x1 baseline", "2x1 best at m=1", "2x1 best at m=2",
    ]  # fmt: skip
    assert table.rows[0][2:] == ["600.0", "400.0", "300.0", "1.50x", "-"]
    assert table.rows[-1][2:] == ["190.0", "150.0", "200.0", "0.95x", "-"]
    assert [(c.holds, c.value) for c in table.claims] == [
        (True, "1.25x"), (False, "1.25x"), (False, "0.95x"), (True, "0.95x"),
    ]  # fmt: skip


def test_the_bound_figures_run_2x2_then_2x1_under_one_testbed():
    names = [f.name for f in figures.FIGURES[-3:]]
    assert names == ["step_bound_600mbit_m256", "step_bound_200mbit_m256", "step_auto_400mbit_m512"]
    (fig,) = figures.by_name(["step_bound_200mbit_m256"])
    lines = [" ".join(line.replace("\\\n", " ").split()) for line in regen.commands(fig)]
    assert lines[0] == "schemoe testbed up --nodes 2 --rate 200mbit"
    # per topology: a profile of it, bench step priced on that profile, validate on it
    for k, (prof, bench, check) in zip((2, 1), (lines[1:4], lines[4:7])):
        stem = f"step_bound_200mbit_m256_2x{k}"
        assert f"testbed run --ranks-per-node {k} -- " in prof and f"{stem}.profile.json" in prof
        assert f"--ranks-per-node {k}" in bench and "--measured-bound" in bench
        assert f"--auto-step --profile DIR/{stem}.profile.json" in bench
        assert check.startswith(f"schemoe validate DIR/{stem}.txt=DIR/{stem}.profile.json")
