"""The step model: all-reduce costs, buckets, and predicted steps (costmodel/step.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from schemoe import cli
from schemoe.costmodel import profiles
from schemoe.costmodel.hardware import Hardware, Link
from schemoe.costmodel.step import StepShape, _buckets, allreduce_time, predict_step
from schemoe.profile.steps import is_step_row, point

SHAPE = StepShape(batch=4, seq_len=32, model_dim=64, hidden=128, layers=4, experts=4)


def _hw(rate_Bps=12.5e6, nodes=2, rpn=2) -> Hardware:
    return Hardware(
        name="t",
        nodes=nodes,
        ranks_per_node=rpn,
        intra=Link(alpha=1e-4, beta=1e9),
        inter=Link(alpha=1e-3, beta=rate_Bps),
        flops=1e10,
        gemm_alpha=1e-5,
        memory=5e9,
        codecs={},
        backend="gloo",
    )


def test_a_flat_ring_sends_two_p_minus_one_over_p_of_the_bytes_over_the_slow_link():
    hw = _hw()
    S = 1e6
    assert allreduce_time(hw, S) == pytest.approx(6 * 1e-3 + 1.5 * S / 12.5e6)
    assert allreduce_time(dataclasses.replace(hw, nodes=1, ranks_per_node=1), S) == 0.0


def test_hier_crosses_the_network_once_per_node_and_wins_on_a_slow_link():
    hw = _hw()
    S = 1e6
    want = 2 * (1e-4 + S / 1e9) + (2 * 1e-3 + (1e-3 + S / 12.5e6) - 1e-3)
    assert allreduce_time(hw, S, "hier") == pytest.approx(want)
    assert allreduce_time(hw, S, "hier") < allreduce_time(hw, S, "flat")
    with pytest.raises(ValueError, match="flat' or 'hier"):
        allreduce_time(hw, S, "tree")


def test_buckets_fill_in_ready_order_and_the_last_one_takes_the_rest():
    assert _buckets([3.0, 0.0, 5.0, 1.0], 4.0) == [(2, 4.0), (2, 4.0), (3, 1.0)]
    assert _buckets([1.0, 1.0], 4.0) == [(1, 2.0)]


def test_compressing_the_buckets_never_makes_the_predicted_step_slower():
    hw = _hw()
    for sync in ("ddp", "scheduled"):
        plain = predict_step(hw, SHAPE, "schemoe", chunks=2, grad_sync=sync)
        half = predict_step(hw, SHAPE, "schemoe", chunks=2, grad_sync=sync, grad_compress="bf16")
        assert 0 < half.step_s <= plain.step_s
        assert half.forward_s == plain.forward_s  # only the backward's buckets change


def test_a_faster_link_shortens_the_predicted_step_and_its_network_part():
    slow = predict_step(_hw(12.5e6), SHAPE, "schemoe", chunks=2)
    fast = predict_step(_hw(1.25e9), SHAPE, "schemoe", chunks=2)
    assert fast.step_s < slow.step_s and fast.network_s < slow.network_s


@pytest.mark.parametrize(
    "kw,match",
    [({"grad_sync": "fsdp"}, "grad_sync"), ({"grad_compress": "int3"}, "grad_compress")],
)
def test_predict_step_names_a_bad_setting(kw, match):
    with pytest.raises(ValueError, match=match):
        predict_step(_hw(), SHAPE, **kw)


def _bench_step_output(tmp_path, rows):
    """A saved `schemoe bench step` output of `rows` at SHAPE, run under _hw()'s profile key."""
    bench = tmp_path / "step.txt"
    bench.write_text(
        "# schemoe bench step\n# config: dim=64 hidden=128 experts=4 top_k=2 layers=4 heads=4 "
        "moe_every=2 f=1.25 seq_len=32 batch=4 algorithm=naive bucket_mb=1.0 "
        "grad_algorithm=flat\n"
        + json.dumps({"results": rows, "profile_key": profiles.key_of(_hw())})
        + "\n"
    )
    return bench


def test_validate_reads_a_bench_step_output_and_predicts_each_row(tmp_path, capsys):
    prof = tmp_path / "p.json"
    profiles.save(_hw(), str(prof))
    rows = [
        {"policy": "schemoe", "chunks": 2, "grad_sync": s, "grad_compress": "none",
         "micro_chunks": 1, "median_ms": 500.0}
        for s in ("ddp", "scheduled")
    ] + [{"policy": "deepspeed", "chunks": 1, "grad_sync": "ddp", "grad_compress": "none",
          "micro_chunks": 1, "median_ms": 600.0}]  # fmt: skip
    bench = _bench_step_output(tmp_path, rows)
    assert cli.main(["validate", f"{bench}={prof}"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["configurations"] == 2  # the DeepSpeed row is not modelled
    assert all(p["predicted_ms"] > 0 for p in out["points"])


def test_simulate_step_prices_every_candidate_and_chooses_the_fastest(capsys):
    argv = ["simulate", "--step", "--preset", "local", "--nodes", "2", "--ranks-per-node", "2",
            "--seq-len", "32", "--batch", "4", "--layers", "4", "--model-dim", "64",
            "--hidden-dim", "128", "--grad-compressors", "none,bf16", "--max-chunks", "4"]  # fmt: skip
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = out["results"]
    keys = {(r["policy"], r["chunks"], r["grad_sync"], r["grad_compress"]) for r in rows}
    # sequential/tutel/schemoe take r in 1, 2, 4; fastermoe (peers partition) r <= 4 ranks too
    assert len(keys) == len(rows) == 4 * 3 * 2 * 2
    times = [r["predicted_ms"] for r in rows]
    assert times == sorted(times) and out["chosen"] == rows[0] and times[0] > 0
    by = {(r["policy"], r["chunks"], r["grad_sync"], r["grad_compress"]): r for r in rows}
    # bf16 buckets halve the all-reduce bytes: less network time, never a slower step
    for (pol, r, sync, comp), row in by.items():
        if comp == "bf16":
            twin = by[(pol, r, sync, "none")]
            assert row["network_ms"] < twin["network_ms"]
            assert row["predicted_ms"] <= twin["predicted_ms"] + 1e-9


def test_simulate_without_tokens_or_step_says_what_it_needs(capsys):
    assert cli.main(["simulate", "--model-dim", "64", "--hidden-dim", "128"]) == 2
    assert "simulate needs --tokens" in capsys.readouterr().err


def test_validate_prices_micro_chunk_rows_by_the_stack_model():
    row = {"policy": "schemoe", "grad_sync": "ddp", "grad_compress": "none", "chunks": 1}
    assert is_step_row(row) and is_step_row({**row, "micro_chunks": 4})
    assert not is_step_row({**row, "policy": "deepspeed"})
    cfg = {"batch": "8", "seq_len": "64", "model_dim": "128", "hidden_dim": "256", "layers": "4",
           "experts": "8", "top_k": "2", "f": "1.25", "algorithm": "naive", "bucket_mb": "0.25"}  # fmt: skip
    hw = _hw()
    one = point(cfg, {**row, "median_ms": 100.0}, hw)
    four = point(cfg, {**row, "micro_chunks": 4, "median_ms": 100.0}, hw)
    assert one["predicted_ms"] > 0 and four["predicted_ms"] > 0
    assert four["predicted_ms"] != one["predicted_ms"]  # priced at m = 4, not as m = 1


def test_simulate_step_prices_micro_chunks_with_the_stack_model(capsys):
    argv = ["simulate", "--step", "--preset", "local", "--nodes", "2", "--ranks-per-node", "2",
            "--seq-len", "32", "--batch", "4", "--layers", "4", "--model-dim", "64",
            "--hidden-dim", "128", "--max-chunks", "2", "--micro-chunks", "1,2"]  # fmt: skip
    assert cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]
    by_m = {m: [r for r in rows if r["micro_chunks"] == m] for m in (1, 2)}
    assert len(by_m[1]) == len(by_m[2]) > 0 and len(rows) == 2 * len(by_m[1])
    assert [r["predicted_ms"] for r in rows] == sorted(r["predicted_ms"] for r in rows)
    assert cli.main([*argv[:-1], "3"]) == 2  # 3 does not divide the batch
    assert "--micro-chunks 3 must be >= 1 and divide --batch 4" in capsys.readouterr().err


def test_validate_makes_autos_step_choice_again_on_the_profile(tmp_path, capsys):
    # bf16 buckets are predicted faster than fp32 ones on a 100 Mbit/s link; measured here as
    # slower, auto's choice is 1.25x the best row. A windowed row (not priced) is no candidate.
    prof = tmp_path / "p.json"
    profiles.save(_hw(), str(prof))
    row = {"policy": "schemoe", "chunks": 2, "grad_sync": "ddp", "micro_chunks": 1}
    rows = [
        {**row, "grad_compress": "none", "median_ms": 400.0},
        {**row, "grad_compress": "bf16", "median_ms": 500.0},
        {**row, "grad_sync": "scheduled", "grad_compress": "none", "grad_window": 2,
         "median_ms": 300.0},
    ]  # fmt: skip
    bench = _bench_step_output(tmp_path, rows)
    assert cli.main(["validate", f"{bench}={prof}"]) == 0
    text = capsys.readouterr().out.strip().splitlines()
    (auto,) = json.loads(text[-1])["auto"]
    assert auto["chosen"] == "schemoe/r2/ddp/bf16" and auto["best"] == "schemoe/r2/ddp/none"
    assert auto["vs_best"] == pytest.approx(1.25)
    assert any("1.250x the best row schemoe/r2/ddp/none" in line for line in text)
