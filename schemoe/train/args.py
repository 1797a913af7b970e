"""The `schemoe train` command line: its flags, one per TrainConfig setting, with the
TrainConfig's defaults. `TrainConfig.from_args(parse_args(argv))` checks them (see config.py)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any

from .. import compression
from ..cliargs import Parser, float_list
from ..collectives import ALGORITHMS
from ..config import EXPERT_IMPLS
from ..scheduling import POLICIES
from ..step.gradsync import COMPRESS, GRAD_SYNCS, SYNCS
from .config import DEVICES, DTYPES, TrainConfig

__all__ = ["add_arguments", "micro_chunks_arg", "parse_args"]

# The flags' defaults: TrainConfig's (its device default: cuda when available).
D = {
    f.name: f.default if f.default is not MISSING else f.default_factory()
    for f in fields(TrainConfig)
}


def micro_chunks_arg(text: str) -> int | str:
    """--micro-chunks as typed: an int, or the text (TrainConfig accepts "auto" only)."""
    return int(text) if text.lstrip("-").isdigit() else text


def _defaulted(add: Callable[..., Any]) -> Callable[..., Any]:
    """`add` (an add_argument) giving each flag its setting's TrainConfig default."""

    def flag(name: str, **kw: Any) -> Any:
        kw.setdefault("default", D[name.lstrip("-").replace("-", "_")])
        return add(name, **kw)

    return flag


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig setting (its field name, dashed), in --help's groups. Long
    because it is a flat list of declarations, one or two lines each."""
    p.record_explicit = True  # --resume takes what the command line does not give
    a = _defaulted(p.add_argument)
    a("--nproc", type=int, help="local ranks to spawn (not under torchrun)")
    a("--steps", type=int, help="total steps (the LR schedule's length)")
    a("--batch", type=int, help="sequences per rank per micro-batch")
    a("--grad-accum", type=int,
      help="micro-batches per optimizer step (gradients accumulated; DDP syncs on the last)")  # fmt: skip
    a("--seq-len", type=int, help="tokens per sequence")
    a("--layers", type=int, help="transformer blocks")
    a("--heads", type=int, help="attention heads")
    a("--moe-every", type=int, help="an MoE FFN in every n-th block")
    a("--activation-checkpointing", action="store_true",
      help="recompute each block's activations in backward (schemoe.checkpoint_block: the MoE "
      "layers' all-to-alls are kept, not repeated): less memory, more compute")  # fmt: skip
    a("--ep-size", type=int, help="expert-parallel group size (default: all ranks)")
    a("--device", choices=DEVICES,
      help="cuda: NCCL, model on cuda:LOCAL_RANK; cpu: gloo (default: cuda when available)")  # fmt: skip
    a("--dtype", choices=DTYPES,
      help="compute dtype of forward and loss: bf16 runs them under torch.autocast; weights, "
      "gradients and optimizer state stay fp32")  # fmt: skip
    m = _defaulted(p.add_argument_group("MoE layer (every MoEConfig field)").add_argument)
    m("--model-dim", type=int, help="model (embedding) dim M")
    m("--hidden-dim", type=int, help="expert (and dense FFN) hidden dim H")
    m("--experts", type=int, help="E (default: 2 per expert-parallel rank)")
    m("--top-k", type=int, help="experts per token k")
    m("--capacity-factor", type=float, help="f; 0 = dropless")
    m("--renormalize", action=argparse.BooleanOptionalAction,
      help="renormalise the top-k gate weights to sum to 1")  # fmt: skip
    m("--noise-std", type=float, help="router logit noise in training")
    m("--priority", choices=("position", "score"),
      help="which tokens keep a slot when an expert is full")  # fmt: skip
    m("--aux-loss-weight", type=float, help="load-balancing loss weight")
    m("--z-loss-weight", type=float, help="router z-loss weight")
    m("--bias-update-rate", type=float, help="> 0: aux-loss-free expert bias")
    m("--score", choices=("softmax", "sigmoid"),
      help="router scores: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)")  # fmt: skip
    m("--expert-groups", type=int,
      help="G groups of E / G experts for group-limited routing (1: none)")  # fmt: skip
    m("--top-groups", type=int, help="groups each token keeps before its top-k (default: all)")
    m("--routed-scale", type=float,
      help="factor on the combine weights (DeepSeek-V3 routed_scaling_factor)")  # fmt: skip
    m("--group-score", choices=("top2", "max"),
      help="a group's score: its best two experts' sum (DeepSeek-V3) or its best (V2)")  # fmt: skip
    m("--router-bias", action="store_true", help="a learned bias on the router logits (GPT-OSS)")
    m("--weights-on", choices=("output", "input"),
      help="where the gate weights apply: expert outputs, or inputs (Llama 4)")  # fmt: skip
    m("--activation", choices=("relu", "gelu", "swiglu"), help="expert FFN activation")
    m("--expert-bias", action="store_true", help="biases in the expert FFNs")
    m("--experts-impl", choices=EXPERT_IMPLS, help="grouped: one grouped GEMM per projection; loop")
    m("--shared-experts", type=int,
      help="always-on experts of hidden dim H per MoE layer, a task scheduled under the "
      "dispatch all-to-alls (0: none)")  # fmt: skip
    m("--ranks-per-node", type=int,
      help="ranks per node for hierarchical algorithms (default: the launcher's, else all)")  # fmt: skip
    # Every rank routes batch x seq_len tokens at every call (eval too: equal window shares), so
    # capacity-mode splits follow from the config: no counts exchange, no host sync.
    m("--uniform-tokens", action=argparse.BooleanOptionalAction,
      help="every rank routes the same tokens per call (default: yes, as this trainer does)")  # fmt: skip
    m("--dedup", action=argparse.BooleanOptionalAction,
      help="dropless: every all-to-all carries a token once per rank it reaches, not once per "
      "expert (ParallelConfig.dedup)")  # fmt: skip
    m("--policy",
      help=f"schedule policy: {', '.join(POLICIES.names())}, or auto (the cost model chooses)")  # fmt: skip
    m("--chunks", type=int, help="r, chunks per layer call")
    m("--micro-chunks", type=micro_chunks_arg,
      help="m: the batch cut into m micro-chunks pipelined through the blocks (1: off); auto: "
           "the stack's cost model chooses m before the model is built")  # fmt: skip
    m("--auto-step", action="store_true",
      help="one plan for the whole step, chosen by the step's cost model before the model is "
      "built: --policy, --chunks, --micro-chunks and --grad-sync (--grad-compressor stays); the "
      "choice and its reason are printed")  # fmt: skip
    m("--budget", choices=("lossless", "fp16", "lossy"),
      help="auto and --replan: the compressors they may choose")  # fmt: skip
    m("--trials", type=int,
      help="auto: timed calls per shortlisted candidate; 0: no timing, the cost model's first "
      "choice runs (--shortlist is then unused)")  # fmt: skip
    m("--shortlist", type=int,
      help="auto: candidates the model shortlists for timing (>= 1; see --trials 0)")  # fmt: skip
    m("--replan", action="store_true",
      help="re-plan each MoE layer from its live routing (schemoe.tuning.replan): every "
      "--replan-every steps the cost model prices the busiest rank's volume and a plan (policy, "
      "r, algorithm, compressor within --budget) predicted >= 5%% faster twice in a row is "
      "switched to; each switch is a console line and a --log-file row")  # fmt: skip
    m("--replan-every", type=int, help="--replan: steps between decision points")
    m("--replan-capacity-factors", type=float_list, metavar="F,F,...",
      help="--replan in capacity mode: the capacity factors a layer may switch between, each "
      "decision the smallest whose estimated drop is <= --replan-max-drop (f changes results)")  # fmt: skip
    m("--replan-max-drop", type=float, help="--replan-capacity-factors: the drop budget")
    m("--algorithm", help=f"all-to-all algorithm: {', '.join(ALGORITHMS.names())}")
    m("--compressor",
      help=f"forward (activation) compressor: {', '.join(compression.COMPRESSORS.names())}")  # fmt: skip
    m("--compressor-backward", help="gradient compressor (same names)")
    m(
        "--compressor-option",
        action="append",
        default=[],
        metavar="NAME.KEY=VALUE",
        help="compressor option, e.g. zfp.rate=4 (repeatable)",
    )
    o = _defaulted(p.add_argument_group("optimisation and evaluation").add_argument)
    o("--lr", type=float, help="peak learning rate")
    o("--min-lr-ratio", type=float, help="cosine decays to lr * this (0..1)")
    o("--warmup", type=int, help="linear warm-up steps (default: steps // 10)")
    o("--weight-decay", type=float, help="AdamW decay of matrices")
    o("--clip", type=float, help="max global grad norm (0 = no clipping)")
    o("--eval-every", type=int, help="eval loss every n steps (and at the end)")
    o("--eval-seqs", type=int, help="held-out sequences per eval (0 = no eval)")
    o("--seed", type=int, help="seed of init, data order and router noise")
    o(
        "--corpus",
        help="text file or folder (default: the Python stdlib's own sources, not site-packages)",
    )
    o("--corpus-bytes", type=int, help="bytes of the corpus read")
    s = _defaulted(p.add_argument_group("gradient synchronisation (dense weights)").add_argument)
    s(
        "--grad-sync",
        choices=SYNCS,
        help="ddp: DDP's all-reduce; scheduled: buckets posted into idle network time",
    )
    s(
        "--grad-compressor",
        choices=sorted(COMPRESS),
        help="bucket dtype on the wire (ddp: torch's bf16/fp16 compress hooks)",
    )
    s(
        "--grad-algorithm",
        choices=GRAD_SYNCS.names(),
        help="scheduled: flat all-reduce, or hier (node reduce, leaders, node broadcast)",
    )
    s("--bucket-mb", type=float,
      help="DDP bucket size in MiB (default 25 with ddp, 1 with scheduled)")  # fmt: skip
    s("--fsdp", action="store_true",
      help="shard dense weights with FSDP2 (fully_shard) over all ranks instead of DDP; experts "
      "stay expert-parallel")  # fmt: skip
    r = _defaulted(p.add_argument_group("checkpoints, output, failures").add_argument)
    r("--save", metavar="DIR",
      help="checkpoint folder, written at the end (default with --resume: its folder)")  # fmt: skip
    r("--save-every", type=int, help="also save every n steps")
    r("--resume", metavar="DIR",
      help="resume a checkpoint (any rank count) with its saved arguments; flags given here "
      "override them, except the model's shape")  # fmt: skip
    r("--allow-unverified-checkpoint", action="store_true",
      help="--resume a checkpoint written before digests (its files cannot be checked; its "
      "tensors and the final eval must then be finite)")  # fmt: skip
    r("--stop-after", type=int, help="stop at this step (resume later)")
    r("--export", metavar="PATH", help="single-file unsharded model at the end")
    r("--plot", metavar="PNG", help="loss curve image (rank 0)")
    r("--log-every", type=int, help="a step line every n steps")
    r("--log-file", metavar="JSONL",
      help="per-step metrics, one JSON object a line (rank 0): loss, lr, grad norm, tokens/s, "
      "step parts, per MoE layer the expert load and dropped fraction")  # fmt: skip
    r("--tensorboard", metavar="DIR",
      help="the same metrics as TensorBoard scalars (needs the tensorboard package)")  # fmt: skip
    r(
        "--check-finite",
        action="store_true",
        help="name the module/step of the first NaN/Inf (a non-finite loss always stops the run)",
    )
    r("--threads", type=int, help="torch threads per rank")
    r("--timeout", type=float, help="collective timeout in seconds")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The `schemoe train` arguments (defaults for anything not in argv)."""
    p = Parser(prog="schemoe train")
    add_arguments(p)
    return p.parse_args(argv)
