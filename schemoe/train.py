"""`schemoe train`: expert-parallel training of a small GPT with MoE layers, end to end.

    schemoe train --nproc 4 --steps 30          # spawns 4 local CPU ranks (gloo)
    torchrun --nproc-per-node 4 -m schemoe train --steps 30   # or under any launcher
    schemoe train --save ckpt --save-every 20 --resume ckpt --plot loss.png --export model.pt

The corpus needs no download: by default the text of Python's own standard-library sources,
byte-level tokens (vocabulary 256); `--corpus PATH` takes a text file or a folder of them; the last
5% is held out for the eval loss. Dense weights are data-parallel (DDP averages their gradients);
experts are expert-parallel over groups of --ep-size ranks (default: all) and data-parallel across
those groups (`schemoe.parallel.init_expert_parallel`); `average_expert_gradients` makes their
gradients the mean-loss gradients DDP gives the dense weights, whatever ep x dp. AdamW, linear warm-up then cosine decay, clipping by the global norm
(dense norm, identical on all ranks, plus the all-reduced expert norm). Rank 0 prints step lines
(and a progress bar on a terminal) and a last line of JSON. Timing is host wall time.

Devices: `--device cuda` (the default when CUDA is available) places the model and data on
cuda:LOCAL_RANK and uses NCCL; `--device cpu` uses gloo. `--dtype bf16` runs forward and loss
under torch.autocast (weights and optimizer state stay fp32).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import checkpoint, failures
from ._dist import init_process_group, spawn
from .autotune import AutoTuner
from .config import (
    CollectiveConfig,
    CompressionConfig,
    ExpertConfig,
    GateConfig,
    MoEConfig,
    ParallelConfig,
    ScheduleConfig,
)
from .devices import local_device
from .layer import MoELayer
from .lm import GPT, GPTConfig, batch, eval_windows, evaluate, load_corpus
from .parallel import (
    average_expert_gradients,
    clip_grad_norm_,
    ddp_ignore_experts,
    init_expert_parallel,
)
from .topology import launcher_local_rank

__all__ = ["load_corpus", "lr_at", "moe_config_from_args", "parse_args", "register", "train"]


def _options(items: list[str]) -> dict[str, dict]:
    """["zfp.rate=4", ...] -> {"zfp": {"rate": 4}}; values are JSON, else strings."""
    out: dict[str, dict] = {}
    for it in items:
        name, _, rest = it.partition(".")
        key, eq, val = rest.partition("=")
        if not (name and key and eq):
            raise ValueError(f"--compress-option must look like NAME.KEY=VALUE, got {it!r}")
        try:
            val = json.loads(val)
        except json.JSONDecodeError:
            pass  # a plain string
        out.setdefault(name, {})[key] = val
    return out


def moe_config_from_args(a: argparse.Namespace) -> MoEConfig:
    """Every MoEConfig field, from the command line."""
    return MoEConfig(
        gate=GateConfig(
            num_experts=a.experts,
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
            model_dim=a.dim, hidden_dim=a.hidden, activation=a.activation, bias=a.expert_bias
        ),
        parallel=ParallelConfig(ranks_per_node=a.ranks_per_node),
        schedule=ScheduleConfig(
            policy=a.policy,
            chunks=a.chunks,
            accuracy_budget=a.budget,
            trials=a.trials,
            shortlist=a.shortlist,
        ),
        collective=CollectiveConfig(algorithm=a.algorithm),
        compression=CompressionConfig(
            forward=a.compress, backward=a.compress_backward, options=_options(a.compress_option)
        ),
    )


def lr_at(step: int, a: argparse.Namespace) -> float:
    """Learning rate of optimizer step `step` (1-based): lr * step / W for step <= W, then cosine
    from lr down to lr * min_lr_ratio at step --steps. Depends on the step only (resumable)."""
    w = a.warmup if a.warmup is not None else max(1, a.steps // 10)
    if step <= w:
        return a.lr * step / w
    t = min(1.0, (step - w) / max(1, a.steps - w))
    lo = a.lr * a.min_lr_ratio
    return lo + (a.lr - lo) * 0.5 * (1.0 + math.cos(math.pi * t))


def _optimizer(model: nn.Module, a: argparse.Namespace) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.95),
    )


class _Progress:
    """A one-line text bar, redrawn with '\\r', only when stdout is a terminal."""

    def __init__(self, total: int, on: bool) -> None:
        self.total, self.on, self.t0, self.shown = total, on and sys.stdout.isatty(), None, 0

    def print(self, text: str) -> None:
        if self.on and self.shown:
            sys.stdout.write("\r" + " " * self.shown + "\r")
            self.shown = 0
        print(text, flush=True)

    def update(self, step: int, first: int, loss: float) -> None:
        if not self.on:
            return
        self.t0 = self.t0 or time.perf_counter()
        done = step - first + 1
        eta = (time.perf_counter() - self.t0) / max(1, done - 1) * (self.total - step)
        bar = "#" * (30 * step // self.total)
        text = f"[{bar:<30}] {step}/{self.total}  loss {loss:.4f}  eta {eta:.0f}s"
        sys.stdout.write("\r" + text.ljust(self.shown))
        sys.stdout.flush()
        self.shown = len(text)

    def close(self) -> None:
        if self.on and self.shown:
            print(flush=True)


def _plot(losses: list[float], evals: list[list[float]], path: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    ax.plot(range(1, len(losses) + 1), losses, label="train")
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", label="eval (held out)")
    ax.set(xlabel="step", ylabel="cross-entropy (nats / byte)", title="schemoe train")
    ax.legend()
    fig.savefig(path, dpi=100)


def _check(a: argparse.Namespace) -> None:
    for n, lo in (
        ("steps", 1),
        ("batch", 1),
        ("seq_len", 1),
        ("save_every", 0),
        ("clip", 0),
        ("eval_every", 0),
        ("eval_seqs", 0),
        ("warmup", 0),
        ("stop_after", 0),
    ):
        if (v := getattr(a, n)) is not None and v < lo:
            raise ValueError(f"--{n.replace('_', '-')} must be >= {lo}, got {v}")
    if a.ep_size is not None and a.ep_size < 1:
        raise ValueError(f"--ep-size must be >= 1, got {a.ep_size}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch.cuda.is_available() is False; use --device cpu")
    if a.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'schemoe[plot]'")


def train(rank: int, world: int, a: argparse.Namespace) -> dict:
    """One rank's training run (torch.distributed initialised when world > 1); returns the
    summary that rank 0 prints as JSON. Resumes from --resume, saves to --save. On an error after
    set-up it destroys the default process group (so the peers fail now) and re-raises."""
    _check(a)
    dev = local_device(a.device, launcher_local_rank(rank))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    ep = init_expert_parallel(a.ep_size or world)  # every rank: all EP and DP groups
    torch.manual_seed(a.seed)  # same dense init on every rank; experts seed per expert
    data = load_corpus(a.corpus, a.corpus_bytes)
    split = int(data.numel() * 0.95)
    train_data, eval_data = data[:split], data[split:]
    core = GPT(
        GPTConfig(seq_len=a.seq_len, layers=a.layers, heads=a.heads, moe_every=a.moe_every),
        moe_config_from_args(a),
        group=ep.ep_group,
        seed=a.seed,
    ).to(dev)
    torch.manual_seed(a.seed * 7919 + 104729 + rank)  # per-rank stream: router noise
    model = (
        core
        if world == 1
        else nn.parallel.DistributedDataParallel(  # buffers (the expert
            ddp_ignore_experts(core),
            device_ids=[dev] if dev.type == "cuda" else None,
            broadcast_buffers=False,
        )
    )  # bias) have their own all-reduce
    opt = _optimizer(core, a)
    g = torch.Generator().manual_seed(a.seed * 7919 + rank)
    moe = [m for m in core.modules() if isinstance(m, MoELayer)]
    AutoTuner(core)  # resolves layers with policy "auto" / "search" on their first calls
    windows = eval_windows(eval_data, a.eval_seqs, a.seq_len, rank, world)
    losses, evals, start = [], [], 0
    if a.resume:
        got = checkpoint.load(a.resume, core, opt)
        start = got.step
        losses, evals = list(got.meta.get("losses", []))[:start], list(got.meta.get("evals", []))
        if got.rng is not None:
            torch.set_rng_state(got.rng["torch"])
            g.set_state(got.rng["data"])
        else:  # written on another number of ranks: fresh, deterministic streams
            torch.manual_seed(a.seed * 7919 + 104729 + rank + 1_000_003 * start)
            g.manual_seed(a.seed * 7919 + rank + 1_000_003 * start)
    last = min(a.steps, a.stop_after) if a.stop_after else a.steps
    checker = failures.FiniteChecker(core) if a.check_finite else None
    bar = _Progress(last, rank == 0)
    tok = a.batch * a.seq_len * world
    parts: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    times: list[float] = []
    where = [start, "setup"]
    args = {k: v for k, v in vars(a).items() if k not in ("func", "command")}  # JSON-able

    def save(step: int) -> None:
        where[1] = "save"
        checkpoint.save(
            a.save,
            core,
            opt,
            step=step,
            rng={"torch": torch.get_rng_state(), "data": g.get_state()},
            meta={"args": args, "losses": losses, "evals": evals},
        )

    def eval_now(step: int) -> None:
        where[1] = "eval"
        evals.append([step, evaluate(core, windows, a.batch)])
        if rank == 0:
            bar.print(f"step {step:4d}  eval loss {evals[-1][1]:.4f}")

    try:
        for step in range(start + 1, last + 1):
            where[:] = [step, "forward"]
            t0 = time.perf_counter()
            for grp in opt.param_groups:
                grp["lr"] = lr_at(step, a)
            x, y = (t.to(dev, non_blocking=True) for t in batch(train_data, a.batch, a.seq_len, g))
            if checker:
                checker.step = step
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
                logits, aux = model(x)
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            if checker:
                checker.check_loss(loss)
            t1 = time.perf_counter()
            where[1] = "backward"
            opt.zero_grad(set_to_none=True)
            (loss + aux).backward()
            t2 = time.perf_counter()
            where[1] = "optimizer"
            average_expert_gradients(core, ep)  # the mean-loss gradient, as DDP's dense ones
            if checker:
                checker.check_grads()
            gnorm = clip_grad_norm_(core, a.clip, ep)
            opt.step()
            for m in moe:
                if m.expert_bias is not None:
                    m.update_expert_bias()
            stat = loss.detach().clone()
            if world > 1:
                dist.all_reduce(stat)
                stat /= world
            losses.append(stat.item())
            t3 = time.perf_counter()
            times.append(t3 - t0)
            for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                parts[k].append(v)
            if rank == 0 and (step == start + 1 or step % a.log_every == 0 or step == last):
                bar.print(
                    f"step {step:4d}  loss {losses[-1]:.4f}  lr {lr_at(step, a):.2e}  "
                    f"grad norm {gnorm:.3f}  tokens/s {tok / times[-1]:,.0f}  "
                    f"(fwd {1e3 * (t1 - t0):.0f} ms, bwd {1e3 * (t2 - t1):.0f} ms, "
                    f"opt {1e3 * (t3 - t2):.0f} ms)"
                )
            bar.update(step, start + 1, losses[-1])
            if a.eval_every and step % a.eval_every == 0 and step != last:
                eval_now(step)
            if a.save and a.save_every and step % a.save_every == 0 and step != last:
                save(step)
        bar.close()
        if a.eval_seqs and (not evals or evals[-1][0] != last):
            eval_now(last)
        if a.save and times:
            save(last)
        if a.export:
            where[1] = "export"
            checkpoint.export_model(core, a.export, step=last, meta={"args": args})
    except BaseException as e:
        failures.abort()  # the peers fail now, not at their timeout
        if failures.is_peer_failure(e) and not isinstance(e, failures.PeerFailure):
            raise failures.peer_failure(e, rank, where[0], where[1], a.timeout) from e
        raise
    finally:
        if checker:
            checker.close()
    timed = times[1:] or times  # the first step pays one-time setup
    mean = {k: sum(v[1:] or v) / max(1, len(v[1:] or v)) for k, v in parts.items()}
    result = {
        "initial_loss": losses[0] if losses else float("nan"),
        "final_loss": losses[-1] if losses else float("nan"),
        "eval_loss": evals[-1][1] if evals else None,
        "tokens_per_s": tok * len(timed) / sum(timed) if timed else 0.0,
        "steps": last,
        "world_size": world,
        "ep_size": ep.ep_size,
        "dp_size": ep.dp_size,
        "device": dev.type,
        "dtype": a.dtype,
        **{k: getattr(a, k) for k in ("policy", "chunks", "algorithm", "compress")},
        "moe_layers": [m.running.summary() for m in moe],  # what runs ("auto": what it chose)
        "step_time_s": {k: round(v, 6) for k, v in mean.items()},
        "losses": losses,
        "evals": evals,
    }
    if rank == 0:
        if a.plot:
            _plot(losses, evals, a.plot)
        print(json.dumps(result), flush=True)
    return result


def _main(a: argparse.Namespace) -> int:
    _check(a)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun / srun
        torch.set_num_threads(a.threads)
        if a.device == "cuda":
            torch.cuda.set_device(launcher_local_rank())
        init_process_group("nccl" if a.device == "cuda" else "gloo", a.timeout)
        try:
            train(dist.get_rank(), dist.get_world_size(), a)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return 0
    # Collectives are bounded by --timeout; the run itself may take as long as it needs.
    if a.device == "cuda" and a.nproc > torch.cuda.device_count():
        raise ValueError(
            f"--nproc {a.nproc} with --device cuda needs {a.nproc} GPUs, this node has "
            f"{torch.cuda.device_count()}"
        )
    backend = "nccl" if a.device == "cuda" else "gloo"
    spawn(train, a.nproc, a, timeout=a.timeout, threads=a.threads, run_timeout=float("inf"),
          backend=backend)  # fmt: skip
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--nproc", type=int, default=4, help="local ranks to spawn (default 4)")
    a("--steps", type=int, default=40, help="total steps (the LR schedule's length)")
    a("--batch", type=int, default=8, help="sequences per rank per step")
    a("--seq-len", type=int, default=64)
    a("--layers", type=int, default=4)
    a("--heads", type=int, default=4)
    a("--moe-every", type=int, default=2, help="an MoE FFN in every n-th block")
    a("--ep-size", type=int, default=None, help="expert-parallel group size (default: world)")
    cuda = torch.cuda.is_available()
    a("--device", choices=("cpu", "cuda"), default="cuda" if cuda else "cpu",
      help="cuda: NCCL, model on cuda:LOCAL_RANK; cpu: gloo (default: cuda when available)")  # fmt: skip
    a("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast")
    m = p.add_argument_group("MoE layer (every MoEConfig field)").add_argument
    m("--dim", type=int, default=128, help="model dim")
    m("--hidden", type=int, default=256, help="expert (and dense FFN) hidden dim")
    m("--experts", type=int, default=8)
    m("--top-k", type=int, default=2)
    m("--capacity-factor", type=float, default=1.25, help="0 = dropless")
    m("--renormalize", action=argparse.BooleanOptionalAction, default=True)
    m("--noise-std", type=float, default=0.0, help="router logit noise in training")
    m("--priority", default="position", help="position | score")
    m("--aux-loss-weight", type=float, default=0.01)
    m("--z-loss-weight", type=float, default=0.0)
    m("--bias-update-rate", type=float, default=0.0, help="> 0: aux-loss-free expert bias")
    m("--activation", default="gelu", help="relu | gelu | swiglu")
    m("--expert-bias", action="store_true", help="biases in the expert FFNs")
    m("--ranks-per-node", type=int, default=None)
    m("--policy", default="schemoe", help="a policy name, or auto (the cost model chooses)")
    m("--chunks", type=int, default=2)
    m("--budget", default="lossless", help="auto: lossless | fp16 | lossy compressors allowed")
    m("--trials", type=int, default=5, help="auto: timed calls per shortlisted candidate")
    m("--shortlist", type=int, default=4, help="auto: candidates the model shortlists")
    m("--algorithm", default="naive")
    m("--compress", default="none", help="forward (activation) compressor")
    m("--compress-backward", default="none", help="gradient compressor")
    m(
        "--compress-option",
        action="append",
        default=[],
        metavar="NAME.KEY=VALUE",
        help="compressor option, e.g. zfp.rate=4 (repeatable)",
    )
    o = p.add_argument_group("optimisation and evaluation").add_argument
    o("--lr", type=float, default=3e-3, help="peak learning rate")
    o("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr * this")
    o("--warmup", type=int, default=None, help="linear warm-up steps (default steps // 10)")
    o("--weight-decay", type=float, default=0.1, help="AdamW decay of matrices")
    o("--clip", type=float, default=1.0, help="max global grad norm (0 = no clipping)")
    o("--eval-every", type=int, default=20, help="eval loss every n steps (and at the end)")
    o("--eval-seqs", type=int, default=64, help="held-out sequences per eval (0 = no eval)")
    o("--seed", type=int, default=0)
    o("--corpus", default=None, help="text file or folder (default: Python stdlib)")
    o("--corpus-bytes", type=int, default=4_000_000)
    r = p.add_argument_group("checkpoints, output, failures").add_argument
    r("--save", default=None, metavar="DIR", help="checkpoint folder (written at the end)")
    r("--save-every", type=int, default=0, help="also save every n steps")
    r("--resume", default=None, metavar="DIR", help="resume from a checkpoint (any rank count)")
    r("--stop-after", type=int, default=None, help="stop at this step (resume later)")
    r("--export", default=None, metavar="PATH", help="single-file unsharded model at the end")
    r("--plot", default=None, metavar="PNG", help="loss curve image (rank 0)")
    r("--log-every", type=int, default=5)
    r("--check-finite", action="store_true", help="name the layer/step of the first NaN/Inf")
    r("--threads", type=int, default=1, help="torch threads per rank")
    r("--timeout", type=float, default=600.0, help="collective timeout, seconds")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The `schemoe train` arguments (defaults for anything not in argv)."""
    p = argparse.ArgumentParser(prog="schemoe train")
    add_arguments(p)
    return p.parse_args(argv)


def register(sub) -> None:
    p = sub.add_parser("train", help="expert-parallel training run of a small MoE GPT")
    add_arguments(p)
    p.set_defaults(func=_main)


if __name__ == "__main__":
    sys.exit(_main(parse_args()))
