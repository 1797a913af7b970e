"""Shared by the `schemoe train` tests (checkpoint, failures, train): the tiny model and run they
all start from, as command-line arguments (TINY) and as the TrainConfig they build (tiny)."""

from __future__ import annotations

from schemoe.train import loop as T
from schemoe.train.config import TrainConfig

TINY = [
    "--device",  # the test ranks are gloo CPU ranks, also on a machine with a GPU
    "cpu",
    "--model-dim",
    "32",
    "--hidden-dim",
    "48",
    "--layers",
    "2",
    "--heads",
    "2",
    "--seq-len",
    "32",
    "--batch",
    "4",
    "--experts",
    "4",
    "--corpus-bytes",
    "200000",
    "--eval-seqs",
    "8",
    "--eval-every",
    "0",
    "--log-every",
    "1000",
]


def tiny(*extra: str) -> TrainConfig:
    """The TrainConfig of the tiny run's command line with `extra` appended."""
    return TrainConfig.from_args(T.parse_args([*TINY, *extra]))


def train_on(rank: int, world: int, extra: list[str]) -> dict:
    """One rank of the tiny run with `extra` (for `RankPool.run(train_on, extra)`): its summary."""
    return T.train(rank, world, tiny(*extra))
