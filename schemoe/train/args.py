"""The `schemoe train` command line: its arguments, the MoEConfig they build, and their checks.

`validate(a, world)` runs every check before any rank starts (`schemoe train` calls it before
spawning ranks or initialising the process group), so bad input is one error line, never a
traceback per rank: numbers and ranges, plug-in names, the model shape, the corpus against
--seq-len, the checkpoint --resume names, and whether --save, --export and --plot can be written.
Each failure is a ValueError (TypeError for a wrong type) naming the flag and the value.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import uuid
from pathlib import Path

import torch

from .. import compression
from ..checkpoint import store as checkpoint
from ..cliargs import Parser
from ..collectives import ALGORITHMS
from ..config import (
    CollectiveConfig,
    CompressionConfig,
    ExpertConfig,
    GateConfig,
    MoEConfig,
    ParallelConfig,
    ScheduleConfig,
)
from ..scheduling import POLICIES
from ..step.gradsync import COMPRESS, GRAD_SYNCS, SYNCS
from .model import GPTConfig, corpus_size

__all__ = [
    "add_arguments",
    "check_args",
    "check_corpus",
    "check_paths",
    "flag",
    "moe_config_from_args",
    "num_experts",
    "parse_args",
    "validate",
]

HELD_OUT = 0.05  # the last 5% of the corpus is the eval split


def _options(items: list[str]) -> dict[str, dict]:
    """["zfp.rate=4", ...] -> {"zfp": {"rate": 4}}; values are JSON, else strings."""
    out: dict[str, dict] = {}
    for it in items:
        name, _, rest = it.partition(".")
        key, eq, val = rest.partition("=")
        if not (name and key and eq):
            raise ValueError(f"--compressor-option must look like NAME.KEY=VALUE, got {it!r}")
        try:
            val = json.loads(val)
        except json.JSONDecodeError:
            pass  # a plain string
        out.setdefault(name, {})[key] = val
    return out


def num_experts(a: argparse.Namespace, world: int | None) -> int:
    """--experts, or by default 2 per expert-parallel rank (--ep-size, else every rank; 2 per
    rank when the rank count is not known yet)."""
    if a.experts is not None:
        return a.experts
    return 2 * (a.ep_size or world or 1)


def moe_config_from_args(a: argparse.Namespace, world: int | None = None) -> MoEConfig:
    """Every MoEConfig field, from the command line (`world`: the rank count, for the default
    expert count)."""
    return MoEConfig(
        gate=GateConfig(
            num_experts=num_experts(a, world),
            top_k=a.top_k,
            capacity_factor=a.capacity_factor,
            renormalize=a.renormalize,
            noise_std=a.noise_std,
            priority=a.priority,
            aux_loss_weight=a.aux_loss_weight,
            z_loss_weight=a.z_loss_weight,
            bias_update_rate=a.bias_update_rate,
        ),
        experts=ExpertConfig(
            model_dim=a.model_dim,
            hidden_dim=a.hidden_dim,
            activation=a.activation,
            bias=a.expert_bias,
        ),
        parallel=ParallelConfig(ranks_per_node=a.ranks_per_node, uniform_tokens=a.uniform_tokens),
        schedule=ScheduleConfig(
            policy=a.policy,
            chunks=a.chunks,
            accuracy_budget=a.budget,
            trials=a.trials,
            shortlist=a.shortlist,
        ),
        collective=CollectiveConfig(algorithm=a.algorithm),
        compression=CompressionConfig(
            forward=a.compressor,
            backward=a.compressor_backward,
            options=_options(a.compressor_option),
        ),
    )


def micro_chunks_arg(text: str) -> int | str:
    """--micro-chunks as typed: an int, or the text (check_args accepts "auto" only)."""
    return int(text) if text.lstrip("-").isdigit() else text


def flag(name: str) -> str:
    """The command-line spelling of argument `name`."""
    return "--" + name.replace("_", "-")


def check_args(a: argparse.Namespace, world: int | None = None) -> None:
    """The checks that need no file: ranges, names, the model's shape, and (when `world` is
    known) that the experts and --ranks-per-node divide over the ranks."""
    for n, lo in (
        ("nproc", 1),
        ("steps", 1),
        ("batch", 1),
        ("grad_accum", 1),
        ("seq_len", 1),
        ("layers", 1),
        ("heads", 1),
        ("moe_every", 1),
        ("save_every", 0),
        ("eval_every", 0),
        ("eval_seqs", 0),
        ("warmup", 0),
        ("stop_after", 0),
        ("log_every", 1),
        ("threads", 1),
        ("corpus_bytes", 10_000),
    ):
        if (v := getattr(a, n)) is not None and v < lo:
            raise ValueError(f"{flag(n)} must be >= {lo}, got {v}")
    if a.micro_chunks != "auto":
        if not isinstance(a.micro_chunks, int) or a.micro_chunks < 1:
            raise ValueError(f"--micro-chunks must be an int >= 1 or auto, got {a.micro_chunks!r}")
        if a.batch % a.micro_chunks:
            raise ValueError(
                f"--batch {a.batch} must be divisible by --micro-chunks {a.micro_chunks}"
            )
    if (a.micro_chunks == "auto" or a.micro_chunks > 1) and a.policy in ("auto", "search"):
        raise ValueError(
            f"--micro-chunks {a.micro_chunks} needs a fixed --policy, got {a.policy!r}"
        )
    for n, lo, hi, strict in (
        ("lr", 0.0, math.inf, True),
        ("min_lr_ratio", 0.0, 1.0, False),
        ("weight_decay", 0.0, math.inf, False),
        ("clip", 0.0, math.inf, False),
        ("timeout", 0.0, 1e9, True),  # beyond ~30 years timedelta overflows
    ):
        v = getattr(a, n)
        ok = math.isfinite(v) and (v > lo if strict else v >= lo) and v <= hi
        if not ok:
            where = f"> {lo:g}" if strict else f">= {lo:g}"
            where += f" and <= {hi:g}" if math.isfinite(hi) else " and finite"
            raise ValueError(f"{flag(n)} must be {where}, got {v:g}")
    cfg = moe_config_from_args(a, world)  # the configs validate their own fields
    GPTConfig(seq_len=a.seq_len, layers=a.layers, heads=a.heads, moe_every=a.moe_every)
    if a.model_dim % a.heads:
        raise ValueError(f"--model-dim {a.model_dim} must be divisible by --heads {a.heads}")
    if a.policy != "auto":
        POLICIES.get(a.policy)  # ValueError listing the known names
    ALGORITHMS.get(a.algorithm)
    for c in (a.compressor, a.compressor_backward):
        compression.build(c, cfg.compression.options)  # names and their options
    if a.ep_size is not None:
        if a.ep_size < 1:
            raise ValueError(f"--ep-size must be >= 1, got {a.ep_size}")
        if world is not None and world % a.ep_size:
            raise ValueError(f"--ep-size {a.ep_size} must divide the {world} ranks")
        if a.experts is not None and a.experts % a.ep_size:
            raise ValueError(f"--experts {a.experts} must be divisible by --ep-size {a.ep_size}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch.cuda.is_available() is False; use --device cpu")
    if a.grad_sync == "ddp" and a.grad_algorithm != "flat":
        raise ValueError(f"--grad-algorithm {a.grad_algorithm} needs --grad-sync scheduled")
    if a.bucket_mb is not None and not (math.isfinite(a.bucket_mb) and a.bucket_mb > 0):
        raise ValueError(f"--bucket-mb must be > 0 and finite, got {a.bucket_mb:g}")
    if world is not None:
        if num_experts(a, world) % (a.ep_size or world):
            raise ValueError(
                f"--experts {num_experts(a, world)} must be divisible by the {a.ep_size or world} "
                "expert-parallel ranks"
            )
        if a.ranks_per_node is not None and world % a.ranks_per_node:
            raise ValueError(f"--ranks-per-node {a.ranks_per_node} must divide the {world} ranks")
    if a.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'schemoe[plot]'")
    if a.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard")


def check_corpus(a: argparse.Namespace, tokens: int) -> None:
    """Whether a corpus of `tokens` bytes holds --seq-len windows in both splits."""
    held = tokens - int(tokens * (1 - HELD_OUT))
    train = tokens - held
    if a.seq_len + 2 > train or (a.eval_seqs and a.seq_len + 1 > held):
        split, size = ("held-out 5%", held) if a.eval_seqs else ("training split", train)
        raise ValueError(
            f"--seq-len {a.seq_len} is too long for the corpus: its {split} has {size} bytes "
            f"(corpus {tokens} bytes, --corpus-bytes {a.corpus_bytes}); use a shorter "
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


def check_paths(a: argparse.Namespace) -> None:
    """The checkpoint --resume names exists and is complete; --save, --export and --plot can
    be written (their folders are created, as the run would)."""
    if a.resume:
        checkpoint.resolve(a.resume)  # ValueError naming what is missing
    if a.save:
        if Path(a.save).exists() and not Path(a.save).is_dir():
            raise ValueError(f"--save {a.save!r} is a file; give a folder")
        _writable_dir(Path(a.save), "--save", a.save)
    if a.export:
        _writable_file(a.export, "--export")
    if a.plot:
        _writable_file(a.plot, "--plot")
    if a.log_file:
        _writable_file(a.log_file, "--log-file")
    if a.tensorboard:
        _writable_dir(Path(a.tensorboard), "--tensorboard", a.tensorboard)


def validate(a: argparse.Namespace, world: int | None) -> None:
    """Every check, before any rank starts: arguments, paths, and the corpus (sized from its
    files' lengths, not read)."""
    check_args(a, world)
    check_corpus(a, corpus_size(a.corpus, a.corpus_bytes))
    check_paths(a)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.record_explicit = True  # --resume takes what the command line does not give
    a = p.add_argument
    a("--nproc", type=int, default=4, help="local ranks to spawn (not under torchrun)")
    a("--steps", type=int, default=40, help="total steps (the LR schedule's length)")
    a("--batch", type=int, default=8, help="sequences per rank per micro-batch")
    a("--grad-accum", type=int, default=1,
      help="micro-batches per optimizer step (gradients accumulated; DDP syncs on the last)")  # fmt: skip
    a("--seq-len", type=int, default=64, help="tokens per sequence")
    a("--layers", type=int, default=4, help="transformer blocks")
    a("--heads", type=int, default=4, help="attention heads")
    a("--moe-every", type=int, default=2, help="an MoE FFN in every n-th block")
    a("--ep-size", type=int, default=None, help="expert-parallel group size (default: all ranks)")
    cuda = torch.cuda.is_available()
    a("--device", choices=("cpu", "cuda"), default="cuda" if cuda else "cpu",
      help="cuda: NCCL, model on cuda:LOCAL_RANK; cpu: gloo (default: cuda when available)")  # fmt: skip
    a("--dtype", choices=("fp32", "bf16"), default="fp32",
      help="compute dtype of forward and loss: bf16 runs them under torch.autocast; weights, "
      "gradients and optimizer state stay fp32")  # fmt: skip
    m = p.add_argument_group("MoE layer (every MoEConfig field)").add_argument
    m("--model-dim", type=int, default=128, help="model (embedding) dim M")
    m("--hidden-dim", type=int, default=256, help="expert (and dense FFN) hidden dim H")
    m("--experts", type=int, default=None, help="E (default: 2 per expert-parallel rank)")
    m("--top-k", type=int, default=2, help="experts per token k")
    m("--capacity-factor", type=float, default=1.25, help="f; 0 = dropless")
    m("--renormalize", action=argparse.BooleanOptionalAction, default=True,
      help="renormalise the top-k gate weights to sum to 1")  # fmt: skip
    m("--noise-std", type=float, default=0.0, help="router logit noise in training")
    m("--priority", choices=("position", "score"), default="position",
      help="which tokens keep a slot when an expert is full")  # fmt: skip
    m("--aux-loss-weight", type=float, default=0.01, help="load-balancing loss weight")
    m("--z-loss-weight", type=float, default=0.0, help="router z-loss weight")
    m("--bias-update-rate", type=float, default=0.0, help="> 0: aux-loss-free expert bias")
    m(
        "--activation",
        choices=("relu", "gelu", "swiglu"),
        default="gelu",
        help="expert FFN activation",
    )
    m("--expert-bias", action="store_true", help="biases in the expert FFNs")
    m("--ranks-per-node", type=int, default=None,
      help="ranks per node for hierarchical algorithms (default: the launcher's, else all)")  # fmt: skip
    # Every rank routes batch x seq_len tokens at every call (eval too: equal window shares), so
    # capacity-mode splits follow from the config: no counts exchange, no host sync.
    m("--uniform-tokens", action=argparse.BooleanOptionalAction, default=True,
      help="every rank routes the same tokens per call (default: yes, as this trainer does)")  # fmt: skip
    m("--policy", default="schemoe",
      help=f"schedule policy: {', '.join(POLICIES.names())}, or auto (the cost model chooses)")  # fmt: skip
    m("--chunks", type=int, default=2, help="r, chunks per layer call")
    m("--micro-chunks", type=micro_chunks_arg, default=1,
      help="m: the batch cut into m micro-chunks pipelined through the blocks (1: off); auto: "
           "the stack's cost model chooses m before the model is built")  # fmt: skip
    m("--budget", choices=("lossless", "fp16", "lossy"), default="lossless",
      help="auto: the compressors it may choose")  # fmt: skip
    m("--trials", type=int, default=5, help="auto: timed calls per shortlisted candidate")
    m("--shortlist", type=int, default=4, help="auto: candidates the model shortlists")
    m("--algorithm", default="naive", help=f"all-to-all algorithm: {', '.join(ALGORITHMS.names())}")
    m("--compressor", default="none",
      help=f"forward (activation) compressor: {', '.join(compression.COMPRESSORS.names())}")  # fmt: skip
    m("--compressor-backward", default="none", help="gradient compressor (same names)")
    m(
        "--compressor-option",
        action="append",
        default=[],
        metavar="NAME.KEY=VALUE",
        help="compressor option, e.g. zfp.rate=4 (repeatable)",
    )
    o = p.add_argument_group("optimisation and evaluation").add_argument
    o("--lr", type=float, default=3e-3, help="peak learning rate")
    o("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr * this (0..1)")
    o("--warmup", type=int, default=None, help="linear warm-up steps (default: steps // 10)")
    o("--weight-decay", type=float, default=0.1, help="AdamW decay of matrices")
    o("--clip", type=float, default=1.0, help="max global grad norm (0 = no clipping)")
    o("--eval-every", type=int, default=20, help="eval loss every n steps (and at the end)")
    o("--eval-seqs", type=int, default=64, help="held-out sequences per eval (0 = no eval)")
    o("--seed", type=int, default=0, help="seed of init, data order and router noise")
    o("--corpus", default=None, help="text file or folder (default: Python's stdlib sources)")
    o("--corpus-bytes", type=int, default=4_000_000, help="bytes of the corpus read")
    s = p.add_argument_group("gradient synchronisation (dense weights)").add_argument
    s(
        "--grad-sync",
        default="ddp",
        choices=SYNCS,
        help="ddp: DDP's all-reduce; scheduled: buckets posted into idle network time",
    )
    s(
        "--grad-compressor",
        default="none",
        choices=sorted(COMPRESS),
        help="bucket dtype on the wire (ddp: torch's bf16/fp16 compress hooks)",
    )
    s(
        "--grad-algorithm",
        default="flat",
        choices=GRAD_SYNCS.names(),
        help="scheduled: flat all-reduce, or hier (node reduce, leaders, node broadcast)",
    )
    s("--bucket-mb", type=float, default=None,
      help="DDP bucket size in MiB (default 25 with ddp, 1 with scheduled)")  # fmt: skip
    r = p.add_argument_group("checkpoints, output, failures").add_argument
    r("--save", default=None, metavar="DIR",
      help="checkpoint folder, written at the end (default with --resume: its folder)")  # fmt: skip
    r("--save-every", type=int, default=0, help="also save every n steps")
    r("--resume", default=None, metavar="DIR",
      help="resume a checkpoint (any rank count) with its saved arguments; flags given here "
      "override them, except the model's shape")  # fmt: skip
    r("--stop-after", type=int, default=None, help="stop at this step (resume later)")
    r("--export", default=None, metavar="PATH", help="single-file unsharded model at the end")
    r("--plot", default=None, metavar="PNG", help="loss curve image (rank 0)")
    r("--log-every", type=int, default=5, help="a step line every n steps")
    r("--log-file", default=None, metavar="JSONL",
      help="per-step metrics, one JSON object a line (rank 0): loss, lr, grad norm, tokens/s, "
      "step parts, per MoE layer the expert load and dropped fraction")  # fmt: skip
    r("--tensorboard", default=None, metavar="DIR",
      help="the same metrics as TensorBoard scalars (needs the tensorboard package)")  # fmt: skip
    r(
        "--check-finite",
        action="store_true",
        help="name the module/step of the first NaN/Inf (a non-finite loss always stops the run)",
    )
    r("--threads", type=int, default=1, help="torch threads per rank")
    r("--timeout", type=float, default=600.0, help="collective timeout in seconds")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The `schemoe train` arguments (defaults for anything not in argv)."""
    p = Parser(prog="schemoe train")
    add_arguments(p)
    return p.parse_args(argv)
