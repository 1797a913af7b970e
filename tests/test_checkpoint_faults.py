"""Nothing lost, nothing silent: a diverging step is skipped on every rank before anything
changes and three in a row stop the run naming the last good checkpoint, which resumes and trains
on; `latest` only names a complete, finite, verified checkpoint; a full disk, an edited or torn
checkpoint, one without digests and a non-finite final eval each end in one line."""

from __future__ import annotations

import errno
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from schemoe import cli
from schemoe.checkpoint import store as checkpoint
from schemoe.dist import failures
from schemoe.layer.moe import MoELayer
from schemoe.train import command
from schemoe.train import loop as T
from schemoe.train import step as S
from schemoe.train.setup import setup
from train_cases import TINY, tiny, train_on


def _state(run) -> list[torch.Tensor]:
    return [t.detach().clone() for t in run.core.state_dict().values()]


def _skip_with_nan_on_rank_1(rank: int, world: int, how: str) -> dict:
    """One train_step of the tiny model (expert bias on) in which only rank 1 sees a NaN: in an
    expert's gradient (`how` = "grad"), or in its own gradient norm ("norm")."""
    run = setup(rank, world, tiny("--bias-update-rate", "0.01", "--expert-bias"))
    before, real = _state(run), S.clip_grad_norm_
    moe = next(m for m in run.core.modules() if isinstance(m, MoELayer))
    if rank == 1 and how == "grad":
        w = next(p for n, p in moe.named_parameters() if "experts" in n)
        w.register_hook(lambda g: g * float("nan"))
    if rank == 1 and how == "norm":
        S.clip_grad_norm_ = lambda *a, **k: (real(*a, **k), math.nan)[1]
    try:
        rec = S.train_step(run.model, run.core, run.opt, run.next_batch, run.ep, clip=1.0)
    finally:
        S.clip_grad_norm_ = real
    after = _state(run)
    return {
        "skipped": rec.skipped,
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        "adam": bool(run.opt.state),
        "load": float(moe.expert_load.sum()),
    }


@pytest.mark.parametrize("how", ["grad", "norm"])
def test_a_nan_on_one_rank_skips_the_step_on_every_rank_before_anything_changes(ranks, how):
    for r in ranks(2).run(_skip_with_nan_on_rank_1, how):
        assert r == {"skipped": True, "unchanged": True, "adam": False, "load": 0.0}


def test_three_skipped_steps_in_a_row_stop_the_run_naming_the_steps_and_the_loss_weights():
    with pytest.raises(failures.NonFiniteError) as e:
        # (an infinite loss weight, the other way in, is refused before the run starts)
        T.train(0, 1, tiny("--steps", "6", "--lr", "1e30", "--clip", "0"))
    assert "the run diverged: steps 2-4 had a non-finite loss or gradient norm" in str(e.value)
    assert "no checkpoint before them" in str(e.value) and "--lr (now 1e+30)" in str(e.value)


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "schemoe", "train", *TINY, "--nproc", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


def _error_line(run: subprocess.CompletedProcess) -> str:
    lines = [x for x in run.stderr.splitlines() if x.startswith("schemoe train: error: ")]
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    return lines[0]


def test_a_diverged_run_keeps_a_latest_that_resumes_and_trains_on_at_a_lower_lr(tmp_path, ranks):
    d = tmp_path / "ckpt"
    # --lr 1e6: step 2's loss is finite (~1e12) but its gradient norm NaN (the backward overflows
    # through weights of ~1e5), so step 1's checkpoint can never take a finite step again
    run = _run("--lr", "1e6", "--stop-after", "8", "--save", str(d), "--save-every", "1")
    assert run.returncode == 2
    line = _error_line(run)
    assert "steps 2-4 had a non-finite loss or gradient norm and were skipped (3 in a row" in line
    assert f"last good checkpoint: {d}/step-00000000, which {d}/latest names" in line, line
    names = sorted(p.name for p in d.iterdir())
    assert names == ["diverged-step-00000001", "latest", "step-00000000"]
    # the resume: the same 2-rank training, on the session's ranks (no second launcher)
    summary = ranks(2).run(train_on, ["--resume", str(d), "--lr", "3e-3", "--stop-after", "4"])[0]
    assert len(summary["losses"]) == 4 and all(v < 6 for v in summary["losses"])  # trains on


def test_a_state_holding_nan_is_not_saved_and_latest_keeps_the_last_finite_one(tmp_path):
    run = setup(0, 1, tiny())
    checkpoint.save(tmp_path, run.core, run.opt, step=1)
    with torch.no_grad():
        run.core.embed.weight[0, 0] = float("nan")
    refused = r"step 2 not written: .* NaN/Inf .*latest still names step-00000001"
    with pytest.raises(failures.NonFiniteError, match=refused):
        checkpoint.save(tmp_path, run.core, run.opt, step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]


def _full_disk_at_step_2(monkeypatch):
    real = FileSystem.create_stream

    def create_stream(self, path, mode):
        if "step-00000002" in str(path) and str(path).endswith(".distcp"):
            raise OSError(errno.ENOSPC, "No space left on device")  # as open() raises it
        return real(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)


def test_a_full_disk_at_save_time_names_enospc_and_the_file_and_keeps_the_previous_latest(
    tmp_path, monkeypatch
):
    _full_disk_at_step_2(monkeypatch)
    d = tmp_path / "ckpt"
    with pytest.raises(OSError) as e:
        T.train(0, 1, tiny("--steps", "4", "--save", str(d), "--save-every", "1"))
    assert (
        f"checkpoint of step 2 not written: rank 0: no space left on device writing "
        f"{d}/step-00000002.tmp/__0_0.distcp; removed the partial {d}/step-00000002.tmp; "
        f"{d}/latest still names step-00000001"
    ) == str(e.value)
    assert sorted(p.name for p in d.iterdir()) == ["latest", "step-00000000", "step-00000001"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 2-step run's checkpoint folder; tests copy it before damaging it."""
    d = tmp_path_factory.mktemp("faults") / "ckpt"
    T.train(0, 1, tiny("--steps", "2", "--eval-seqs", "0", "--save", str(d)))
    return d


def _copy(saved: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def _meta(d: Path) -> tuple[Path, dict]:
    path = d / "step-00000002" / "meta.json"
    return path, json.loads(path.read_text())


def _train_cli(capsys, monkeypatch, *args: str) -> tuple[int, str]:
    """`schemoe train` in this process with spawning forbidden: what is refused is refused
    before any rank starts."""
    monkeypatch.setattr(command, "spawn", lambda *a, **k: pytest.fail("a rank was started"))
    capsys.readouterr()
    rc = cli.main(["train", "--nproc", "2", *args])
    return rc, capsys.readouterr().err.strip()


def test_an_edited_step_in_meta_json_is_refused_naming_the_file(
    saved, tmp_path, capsys, monkeypatch
):
    d = _copy(saved, tmp_path)
    path, meta = _meta(d)
    meta["step"] = 1
    path.write_text(json.dumps(meta))
    rc, err = _train_cli(capsys, monkeypatch, "--resume", str(d), "--steps", "4")
    assert rc == 2 and err == (
        f"schemoe train: error: {path} was edited after it was written (its content no longer "
        "matches its meta_sha256; it says step 1): restore it or use another checkpoint; a "
        "resumed run takes other settings from flags, not from meta.json"
    )


def test_a_truncated_meta_json_is_an_error_naming_the_file(saved, tmp_path, capsys, monkeypatch):
    d = _copy(saved, tmp_path)
    path, _ = _meta(d)
    path.write_text(path.read_text()[:100])
    rc, err = _train_cli(capsys, monkeypatch, "--resume", str(d), "--steps", "4")
    assert rc == 2 and err.startswith(f"schemoe train: error: {path} is not valid JSON (")
    assert "truncated or damaged" in err and len(err.splitlines()) == 1


def test_a_torn_checkpoint_file_is_named_before_any_rank_starts(
    saved, tmp_path, capsys, monkeypatch
):
    d = _copy(saved, tmp_path)
    torn = d / "step-00000002" / "__0_0.distcp"
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    rc, err = _train_cli(capsys, monkeypatch, "--resume", str(d), "--steps", "4")
    assert rc == 2 and err.startswith(f"schemoe train: error: checkpoint file {torn} is corrupt")
    assert len(err.splitlines()) == 1


def _strip_digests(d: Path) -> Path:
    """The checkpoint as the format before digests wrote it."""
    path, meta = _meta(d)
    del meta["files"], meta["meta_sha256"]
    path.write_text(json.dumps(meta))
    return path


def test_a_checkpoint_without_digests_is_refused_unless_the_flag_allows_it(
    saved, tmp_path, capsys, monkeypatch
):
    d = _copy(saved, tmp_path)
    path = _strip_digests(d)
    rc, err = _train_cli(capsys, monkeypatch, "--resume", str(d), "--steps", "4")
    assert rc == 2 and err.startswith(f"schemoe train: error: {path} records no SHA-256 digests")
    assert "pass --allow-unverified-checkpoint to load it anyway" in err
    core = setup(0, 1, tiny()).core
    assert checkpoint.load(d, core, allow_unverified=True).step == 2


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp on one process
def test_an_unverified_checkpoint_whose_weights_make_the_final_eval_non_finite_fails(
    saved, tmp_path
):
    d = _copy(saved, tmp_path)
    _strip_digests(d)
    folder = d / "step-00000002"
    md = dcp.FileSystemReader(folder).read_metadata()
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
    }
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    state["model/embed.weight"].fill_(3e38)  # finite
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    cfg = tiny("--steps", "3", "--resume", str(d), "--allow-unverified-checkpoint")
    broken = r"the final eval loss \(step 3\) is nan: the model is broken, so it is not saved"
    with pytest.raises(failures.NonFiniteError, match=broken):
        T.train(0, 1, cfg)
