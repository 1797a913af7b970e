"""The checks of a `schemoe train` run that look outside its configuration: the corpus against
--seq-len, the checkpoint --resume names, and whether --save, --export, --plot, --log-file and
--tensorboard can be written (their folders are created, as the run would create them).

`TrainConfig.validate` calls them; each failure is a ValueError naming the flag and its value.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from ..checkpoint import store as checkpoint

__all__ = ["HELD_OUT", "check_corpus", "check_paths"]

HELD_OUT = 0.05  # the last 5% of the corpus is the eval split


def check_corpus(tokens: int, *, seq_len: int, eval_seqs: int, corpus_bytes: int) -> None:
    """Whether a corpus of `tokens` bytes holds --seq-len windows in both splits."""
    held = tokens - int(tokens * (1 - HELD_OUT))
    train = tokens - held
    if seq_len + 2 > train or (eval_seqs and seq_len + 1 > held):
        split, size = ("held-out 5%", held) if eval_seqs else ("training split", train)
        raise ValueError(
            f"--seq-len {seq_len} is too long for the corpus: its {split} has {size} bytes "
            f"(corpus {tokens} bytes, --corpus-bytes {corpus_bytes}); use a shorter "
            "--seq-len, a larger --corpus-bytes or --corpus"
        )


def _writable_dir(d: Path, flag: str, value: str) -> None:
    """Create `d` (as the run would) and write and remove a probe file in it."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".schemoe-probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{flag} {value!r} is not writable: {e}") from None


def _writable_file(path: str, flag: str) -> None:
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path!r} is a folder; give a file name")
    _writable_dir(p.parent, flag, path)


def check_paths(
    *,
    resume: str | None,
    save: str | None,
    export: str | None,
    plot: str | None,
    log_file: str | None,
    tensorboard: str | None,
) -> None:
    """The checkpoint --resume names exists and is complete; the outputs can be written."""
    if resume:
        checkpoint.resolve(resume)  # ValueError naming what is missing
    if save:
        if Path(save).exists() and not Path(save).is_dir():
            raise ValueError(f"--save {save!r} is a file; give a folder")
        _writable_dir(Path(save), "--save", save)
    for path, flag in ((export, "--export"), (plot, "--plot"), (log_file, "--log-file")):
        if path:
            _writable_file(path, flag)
    if tensorboard:
        _writable_dir(Path(tensorboard), "--tensorboard", tensorboard)
