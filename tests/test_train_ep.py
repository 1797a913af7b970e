"""`schemoe train` at ep 2 x dp 2 on 4 ranks: the loss falls with the flat algorithm and with the
two that make sub-groups of the expert-parallel groups (pipe; leader, whose node and peer groups
hier2d shares), and a run saved at ep 2 resumes at ep 4 and at ep 1 (same world, another expert
layout) from the saved step. Every algorithm's result against the reference: test_collectives."""

from __future__ import annotations

import pytest

from schemoe.train import loop as T
from train_cases import tiny

ALGOS = ("naive", "pipe", "leader")


def _run(rank, world, extra):
    return T.train(rank, world, tiny(*extra))


@pytest.mark.parametrize("algorithm", ALGOS)
def test_training_at_ep2_dp2_lowers_the_loss(ranks, algorithm):
    extra = ["--ep-size", "2", "--ranks-per-node", "1", "--algorithm", algorithm, "--steps", "6"]
    out = ranks(4).run(_run, extra)
    losses = out[0]["losses"]
    assert (out[0]["ep_size"], out[0]["dp_size"]) == (2, 2)
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert all(r["losses"] == losses for r in out)  # the mean loss, the same on every rank


@pytest.mark.parametrize("ep_size", ["4", "1"])
def test_a_run_saved_at_ep2_resumes_at_another_ep_size(ranks, tmp_path, ep_size):
    ckpt = str(tmp_path / "ckpt")
    first = ranks(4).run(_run, ["--ep-size", "2", "--steps", "6", "--stop-after", "3",
                                "--save", ckpt])  # fmt: skip
    resumed = ranks(4).run(_run, ["--ep-size", ep_size, "--steps", "6", "--resume", ckpt])
    assert resumed[0]["losses"][:3] == first[0]["losses"]
    assert len(resumed[0]["losses"]) == 6 and resumed[0]["ep_size"] == int(ep_size)
