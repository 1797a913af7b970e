"""The `schemoe train` command: arguments to a checked TrainConfig, then the run on --nproc local
ranks (`spawn`) or, under torchrun / srun, on this process's rank (`train.loop.train`).

Everything that can be checked is checked before a rank starts: the checkpoint --resume names
(every file against its digest), then every setting (`TrainConfig.validate`); a run with nothing
left to do prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from ..checkpoint import store as checkpoint
from ..cliargs import guard
from ..dist.host import configure_rank
from ..dist.launch import joined, spawn
from ..dist.lifeline import Interrupted
from ..dist.topology import launcher_local_rank
from .args import add_arguments, parse_args
from .config import TrainConfig
from .loop import train
from .resume import apply_resume, nothing_to_do

__all__ = ["register"]


def _main(a: argparse.Namespace) -> int:
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # under torchrun / srun
    apply_resume(a)  # the saved run's arguments, where this command line gives none
    cfg = TrainConfig.from_args(a)
    if cfg.resume and (not torchrun or os.environ.get("RANK") == "0"):
        # every file against its digest before any rank starts (under torchrun: rank 0's
        # launcher process, before the group forms; the ranks check again as they load)
        checkpoint.verify(cfg.resume, allow_unverified=cfg.allow_unverified_checkpoint)
    # Every setting is checked before a rank starts (under torchrun: before the group forms).
    cfg.validate(int(os.environ["WORLD_SIZE"]) if torchrun else cfg.nproc)
    if (line := nothing_to_do(cfg)) is not None:
        # Exit 0: the run asked for is complete (a requeued job that resumes is done, not failed).
        if not torchrun or os.environ.get("RANK") == "0":
            print(f"schemoe train: {line}", flush=True)
        return 0
    if torchrun:
        configure_rank(cfg.threads)
        if cfg.device == "cuda":
            torch.cuda.set_device(launcher_local_rank())
        with joined("nccl" if cfg.device == "cuda" else "gloo", cfg.timeout):
            train(dist.get_rank(), dist.get_world_size(), cfg)
        return 0
    # Collectives are bounded by --timeout; the run itself may take as long as it needs.
    if cfg.device == "cuda" and cfg.nproc > torch.cuda.device_count():
        raise ValueError(
            f"--nproc {cfg.nproc} with --device cuda needs {cfg.nproc} GPUs, this node has "
            f"{torch.cuda.device_count()}"
        )
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    try:
        spawn(train, cfg.nproc, cfg, timeout=cfg.timeout, threads=cfg.threads,
              run_timeout=float("inf"), backend=backend)  # fmt: skip
    except Interrupted as e:  # the one line says where a --resume would start
        raise Interrupted(e.signum, e.detail + _last_checkpoint(cfg)) from None
    return 0


def _last_checkpoint(cfg: TrainConfig) -> str:
    if not cfg.save:
        return "; nothing saved (no --save)"
    try:
        return f"; last checkpoint: {checkpoint.resolve(cfg.save)}"
    except ValueError:
        return f"; no checkpoint in {cfg.save} yet"


def register(sub) -> None:
    p = sub.add_parser("train", help="expert-parallel training run of a small MoE GPT")
    add_arguments(p)
    p.set_defaults(func=guard("schemoe train", _main))


if __name__ == "__main__":
    sys.exit(_main(parse_args()))
