"""`schemoe train` as a user's training loop: gradient accumulation, the per-step metrics file,
--resume taking the saved run's arguments, a clear line when there is nothing to do, and the
optional packages checked before any rank starts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from schemoe import ExpertConfig, GateConfig, MoEConfig, MoELayer, ScheduleConfig, cli
from schemoe.dist.launch import spawn
from schemoe.train import loop as T
from schemoe.train import step as S
from schemoe.train.resume import apply_resume
from schemoe.train.setup import setup
from train_cases import tiny

EXACT = ("--capacity-factor", "0", "--aux-loss-weight", "0", "--eval-seqs", "0")


def test_grad_accum_2_with_batch_b_trains_as_batch_2b():
    # Dropless and no aux loss: each token's loss and gradient do not depend on the others in
    # its call, so two micro-batches of 2 are one batch of 4 up to float rounding.
    accum = T.train(0, 1, tiny("--steps", "2", "--batch", "2", "--grad-accum", "2", *EXACT))
    whole = T.train(0, 1, tiny("--steps", "2", "--batch", "4", *EXACT))
    assert len(accum["losses"]) == 2  # step 2's loss shows step 1's update was the same
    for a, b in zip(accum["losses"], whole["losses"], strict=True):
        assert math.isclose(a, b, rel_tol=1e-4), (accum["losses"], whole["losses"])
    assert accum["grad_accum"] == 2


def test_log_file_has_one_line_per_step_with_loss_parts_and_per_layer_routing(tmp_path, capsys):
    log = tmp_path / "m.jsonl"
    out = T.train(0, 1, tiny("--steps", "2", "--eval-seqs", "0", "--log-file", str(log),
                             "--log-every", "1", "--capacity-factor", "0.5"))  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["loss"] for r in rows] == out["losses"]
    for r in rows:
        assert {"lr", "grad_norm", "tokens_per_s"} <= set(r) and r["tokens_per_s"] > 0
        assert set(r["step_ms"]) == {"forward", "backward", "optimizer"}
        assert len(r["moe"]) == 1  # 2 layers, an MoE FFN in every 2nd block
        load, dropped = r["moe"][0]["load"], r["moe"][0]["dropped"]
        assert len(load) == 4 and math.isclose(sum(load), 1.0) and 0.0 <= dropped < 1.0
        # the load in tokens (batch x seq_len x k choices), the overload, and the step line
        tokens, overload = r["moe"][0]["tokens"], r["moe"][0]["overload"]
        assert sum(tokens) == 4 * 32 * 2 and overload == pytest.approx(max(tokens) * 4 / 256)
        line = next(ln for ln in lines if ln.startswith(f"step {r['step']:4d}  loss"))
        assert line.endswith(f"  overload {overload:.2f} drop {dropped:.1%}") and dropped > 0


def test_routing_stats_count_the_choices_dropped_past_capacity():
    cfg = MoEConfig(
        gate=GateConfig(num_experts=4, top_k=1, capacity_factor=0.25),
        experts=ExpertConfig(model_dim=8, hidden_dim=8),
    )
    layer = MoELayer(cfg, seed=0)
    layer.record_routing = True
    layer(torch.randn(16, 8))  # C = ceil(0.25 * 16 / 4) = 1 slot per expert: 4 of 16 kept
    stats = layer.take_load_metrics().as_dict()
    assert stats["dropped"] == pytest.approx(1 - 4 / 16)
    assert layer.take_load_metrics() is None  # reset


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-step run's checkpoint folder (read only by the tests that use it)."""
    folder = tmp_path_factory.mktemp("saved") / "ckpt"
    T.train(0, 1, tiny("--steps", "2", "--eval-seqs", "0", "--save", str(folder)))
    return folder


def test_resume_takes_the_saved_arguments_and_keeps_saving_to_its_folder(saved):
    ckpt = saved
    a = T.parse_args(["--resume", str(ckpt), "--steps", "4", "--lr", "1e-3"])
    apply_resume(a)
    assert (a.model_dim, a.hidden_dim, a.experts, a.layers, a.batch) == (32, 48, 4, 2, 4)
    assert (a.steps, a.lr) == (4, 1e-3)  # given on the command line: they win
    assert a.save == str(ckpt)


def test_resume_with_another_model_shape_is_one_clear_error(saved, capsys):
    ckpt = saved
    rc = cli.main(["train", "--nproc", "1", "--resume", str(ckpt), "--model-dim", "64"])
    err = capsys.readouterr().err
    assert rc == 2 and "--model-dim 64 conflicts with the checkpoint's 32" in err


def test_resume_at_the_last_step_says_there_is_nothing_to_do(saved, capsys):
    ckpt = saved
    capsys.readouterr()
    assert cli.main(["train", "--nproc", "1", "--resume", str(ckpt), "--steps", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [
        (
            f"schemoe train: nothing to do: the checkpoint {str(ckpt)!r} is at step 2 and "
            "--steps is 2; raise --steps to train further"
        )
    ]


def test_tensorboard_without_the_package_is_one_line_before_any_rank(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else real(n, *a)
    )
    with pytest.raises(ValueError, match="--tensorboard needs the tensorboard package"):
        tiny("--tensorboard", str(tmp_path / "tb")).validate(1)


@pytest.mark.parametrize(
    ("missing", "argv", "message"),
    [
        ("deepspeed", ["--peer", "deepspeed"], "--peer deepspeed needs DeepSpeed"),
        ("matplotlib", ["--trace", "t"], "--trace t draws a Gantt PNG per row and needs"),
    ],
)
def test_bench_checks_its_optional_packages_up_front(monkeypatch, capfd, missing, argv, message):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == missing else real(n, *a)
    )
    for name in ("layer", "step"):
        args = cli.build_parser().parse_args(["bench", name, *argv])
        assert args.func(args) == 2
        err = capfd.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_deepspeed_logs_to_stderr_never_to_stdout():
    pytest.importorskip("deepspeed")
    code = "from schemoe.bench.layer import import_deepspeed; import_deepspeed()"
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""


def test_library_schedule_default_is_what_schemoe_train_runs():
    a = T.parse_args([])
    assert (ScheduleConfig().policy, ScheduleConfig().chunks) == (a.policy, a.chunks)


def test_a_rank_state_dict_refuses_to_load_into_another_expert_slice():
    cfg = MoEConfig(gate=GateConfig(num_experts=4), experts=ExpertConfig(model_dim=8, hidden_dim=8))
    layer = MoELayer(cfg, seed=0)
    state = layer.state_dict()
    layer.load_state_dict(state)  # the same layout loads
    state._metadata[""]["schemoe_experts"] = [2, 2, 4]  # rank 1 of 2 wrote it
    with pytest.raises(ValueError, match="holds experts 2..3 of 4"):
        layer.load_state_dict(state)


def _warnings_of_a_run(rank: int, world: int) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        T.train(rank, world, tiny("--steps", "1", "--eval-seqs", "0"))
    return [f"{w.category.__name__}: {w.message}" for w in seen]


def test_a_two_rank_run_prints_no_warning():
    per_rank = spawn(_warnings_of_a_run, 2)
    assert per_rank == [[], []]


def _bucket_layouts(rank: int, world: int) -> dict:
    """The order of the dense parameters in DDP's gradient bucket at steps 1 and 2, after
    `settle_buckets`, and whether it left the weights and random streams as they were."""
    run = setup(rank, world, tiny("--steps", "4"))
    names = {id(p): n for n, p in run.core.named_parameters()}
    seen: list[list[str]] = []

    def record(state, bucket):
        seen.append([names[id(p)] for p in bucket.parameters()])
        return default_hooks.allreduce_hook(state, bucket)

    run.model.register_comm_hook(None, record)
    weights = [t.clone() for t in run.core.state_dict().values()]
    rng, data = torch.get_rng_state(), run.g.get_state()
    T.settle_buckets(run)
    kept = all(torch.equal(a, b) for a, b in zip(weights, run.core.state_dict().values()))
    kept = kept and torch.equal(rng, torch.get_rng_state()) and torch.equal(data, run.g.get_state())
    kept = kept and not run.opt.state and all(p.grad is None for p in run.core.parameters())
    settled = len(seen)
    for _ in range(2):
        S.train_step(run.model, run.core, run.opt, run.next_batch, run.ep, clip=1.0)
    return {"kept": kept, "steps": seen[settled:], "first": seen[0]}


def test_ddp_buckets_are_laid_out_before_the_first_step_so_every_step_sums_alike(ranks):
    # the layout a resumed process's first step used to differ from the uninterrupted run's
    for r in ranks(2).run(_bucket_layouts):
        assert r["kept"]
        assert len(r["steps"]) == 2 and r["steps"][0] == r["steps"][1]
        assert r["first"] != r["steps"][0]  # DDP did re-lay its bucket out (ready order)
