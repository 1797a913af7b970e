"""DCP checkpoints of an FSDP2 run (`schemoe train --fsdp`, dense weights DTensors): a run saved
and resumed on the same ranks takes the uninterrupted run's losses bitwise, and its checkpoint
loads into a plain one-process model (every DTensor shard reassembled) and back into FSDP."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from schemoe.checkpoint import store as checkpoint
from schemoe.train import loop as T
from schemoe.train.model import evaluate
from schemoe.train.setup import setup
from train_cases import tiny

FLAGS = ("--capacity-factor", "0", "--steps", "4", "--eval-seqs", "4")  # dropless: P-independent


def _fsdp_runs(rank: int, world: int, d: str) -> dict:
    straight = T.train(rank, world, tiny(*FLAGS, "--fsdp"))
    T.train(rank, world, tiny(*FLAGS, "--fsdp", "--stop-after", "2", "--save", d))
    resumed = T.train(rank, world, tiny(*FLAGS, "--fsdp", "--resume", d, "--save", d))
    run = setup(rank, world, tiny(*FLAGS, "--fsdp"))
    checkpoint.load(d, run.core, run.opt)  # the step-4 checkpoint back into FSDP
    sharded = isinstance(run.core.embed.weight, DTensor) and all(
        isinstance(v, DTensor) for v in run.opt.state[run.core.embed.weight].values() if v.dim()
    )
    again = evaluate(run.core, run.windows, run.cfg.batch)
    return {"straight": straight, "resumed": resumed, "sharded": sharded, "again": again}


def test_an_fsdp_run_saved_and_resumed_takes_the_same_losses_and_loads_on_one_process(
    ranks, tmp_path
):
    got = ranks(2).run(_fsdp_runs, str(tmp_path))[0]
    assert got["resumed"]["losses"] == got["straight"]["losses"]  # bitwise
    assert got["sharded"] and got["again"] == got["resumed"]["eval_loss"]
    run = setup(0, 1, tiny(*FLAGS))  # no FSDP, one rank: the shards gathered by DCP
    assert checkpoint.load(tmp_path, run.core, run.opt).step == 4
    assert not isinstance(run.core.embed.weight, DTensor)
    one = evaluate(run.core, run.windows, run.cfg.batch)
    assert math.isclose(one, got["resumed"]["eval_loss"], rel_tol=1e-5)
    state, _ = checkpoint.load_export(checkpoint.export(tmp_path, tmp_path / "m.pt"))
    assert all(torch.equal(state[k], v) for k, v in run.core.state_dict().items())
