"""`schemoe train`: expert-parallel training of a small GPT with MoE layers, end to end.

    schemoe train --nproc 4 --steps 30          # spawns 4 local CPU ranks (gloo)
    torchrun --nproc-per-node 4 -m schemoe train --steps 30   # or under any launcher
    schemoe train --save ckpt --save-every 20 --resume ckpt --plot loss.png --export model.pt

The corpus needs no download: by default the text of Python's own standard-library sources,
byte-level tokens (vocabulary 256); `--corpus PATH` takes a text file or a folder of them; the last
5% is held out for the eval loss. Dense weights are data-parallel (DDP averages their gradients);
experts are expert-parallel over groups of --ep-size ranks (default: all) and data-parallel across
those groups (`schemoe.layer.parallel.init_expert_parallel`); `average_expert_gradients` makes their
gradients the mean-loss gradients DDP gives the dense weights, whatever ep x dp. AdamW, linear warm-up then cosine decay, clipping by the global norm
(dense norm, identical on all ranks, plus the all-reduced expert norm). Rank 0 prints step lines
(and a progress bar on a terminal) and a last line of JSON. Timing is host wall time.

Devices: `--device cuda` (the default when CUDA is available) places the model and data on
cuda:LOCAL_RANK and uses NCCL; `--device cpu` uses gloo. `--dtype bf16` runs forward and loss
under torch.autocast (weights, gradients and optimizer state stay fp32).

`--grad-accum N` takes one optimizer step per N micro-batches of --batch sequences (each
micro-batch's loss scaled by 1/N; DDP all-reduces on the last, `no_sync` on the others), so it
trains as --batch N*b would, up to capacity (C is per call) and the aux loss (per call).
`--log-file F` writes one JSON object per step (rank 0): loss, lr, grad norm, tokens/s, the step's
parts in ms and per MoE layer rank 0's expert load and dropped fraction (no extra collective);
`--tensorboard DIR` writes the same scalars.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..checkpoint import store as checkpoint
from ..cliargs import guard
from ..costmodel.step import StepShape
from ..dist import failures
from ..dist.devices import local_device
from ..dist.launch import joined, spawn
from ..dist.topology import Topology, launcher_local_rank
from ..layer.moe import MoELayer
from ..layer.parallel import (
    average_expert_gradients,
    clip_grad_norm_,
    ddp_ignore_experts,
    init_expert_parallel,
)
from ..step.gradsync import data_parallel
from ..tuning.auto import AutoTuner
from ..tuning.micro import choose_micro_chunks
from .args import (
    add_arguments,
    check_args,
    check_corpus,
    check_paths,
    moe_config_from_args,
    num_experts,
    parse_args,
    validate,
)
from .model import GPT, GPTConfig, batch, eval_windows, evaluate, load_corpus
from .report import Metrics, Progress, finite_or_none, plot
from .resume import apply_resume, nothing_to_do

__all__ = ["load_corpus", "lr_at", "moe_config_from_args", "parse_args", "register", "train"]


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


def _auto_micro(a: argparse.Namespace, world: int, ep_group, rank: int) -> dict:
    """--micro-chunks auto: m from the stack's cost model (schemoe/automicro.py), the same on
    every rank; sets a.micro_chunks and logs the choice with each candidate's prediction."""
    topo = Topology.from_group(ep_group, a.ranks_per_node)
    shape = StepShape(
        batch=a.batch, seq_len=a.seq_len, model_dim=a.model_dim, hidden=a.hidden_dim,
        layers=a.layers, heads=a.heads, moe_every=a.moe_every, experts=num_experts(a, world),
        top_k=a.top_k, capacity_factor=a.capacity_factor or 1.0,
    )  # fmt: skip
    m, preds = choose_micro_chunks(shape, a.policy, a.algorithm, a.chunks, topo)
    a.micro_chunks = m
    if rank == 0:
        shown = ", ".join(f"m={k}: {v:.3f} ms" for k, v in preds.items())
        print(f"micro-chunks auto: m = {m} (predicted blocks' step: {shown})", flush=True)
    return {"chosen": m, "predicted_ms": {str(k): v for k, v in preds.items()}}


def train(rank: int, world: int, a: argparse.Namespace) -> dict:
    """One rank's training run (torch.distributed initialised when world > 1); returns the
    summary that rank 0 prints as JSON. Resumes from --resume, saves to --save. On an error after
    set-up it destroys the default process group (so the peers fail now) and re-raises.

    A non-finite loss (the mean over ranks, checked before backward, every step) stops the run
    with NonFiniteError on every rank, before the optimizer takes that step; --check-finite adds
    the per-module checks that name where it started."""
    check_args(a, world)
    check_paths(a)
    dev = local_device(a.device, launcher_local_rank(rank))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    ep = init_expert_parallel(a.ep_size or world)  # every rank: all EP and DP groups
    auto_micro = _auto_micro(a, world, ep.ep_group, rank) if a.micro_chunks == "auto" else None
    torch.manual_seed(a.seed)  # same dense init on every rank; experts seed per expert
    data = load_corpus(a.corpus, a.corpus_bytes)
    check_corpus(a, data.numel())
    split = int(data.numel() * 0.95)
    train_data, eval_data = data[:split], data[split:]
    core = GPT(
        GPTConfig(
            seq_len=a.seq_len,
            layers=a.layers,
            heads=a.heads,
            moe_every=a.moe_every,
            micro_chunks=a.micro_chunks,
        ),
        moe_config_from_args(a, world),
        group=ep.ep_group,
        seed=a.seed,
    ).to(dev)
    torch.manual_seed(a.seed * 7919 + 104729 + rank)  # per-rank stream: router noise
    model = core
    if world > 1:  # buffers (the expert bias) have their own all-reduce: broadcast_buffers off
        model, _ = data_parallel(
            ddp_ignore_experts(core),
            sync=a.grad_sync,
            compress=a.grad_compressor,
            algorithm=a.grad_algorithm,
            bucket_mb=a.bucket_mb if a.bucket_mb else (25.0 if a.grad_sync == "ddp" else 1.0),
            ranks_per_node=a.ranks_per_node,
            device_ids=[dev] if dev.type == "cuda" else None,
        )
    opt = _optimizer(core, a)
    g = torch.Generator().manual_seed(a.seed * 7919 + rank)
    moe = [m for m in core.modules() if isinstance(m, MoELayer)]
    metrics = Metrics(a, moe) if rank == 0 else None
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
    bar = Progress(last, rank == 0)
    tok = a.batch * a.seq_len * world * a.grad_accum  # per optimizer step
    parts: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    times: list[float] = []
    where = [start, "setup"]
    args = {k: v for k, v in vars(a).items() if k not in ("func", "command", "explicit")}
    args["experts"] = num_experts(a, world)  # resolved: a resume on other ranks keeps E

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
            opt.zero_grad(set_to_none=True)
            if checker:
                checker.step = step
            fwd = bwd = 0.0
            stat = torch.zeros((), device=dev)
            for micro in range(a.grad_accum):
                # DDP all-reduces the dense gradients on the last micro-batch only.
                last_micro = micro == a.grad_accum - 1
                sync = contextlib.nullcontext() if world == 1 or last_micro else model.no_sync()
                with sync:
                    ta = time.perf_counter()
                    where[1] = "forward"
                    xy = batch(train_data, a.batch, a.seq_len, g)
                    x, y = (t.to(dev, non_blocking=True) for t in xy)
                    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
                        logits, aux = model(x)
                        flat = logits.float().reshape(-1, logits.shape[-1])
                        loss = F.cross_entropy(flat, y.reshape(-1))
                    if checker:
                        checker.check_loss(loss)
                    stat += loss.detach() / a.grad_accum
                    tb = time.perf_counter()
                    where[1] = "backward"
                    ((loss + aux) / a.grad_accum).backward()
                    fwd, bwd = fwd + tb - ta, bwd + time.perf_counter() - tb
            if world > 1:
                dist.all_reduce(stat)
                stat /= world
            losses.append(stat.item())  # host sync: decides whether to go on
            if not math.isfinite(losses[-1]):
                raise failures.NonFiniteError(
                    f"non-finite loss {losses[-1]} (mean over ranks) at step {step}: the run "
                    f"diverged; no optimizer step was taken with it. Lower --lr ({a.lr:g}) or "
                    "--clip, resume from the last checkpoint, or rerun with --check-finite "
                    "to name the module where it starts"
                )
            t1 = t0 + fwd
            t2 = t1 + bwd
            t2_wall = time.perf_counter()
            where[1] = "optimizer"
            average_expert_gradients(core, ep)  # the mean-loss gradient, as DDP's dense ones
            if checker:
                checker.check_grads()
            gnorm = clip_grad_norm_(core, a.clip, ep)
            opt.step()
            for m in moe:
                if m.expert_bias is not None:
                    m.update_expert_bias()
            t3 = t2 + time.perf_counter() - t2_wall
            times.append(time.perf_counter() - t0)
            for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                parts[k].append(v)
            if metrics:
                metrics.write(step, losses[-1], lr_at(step, a), float(gnorm), tok / times[-1],
                              {k: round(1e3 * v[-1], 3) for k, v in parts.items()})  # fmt: skip
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
            if rank == 0:
                print(f"checkpoint: {a.save} (step {last})", flush=True)
        if a.export:
            where[1] = "export"
            checkpoint.export_model(core, a.export, step=last, meta={"args": args})
            if rank == 0:
                print(f"exported: {a.export}", flush=True)
    except BaseException as e:
        failures.abort()  # the peers fail now, not at their timeout
        if failures.is_peer_failure(e) and not isinstance(e, failures.PeerFailure):
            raise failures.peer_failure(e, rank, where[0], where[1], a.timeout) from e
        raise
    finally:
        if checker:
            checker.close()
        if metrics:
            metrics.close()
    timed = times[1:] or times  # the first step pays one-time setup
    mean = {k: sum(v[1:] or v) / max(1, len(v[1:] or v)) for k, v in parts.items()}
    result = {
        "initial_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "eval_loss": evals[-1][1] if evals else None,
        "tokens_per_s": tok * len(timed) / sum(timed) if timed else 0.0,
        "steps": last,
        "world_size": world,
        "ep_size": ep.ep_size,
        "dp_size": ep.dp_size,
        "device": dev.type,
        "dtype": a.dtype,
        "grad_accum": a.grad_accum,
        **{
            k: getattr(a, k)
            for k in ("policy", "chunks", "micro_chunks", "algorithm", "compressor")
        },
        "micro_chunks_auto": auto_micro,  # --micro-chunks auto: {"chosen", "predicted_ms"}
        "moe_layers": [m.running.summary() for m in moe],  # what runs ("auto": what it chose)
        "step_time_s": {k: round(v, 6) for k, v in mean.items()},
        "losses": losses,
        "evals": evals,
    }
    if rank == 0:
        if a.plot:
            plot(losses, evals, a.plot)
            print(f"plot: {a.plot}", flush=True)
        if a.log_file:
            print(f"metrics: {a.log_file}", flush=True)
        if a.tensorboard:
            print(f"tensorboard: {a.tensorboard}", flush=True)
        print(json.dumps(finite_or_none(result), allow_nan=False), flush=True)
    return result


def _main(a: argparse.Namespace) -> int:
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # under torchrun / srun
    apply_resume(a)  # the saved run's arguments, where this command line gives none
    # Every argument is checked before a rank starts (under torchrun: before the group forms).
    validate(a, None if torchrun else a.nproc)
    if (line := nothing_to_do(a)) is not None:
        # Exit 0: the run asked for is complete (a requeued job that resumes is done, not failed).
        if not torchrun or os.environ.get("RANK") == "0":
            print(f"schemoe train: {line}", flush=True)
        return 0
    if torchrun:
        torch.set_num_threads(a.threads)
        if a.device == "cuda":
            torch.cuda.set_device(launcher_local_rank())
        with joined("nccl" if a.device == "cuda" else "gloo", a.timeout):
            train(dist.get_rank(), dist.get_world_size(), a)
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


def register(sub) -> None:
    p = sub.add_parser("train", help="expert-parallel training run of a small MoE GPT")
    add_arguments(p)
    p.set_defaults(func=guard("schemoe train", _main))


if __name__ == "__main__":
    sys.exit(_main(parse_args()))
