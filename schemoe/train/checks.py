"""The checks of a `schemoe train` run beyond each value's own type and range: the ranges every
command shares (cliargs.FLAG_CHECKS), the flags that only make sense together (--warmup against
--steps), what the machine allows (--threads against its cores, the parameters and optimizer
state against its memory, --chunks against the rows a layer call cuts), the corpus (text, large
enough, --seq-len windows in both splits), the checkpoint --resume names, and whether --save,
--export, --plot, --log-file and --tensorboard can be written (their folders are created, as the
run would create them).

`TrainConfig` calls them (`check_settings` on construction, `check_machine`, `check_corpus` and
`check_paths` in `validate`); each failure is a ValueError naming the flag and its value. The
sizing functions (`fits_in_memory`, `check_chunk_rows`) serve the benches and `schemoe profile`
too, so the same flags are refused alike everywhere.
"""

from __future__ import annotations

import dataclasses
import math
import os
import uuid
from pathlib import Path

import torch

from ..checkpoint import store as checkpoint
from ..cliargs import flag_problem
from ..config import GateConfig
from ..routing.layout import Partition
from ..routing.router import capacity
from ..scheduling import POLICIES
from .model import read_corpus

__all__ = [
    "HELD_OUT",
    "TRAIN_BYTES_PER_PARAM",
    "available_memory",
    "check_chunk_rows",
    "check_corpus",
    "check_corpus_text",
    "check_machine",
    "check_paths",
    "check_settings",
    "fits_in_memory",
    "moe_layer_params",
    "train_params",
    "usable_cores",
]

HELD_OUT = 0.05  # the last 5% of the corpus is the eval split
# fp32 weight, its gradient, AdamW's two moments: what each parameter holds through a step.
TRAIN_BYTES_PER_PARAM = 16
GIB = 2**30


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_settings(cfg) -> None:
    """What a TrainConfig's values say together, before anything depends on the machine: each
    flag in cliargs.FLAG_CHECKS in its range (--seed, --timeout, ... as the benches check them),
    no setting infinite (--z-loss-weight inf would make every loss inf), and a warm-up that ends
    before the run does."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if line := flag_problem(_flag(f.name), v):
            raise ValueError(line)
        if isinstance(v, float) and math.isinf(v):  # NaN: each setting's own range refuses it
            raise ValueError(f"{_flag(f.name)} must be finite, got {v:g}")
    w, steps = cfg.warmup, cfg.steps
    if w is not None and w > 0 and w >= steps:
        raise ValueError(
            f"--warmup {w} must be < --steps {steps}: the run would end inside its linear "
            f"warm-up (its last step's learning rate is {steps}/{w} of --lr {cfg.lr:g}) and never "
            "reach the cosine decay; use a shorter --warmup or more --steps"
        )


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory() -> int | None:
    """Bytes of memory a new process can take without swapping: MemAvailable of /proc/meminfo,
    else the free pages (os.sysconf); None when neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def moe_layer_params(
    model_dim: int, hidden_dim: int, experts: int, ranks: int, *, swiglu=False, bias=False
) -> int:
    """Parameters of one MoE layer on one of `ranks` expert-parallel ranks: the replicated gate
    (E x M) and the E / ranks local experts (2 or, with swiglu, 3 matrices of M x H each)."""
    per_expert = (3 if swiglu else 2) * model_dim * hidden_dim
    per_expert += hidden_dim + model_dim if bias else 0
    return experts * model_dim + -(-experts // ranks) * per_expert


def fits_in_memory(
    params: int, bytes_per_param: int, local_ranks: int, flags: str, *, held: str, device="cpu"
) -> None:
    """ValueError naming `flags` (the flags that set the size, as typed) when `params` per rank,
    at `bytes_per_param` (`held`: what they are, for the message), do not fit: `local_ranks` of
    them in the machine's available memory (cpu), or one in a GPU's memory (cuda). A lower
    bound: activations come on top."""
    need = params * bytes_per_param
    if device == "cuda" and torch.cuda.is_available():
        limit, where, total = torch.cuda.get_device_properties(0).total_memory, "a GPU has", need
    else:
        limit, where = available_memory(), "this machine has available (MemAvailable)"
        total = need * local_ranks
    if limit is None or total <= limit:
        return
    ranks = "" if total == need else f" x {local_ranks} local ranks = {total / GIB:,.1f} GiB"
    raise ValueError(
        f"{flags}: {params:,} parameters per rank need ~{need / GIB:,.1f} GiB ({held}: "
        f"{bytes_per_param} bytes each){ranks}, more than the {limit / GIB:,.1f} GiB {where}; "
        "use fewer experts, smaller dims or more ranks"
    )


def check_chunk_rows(
    chunks: int, policy: str, gate: GateConfig, tokens: int, ranks: int, flags: str
) -> None:
    """ValueError when r = `chunks` cuts a layer call into more chunks than it has rows: under a
    capacity partition each chunk takes a share of every expert's C rows (dropless: at most the
    `tokens` a rank routes), under a peers partition (fastermoe) a group of the `ranks`.
    `flags` names the flags that set the tokens, as typed."""
    if policy not in POLICIES:  # auto and search choose r themselves
        return
    if POLICIES.get(policy).partition == Partition.PEERS:
        if chunks > ranks:
            raise ValueError(
                f"--chunks {chunks} is more than the {ranks} expert-parallel ranks that policy "
                f"{policy} splits into chunks; use --chunks <= {ranks}"
            )
        return
    rows = capacity(gate, tokens) if gate.capacity_factor else tokens
    if chunks > rows:
        what = (
            f"capacity C = min(ceil(f k T / E), T) = {rows} with T = {tokens} tokens ({flags})"
            if gate.capacity_factor
            else f"dropless: at most T = {tokens} tokens ({flags})"
        )
        raise ValueError(
            f"--chunks {chunks} is more than the {rows} rows each expert takes per rank and "
            f"call ({what}): chunks would be empty; use --chunks <= {rows}"
        )


def check_machine(cfg, world: int | None) -> None:
    """What this machine allows a TrainConfig's run: --threads at most its cores, --chunks at
    most the rows of a layer call, the parameters and optimizer state of `world` ranks (this
    node's share of them) in its available memory, and a corpus of text."""
    cores = usable_cores()
    if cfg.threads > cores:
        raise ValueError(
            f"--threads {cfg.threads} is more than the {cores} CPU cores this process may use "
            f"(refused, not capped); use --threads <= {cores}"
        )
    ranks = world or cfg.nproc
    ep = cfg.ep_size or ranks
    experts = cfg.num_experts(ranks)
    m = cfg.micro_chunks if isinstance(cfg.micro_chunks, int) else 1  # auto: m >= 1
    tokens = cfg.batch * cfg.seq_len // m
    gate = GateConfig(
        num_experts=experts, top_k=min(cfg.top_k, experts), capacity_factor=cfg.capacity_factor
    )
    t_flags = f"--batch {cfg.batch} x --seq-len {cfg.seq_len}" + (
        f" / --micro-chunks {m}" if m > 1 else ""
    )
    fits_in_memory(
        train_params(cfg, experts, ep),
        TRAIN_BYTES_PER_PARAM,
        int(os.environ.get("LOCAL_WORLD_SIZE", ranks)),  # the launcher's ranks on this node
        f"--experts {experts}, --model-dim {cfg.model_dim}, --hidden-dim {cfg.hidden_dim}, "
        f"--layers {cfg.layers}",
        held="fp32 weights, gradients and AdamW's two moments",
        device=cfg.device,
    )
    check_chunk_rows(cfg.chunks, cfg.policy, gate, tokens, ep, t_flags)
    check_corpus_text(cfg.corpus, cfg.corpus_bytes)


def train_params(cfg, experts: int, ep: int) -> int:
    """Parameters per rank of the GPT a TrainConfig (or bench step's flags) builds (model.GPT):
    embeddings, per block attention and two norms, MoE layers (moe_layer_params) or dense FFNs,
    the final norm."""
    M, H = cfg.model_dim, cfg.hidden_dim
    moe_blocks = cfg.layers // cfg.moe_every
    dense_blocks = cfg.layers - moe_blocks
    moe = moe_layer_params(
        M,
        H,
        experts,
        ep,
        swiglu=getattr(cfg, "activation", "gelu") == "swiglu",
        bias=getattr(cfg, "expert_bias", False),
    )
    per_block = 4 * M * M + 4 * M
    return (
        (256 + cfg.seq_len) * M
        + cfg.layers * per_block
        + moe_blocks * moe
        + dense_blocks * (2 * M * H + H + M)
        + 2 * M
    )


def check_corpus_text(path: str | None, max_bytes: int) -> None:
    """The corpus reads as text and holds enough of it (model.read_corpus), blamed on --corpus."""
    try:
        read_corpus(path, max_bytes)
    except ValueError as e:
        raise ValueError(f"--corpus: {e}") from None


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
