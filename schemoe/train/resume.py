"""`schemoe train --resume`: the saved run's arguments, and whether anything is left to train."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..checkpoint import store as checkpoint
from ..checkpoint.meta import read_meta
from .config import flag

__all__ = ["apply_resume", "nothing_to_do"]


def _saved(a: argparse.Namespace) -> tuple[Path, dict]:
    """(the checkpoint folder --resume names, its meta.json, checked: `read_meta`)."""
    folder = checkpoint.resolve(a.resume)
    allow = bool(getattr(a, "allow_unverified_checkpoint", False))
    return folder, read_meta(folder, allow_unverified=allow)


# The model's shape: a resumed run takes these from the checkpoint; a different value is an error.
SHAPE = ("model_dim", "hidden_dim", "experts", "layers", "heads", "moe_every", "seq_len",
         "activation", "expert_bias")  # fmt: skip
# Where this invocation writes, and where it stops: never taken from the saved run.
NOT_RESUMED = ("resume", "save", "stop_after", "export", "plot", "log_file", "tensorboard",
               "allow_unverified_checkpoint")  # fmt: skip
# Flags renamed since a checkpoint may have been written: saved name -> current name.
RENAMED = {"dim": "model_dim", "hidden": "hidden_dim", "compress": "compressor",
           "compress_backward": "compressor_backward", "compress_option": "compressor_option",
           "grad_compress": "grad_compressor"}  # fmt: skip


def apply_resume(a: argparse.Namespace) -> None:
    """With --resume: every argument of the saved run (meta.json's "args") that this command line
    did not give (`a.explicit`, recorded by the parser; without it every value counts as given)
    is taken from it, except where this run writes and stops (NOT_RESUMED). A shape flag (SHAPE)
    given with another value than the saved one is a ValueError. --save defaults to the
    checkpoint's folder, so the run keeps saving where it was saved. Idempotent."""
    if not a.resume:
        return
    folder, meta = _saved(a)
    saved = meta.get("args", {})
    saved = {RENAMED.get(k, k): v for k, v in saved.items()}
    explicit = set(getattr(a, "explicit", vars(a)))
    for k, v in saved.items():
        if k in NOT_RESUMED or not hasattr(a, k):
            continue
        if k in SHAPE and k in explicit and v is not None and getattr(a, k) != v:
            raise ValueError(
                f"{flag(k)} {getattr(a, k)} conflicts with the checkpoint's {v} ({folder}): a "
                f"resumed run keeps the model's shape; drop {flag(k)}"
            )
        if k not in explicit:
            setattr(a, k, v)
    if "save" not in explicit and not a.save:
        root = folder.parent if (folder.parent / "latest").exists() else folder
        a.save = str(root)


def nothing_to_do(a: argparse.Namespace) -> str | None:
    """With --resume: the line that says there is nothing to train when the checkpoint has
    reached the last step (--steps, or --stop-after) already; otherwise None."""
    if not a.resume:
        return None
    step = int(_saved(a)[1]["step"])
    last = min(a.steps, a.stop_after) if a.stop_after else a.steps
    if step < last:
        return None
    flag = "--stop-after" if a.stop_after and a.stop_after < a.steps else "--steps"
    return (
        f"nothing to do: the checkpoint {a.resume!r} is at step {step} and {flag} is {last}; "
        "raise --steps to train further"
    )
