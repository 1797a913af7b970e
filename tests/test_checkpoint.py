"""Checkpoints (DCP): written on 4 ranks they load on 2 and on 1 (experts and their optimizer
state resharded), export to one file, load nothing but tensors, survive an interrupted write, and
checkpoints of the format before DCP still load."""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.checkpoint.filesystem import FileSystem

import train_cases
from schemoe.checkpoint import files as checkpoint_files
from schemoe.checkpoint import store as checkpoint
from schemoe.checkpoint.meta import meta_digest, read_meta
from schemoe.checkpoint.shards import rank_state
from schemoe.train import loop as T
from schemoe.train.model import GPT, GPTConfig, eval_windows, evaluate, load_corpus
from schemoe.train.setup import optimizer


def tiny(*extra: str):
    return train_cases.tiny("--capacity-factor", "0", *extra)  # dropless


def build(a):
    torch.manual_seed(a.seed)
    core = GPT(
        GPTConfig(seq_len=a.seq_len, layers=a.layers, heads=a.heads),
        T.moe_config_from_args(a),
        seed=a.seed,
    )
    return core, optimizer(core, a.lr, a.weight_decay)


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    return checkpoint._tensors(folder, read_meta(folder))


@contextmanager
def _stream(path: str, fail: str, then=None):
    """A file opened by DCP; for one whose name contains `fail`, half a record is written,
    `then` runs (default: the disk is full) and the write fails."""
    if fail not in str(path):
        with _real_stream(FileSystem(), path, "wb") as f:
            yield f
        return
    Path(path).write_bytes(b"PK\x03\x04 half a record")
    (then or _full_disk)()
    yield None


def _full_disk():
    raise OSError(errno.ENOSPC, "No space left on device")


_real_stream = FileSystem.create_stream


def _failing_in(fail: str, then=None):
    def create_stream(self, path, mode):
        return _stream(path, fail, then) if "w" in mode else _real_stream(self, path, mode)

    return create_stream


def _write_on_four(rank: int, world: int, d: str) -> dict:
    return T.train(rank, world, tiny("--steps", "6", "--stop-after", "3", "--save", d))


def _reshard_on_two(rank: int, world: int, d: str, d2: str, exported: str) -> dict:
    evaluated = T.train(rank, world, tiny("--steps", "6", "--stop-after", "3", "--resume", d))
    a = tiny()
    core, opt = build(a)
    got = checkpoint.load(d, core, opt)
    checkpoint.save(d2, core, opt, step=got.step, meta=got.meta)
    from_file, _ = build(a)
    checkpoint.load(exported, from_file)  # the one-file export, resharded the same way
    assert all(torch.equal(from_file.state_dict()[k], v) for k, v in core.state_dict().items())
    more = T.train(rank, world, tiny("--steps", "6", "--resume", d))
    return {"eval": evaluated["eval_loss"], "more": more["losses"]}


def test_checkpoint_written_on_four_ranks_loads_on_two_and_one_and_exports(tmp_path, ranks):
    d, d2, d1 = (str(tmp_path / n) for n in ("p4", "p2", "p1"))
    r4 = ranks(4).run(_write_on_four, d)[0]
    out = checkpoint.export(d, tmp_path / "model.pt")
    r2 = ranks(2).run(_reshard_on_two, d, d2, str(out))
    # dropless routing makes every token's output independent of P: same held-out loss
    assert math.isclose(r2[0]["eval"], r4["eval_loss"], rel_tol=1e-5)
    r1 = T.train(0, 1, tiny("--steps", "6", "--stop-after", "3", "--resume", d))
    assert math.isclose(r1["eval_loss"], r4["eval_loss"], rel_tol=1e-5)
    # resharded model and AdamW state, saved again on 2 ranks and on 1: the same tensors
    core, opt = build(tiny())
    got = checkpoint.load(d, core, opt)
    assert got.step == 3 and got.rng is None  # RNG streams only restore on the same P
    checkpoint.save(d1, core, opt, step=3)
    ref = tensors_of(checkpoint.resolve(Path(d)))
    assert any(k.startswith("optim/exp_avg_sq/") and "experts.w1_EMH[3]" in k for k in ref)
    for other in (d2, d1):
        got_t = tensors_of(checkpoint.resolve(Path(other)))
        assert got_t.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got_t[k], ref[k]), k
    # training continues after resharding, from the 4-rank history
    assert r2[0]["more"][:3] == r4["losses"] and all(math.isfinite(v) for v in r2[0]["more"])
    # single-file export: the one-rank state_dict
    state, meta = checkpoint.load_export(out)
    assert meta["step"] == 3 and state["blocks.1.ffn.experts.w1_EMH"].shape == (4, 32, 48)
    fresh, _ = build(tiny())
    fresh.load_state_dict(state)
    data = load_corpus(None, 200_000)
    held = eval_windows(data[int(data.numel() * 0.95) :], 8, 32, 0, 1)
    assert math.isclose(evaluate(fresh, held, 4), r4["eval_loss"], rel_tol=1e-5)
    again, _ = build(tiny())
    checkpoint.load(out, again)  # load() takes the exported file too
    assert all(torch.equal(again.state_dict()[k], v) for k, v in state.items())


def _one_step(core, opt):
    logits, aux = core(torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1)))
    (logits.square().mean() + aux).backward()
    opt.step()


def test_a_write_that_raises_midway_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    core, opt = build(tiny())
    _one_step(core, opt)
    checkpoint.save(tmp_path, core, opt, step=1)
    saved = {k: v.clone() for k, v in core.state_dict().items()}
    _one_step(core, opt)
    monkeypatch.setattr(FileSystem, "create_stream", _failing_in("step-00000002.tmp/__0_0"))
    with pytest.raises(OSError, match=r"rank 0: no space left on device writing \S+/__0_0\.distcp"):
        checkpoint.save(tmp_path, core, opt, step=2)
    assert (tmp_path / "latest").read_text() == "step-00000001"
    assert not (tmp_path / "step-00000002.tmp").exists()  # the partial files are removed
    fresh, fopt = build(tiny())
    assert checkpoint.load(tmp_path, fresh, fopt).step == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
    monkeypatch.undo()
    checkpoint.save(tmp_path, core, opt, step=2)
    assert checkpoint.load(tmp_path, fresh, fopt).step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step-00000001",
        "step-00000002",
    ]


@contextmanager
def _full_at_write(path: str):
    """A file that is created, then fills the disk on its first write (as a tmpfs does)."""
    with open(path, "wb") as f:

        class Full:
            def write(self, data) -> int:
                f.write(bytes(data[:100]))
                raise OSError(errno.ENOSPC, "No space left on device")

            def flush(self) -> None:
                f.flush()

            def fileno(self) -> int:
                return f.fileno()

        yield Full()


def _rank_1_fills_the_disk(rank: int, world: int, d: str) -> str | None:
    core, opt = build(tiny())
    checkpoint.save(d, core, opt, step=1)
    if rank == 1:  # only rank 1's file of step 2 hits the full disk
        FileSystem.create_stream = lambda self, path, mode: (
            _full_at_write(path)
            if "step-00000002.tmp/__1_0" in str(path)
            else _real_stream(self, path, mode)
        )
    try:
        checkpoint.save(d, core, opt, step=2)
    except OSError as e:
        return str(e)
    finally:
        FileSystem.create_stream = _real_stream  # the pool's rank runs other cases next
    return None


def test_a_full_disk_on_another_rank_is_what_every_rank_reports(tmp_path, ranks):
    # rank 1's write fails; rank 0 wrote its part, but DCP then writes no .metadata: the line
    # every rank raises names rank 1's ENOSPC and its file, not rank 0's missing .metadata
    said = ranks(2).run(_rank_1_fills_the_disk, str(tmp_path))
    want = f"rank 1: no space left on device writing {tmp_path}/step-00000002.tmp/__1_0.distcp"
    assert all(s is not None and want in s for s in said), said
    assert (tmp_path / "latest").read_text() == "step-00000001"
    assert not (tmp_path / "step-00000002.tmp").exists()


def _killed_writer(d: str, ready) -> None:
    core, opt = build(tiny())
    checkpoint.save(d, core, opt, step=1)
    # killed after half a record of its file, mid-write
    FileSystem.create_stream = _failing_in(
        "step-00000002.tmp/__0_0", lambda: ready.set() or time.sleep(60)
    )
    checkpoint.save(d, core, opt, step=2)


def test_a_writer_killed_mid_file_leaves_the_previous_checkpoint_loadable(tmp_path):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_killed_writer, args=(str(tmp_path), ready), daemon=True)
    p.start()
    assert ready.wait(60), "the writer never reached the middle of its write"
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert (tmp_path / "step-00000002.tmp" / "__0_0.distcp").exists()  # the half-written file
    fresh, _ = build(tiny())
    assert checkpoint.load(tmp_path, fresh).step == 1
    ref, _ = build(tiny())  # the writer saved a freshly built model
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in ref.state_dict().items())


class _Exploit:
    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __reduce__(self):
        return (open, (self.flag, "w"))


def _fix_digest(folder: Path, name: str) -> None:
    """A writer who can also fix digests: `name`'s SHA-256 and meta.json's own, rewritten."""
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"][name] = checkpoint_files.sha256(folder / name)
    meta["meta_sha256"] = meta_digest(meta)
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_loading_refuses_a_checkpoint_that_carries_arbitrary_pickled_objects(tmp_path, name):
    core, opt = build(tiny())
    checkpoint.save(tmp_path, core, opt, step=1)
    folder = checkpoint.resolve(tmp_path)
    flag = tmp_path / "pwned"
    with open(folder / name, "wb") as f:  # DCP's metadata is a plain pickle; records torch.save
        (pickle.dump if name == ".metadata" else torch.save)(_Exploit(str(flag)), f)
    _fix_digest(folder, name)
    with pytest.raises(ValueError, match="weights_only"):
        checkpoint.load(tmp_path, core)
    with pytest.raises(ValueError, match="weights_only"):
        checkpoint.export(tmp_path, tmp_path / "model.pt")
    assert not flag.exists()


def test_rotation_keeps_the_newest_checkpoints(tmp_path):
    core, opt = build(tiny())
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, core, opt, step=step)  # keep=2
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step-00000003", "step-00000004"]
    assert json.loads((tmp_path / "step-00000004" / "meta.json").read_text())["finite"] is True


def _flip_in_the_middle(path: Path, n: int) -> None:
    raw = bytearray(path.read_bytes())
    for i in range(len(raw) // 2 - n // 2, len(raw) // 2 - n // 2 + n):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("n", [16, 64])
@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_a_checkpoint_file_with_flipped_bytes_in_its_tensor_data_is_refused_naming_it(
    tmp_path, name, n
):
    core, opt = build(tiny())
    checkpoint.save(tmp_path, core, opt, step=1, rng={"torch": torch.get_rng_state()})
    _flip_in_the_middle(tmp_path / "step-00000001" / name, n)
    fresh, fopt = build(tiny())
    with pytest.raises(ValueError, match=rf"step-00000001/\{name} is corrupt: its SHA-256"):
        checkpoint.load(tmp_path, fresh, fopt)


def test_a_missing_expert_shard_is_named_as_missing_not_blamed_on_another_model(tmp_path):
    core, opt = build(tiny())
    checkpoint.save(tmp_path, core, opt, step=1)
    (tmp_path / "step-00000001" / "__0_0.distcp").unlink()
    with pytest.raises(ValueError, match=r"is missing __0_0\.distcp"):
        checkpoint.load(tmp_path, build(tiny())[0])
    with pytest.raises(ValueError, match=r"is missing __0_0\.distcp"):
        checkpoint.export(tmp_path, tmp_path / "model.pt")


def test_meta_json_lists_a_sha256_for_every_file_of_the_checkpoint(tmp_path):
    core, opt = build(tiny())
    folder = checkpoint.save(tmp_path, core, opt, step=1, rng={"torch": torch.get_rng_state()})
    files = json.loads((folder / "meta.json").read_text())["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp"]
    assert all(len(v) == 64 for v in files.values())
    assert sorted(p.name for p in folder.iterdir()) == sorted([*files, "meta.json"])


def _write_legacy(root: Path, core, opt, step: int, rng: dict) -> None:
    """One rank's checkpoint as the writer before DCP laid it out: dense.pt, experts-00000.pt,
    rng-00000.pt (torch.save dicts under the same keys) and meta.json with their digests."""
    state = rank_state(core, opt, rng, 0)
    files: dict[str, dict[str, torch.Tensor]] = {"dense.pt": {}, "experts-00000.pt": {}}
    for k, v in state.items():
        if not k.startswith("rng/"):
            files["experts-00000.pt" if ".experts." in k else "dense.pt"][k] = v
    files["rng-00000.pt"] = {k.removeprefix("rng/0/"): v for k, v in state.items() if "rng/" in k}
    folder = root / f"step-{step:08d}"
    folder.mkdir(parents=True)
    for name, tensors in files.items():
        torch.save(tensors, folder / name)
    meta = {"format": "schemoe-checkpoint/1", "step": step, "world_size": 1, "finite": True}
    meta["files"] = {n: checkpoint_files.sha256(folder / n) for n in files}
    meta["meta_sha256"] = meta_digest(meta)
    (folder / "meta.json").write_text(json.dumps(meta))
    (root / "latest").write_text(folder.name)


def test_a_checkpoint_in_the_format_before_dcp_still_loads_resumes_and_exports(tmp_path):
    core, opt = build(tiny())
    _one_step(core, opt)
    rng = {"torch": torch.get_rng_state()}
    _write_legacy(tmp_path / "old", core, opt, 1, rng)
    assert checkpoint.verify(tmp_path / "old").name == "step-00000001"
    fresh, fopt = build(tiny())
    got = checkpoint.load(tmp_path / "old", fresh, fopt)
    assert got.step == 1 and torch.equal(got.rng["torch"], rng["torch"])
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in core.state_dict().items())
    # the AdamW state came back too: the next step is the same step
    for m, o in ((core, opt), (fresh, fopt)):
        m.zero_grad()
        torch.manual_seed(0)  # the same routing noise
        _one_step(m, o)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in core.state_dict().items())
    state, _ = checkpoint.load_export(checkpoint.export(tmp_path / "old", tmp_path / "m.pt"))
    assert state.keys() == core.state_dict().keys()
    (tmp_path / "old" / "step-00000001" / "experts-00000.pt").unlink()
    with pytest.raises(ValueError, match=r"is missing experts-00000\.pt"):
        checkpoint.load(tmp_path / "old", fresh, fopt)
