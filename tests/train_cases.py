"""Shared by the `schemoe train` tests (checkpoint, failures, train): the tiny model and run they
all start from, as command-line arguments."""

from __future__ import annotations

from schemoe.train import loop as T

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


def tiny(*extra: str):
    """The parsed arguments of the tiny run, with `extra` appended."""
    return T.parse_args([*TINY, *extra])
