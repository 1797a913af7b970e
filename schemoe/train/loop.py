"""`schemoe train`: expert-parallel training of a small GPT with MoE layers, end to end.

    schemoe train --nproc 4 --steps 30          # spawns 4 local CPU ranks (gloo)
    torchrun --nproc-per-node 4 -m schemoe train --steps 30   # or under any launcher
    schemoe train --save ckpt --save-every 20 --resume ckpt --plot loss.png --export model.pt

The corpus needs no download: by default the text of Python's own standard-library sources,
byte-level tokens (vocabulary 256); `--corpus PATH` takes a text file or a folder of them; the last
5% is held out for the eval loss. Dense weights are data-parallel (DDP averages their gradients);
experts are expert-parallel over groups of --ep-size ranks (default: all) and data-parallel across
those groups (`schemoe.layer.parallel.init_expert_parallel`); `average_expert_gradients` makes
their gradients the mean-loss gradients DDP gives the dense weights, whatever ep x dp. AdamW,
linear warm-up then cosine decay, clipping by the global norm (dense norm, identical on all
ranks, plus the all-reduced expert norm). Rank 0 prints step lines
(and a progress bar on a terminal) and a last line of JSON. Timing is host wall time.

Devices: `--device cuda` (the default when CUDA is available) places the model and data on
cuda:LOCAL_RANK and uses NCCL; `--device cpu` uses gloo. `--dtype bf16` runs forward and loss
under torch.autocast (weights, gradients and optimizer state stay fp32).

The run is a frozen TrainConfig (config.py), checked before any rank starts; each step is
`train_step` (step.py), the same function `schemoe bench step` times. `train` is set-up, resume,
the loop, evals and saves, and the summary, one function each.

`--grad-accum N` takes one optimizer step per N micro-batches of --batch sequences (each
micro-batch's loss scaled by 1/N; DDP all-reduces on the last, `no_sync` on the others), so it
trains as --batch N*b would, up to capacity (C is per call) and the aux loss (per call).
`--log-file F` writes one JSON object per step (rank 0): loss, lr, grad norm, tokens/s, the step's
parts in ms and per MoE layer rank 0's tokens per expert, load fractions, dropped fraction and
overload factor (max / mean load; no extra collective); `--tensorboard DIR` writes the same
scalars. Step lines end with a load summary over the MoE layers ("overload 1.42 drop 0.8%").
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from ..checkpoint import store as checkpoint
from ..checkpoint.files import agree, set_aside
from ..config import MoEConfig
from ..dist import failures
from ..dist.lifeline import Stopped, stop_deferred
from .args import parse_args
from .config import TrainConfig
from .model import evaluate, load_corpus
from .report import finite_or_none, plot, replan_line
from .setup import PARTS, Run, replanner, restore, setup
from .step import StepRecord, train_step

# Skipped steps (non-finite loss or gradient norm) in a row that stop the run: one can be a
# spike the next batch does not repeat; three from the same weights are a divergence.
MAX_SKIPPED = 3

__all__ = [
    "MAX_SKIPPED",
    "TrainConfig",
    "load_corpus",
    "lr_at",
    "moe_config_from_args",
    "parse_args",
    "settle_buckets",
    "train",
    "train_step",
]


def as_config(a: TrainConfig | argparse.Namespace) -> TrainConfig:
    """`a`, or the TrainConfig of parsed arguments (`parse_args`)."""
    return a if isinstance(a, TrainConfig) else TrainConfig.from_args(a)


def moe_config_from_args(
    a: TrainConfig | argparse.Namespace, world: int | None = None
) -> MoEConfig:
    """Every MoEConfig field of a run's settings (`world`: the rank count, for the default E)."""
    return as_config(a).moe_config(world)


def lr_at(step: int, a: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (1-based): lr * step / W for step <= W, then cosine
    from lr down to lr * min_lr_ratio at step --steps. Depends on the step only (resumable)."""
    w = a.warmup if a.warmup is not None else max(1, a.steps // 10)
    if step <= w:
        return a.lr * step / w
    t = min(1.0, (step - w) / max(1, a.steps - w))
    lo = a.lr * a.min_lr_ratio
    return lo + (a.lr - lo) * 0.5 * (1.0 + math.cos(math.pi * t))


def train(rank: int, world: int, cfg: TrainConfig | argparse.Namespace) -> dict:
    """One rank's training run (torch.distributed initialised when world > 1); returns the
    summary that rank 0 prints as JSON. `cfg`: a TrainConfig, or parsed arguments (converted
    by TrainConfig.from_args). Resumes from --resume, saves to --save. On an error after set-up
    it destroys the default process group (so the peers fail now) and re-raises.

    A step whose loss or gradient norm is not finite is skipped on every rank (no weight or
    optimizer state changes, `train_step`); MAX_SKIPPED of them in a row stop the run with
    NonFiniteError on every rank, naming the step and the last good checkpoint (`_diverged`).
    --check-finite adds the per-module checks that name where it started. A final eval that is
    not finite is a NonFiniteError too, and that model is not saved."""
    cfg = as_config(cfg)
    cfg.validate(world)
    run = setup(rank, world, cfg)
    restore(run)
    settle_buckets(run)
    run.replanner = replanner(run)
    checker = failures.FiniteChecker(run.core) if cfg.check_finite else None
    try:
        _loop(run, checker)
        _finish(run)
    except BaseException as e:
        failures.abort()  # the peers fail now, not at their timeout
        if isinstance(e, Stopped):
            e.step = run.where[0]  # the launcher's "interrupted by SIGINT at step N"
        if failures.is_peer_failure(e) and not isinstance(e, failures.PeerFailure):
            raise failures.peer_failure(e, rank, run.where[0], run.where[1], cfg.timeout) from e
        raise
    finally:
        if checker:
            checker.close()
        if run.metrics:
            run.metrics.close()
    result = _summary(run)
    if rank == 0:
        _report(run.cfg, result)
    return result


def settle_buckets(run: Run) -> None:
    """One forward and backward of a zero loss on a batch of zeros before the first step, so DDP
    fixes its gradient buckets now, not after the first real step.

    DDP flattens the dense gradients into buckets laid out in parameter order for the first
    backward of a wrapper, and re-lays them out once in the order gradients became ready. On
    4+ ranks gloo's ring all-reduce adds an element's contributions in an order set by its
    offset in the bucket (a permutation changes the sum's last bit in ~25% of elements, measured
    here on 4 ranks), so the first step of every process summed in another order than the steps
    after it: a run resumed at step 5 took step 5 in the first layout, the uninterrupted run in
    the second. Settled here, every step of every process uses the second one. Nothing of the
    run changes: no weight, optimizer state, RNG stream, data position or routing count."""
    if not isinstance(run.model, torch.nn.parallel.DistributedDataParallel):
        return
    cpu = torch.get_rng_state()
    gpu = torch.cuda.get_rng_state(run.dev) if run.dev.type == "cuda" else None
    x = torch.zeros(run.cfg.batch, run.cfg.seq_len, dtype=torch.long, device=run.dev)
    bf16 = run.cfg.dtype == "bf16"
    with torch.autocast(run.dev.type, dtype=torch.bfloat16, enabled=bf16):
        logits, aux = run.model(x)
        zero = (logits.float().sum() + aux) * 0.0
    zero.backward()
    run.opt.zero_grad(set_to_none=True)
    for m in run.moe:
        if m.expert_load is not None:
            m.expert_load.zero_()
        m.take_load_metrics()
    torch.set_rng_state(cpu)
    if gpu is not None:
        torch.cuda.set_rng_state(gpu, run.dev)


def _loop(run: Run, checker: failures.FiniteChecker | None) -> None:
    """The steps after the resumed one up to --stop-after / --steps: the LR, `train_step`, the
    step line and metrics, and the periodic evals and saves. With --save-every, a fresh run
    saves its initial state (step 0) first: the one state known to train on when the first
    steps already diverge. A skipped step is not saved (its state is the one before it, and
    may be where a divergence starts)."""
    cfg = run.cfg
    if cfg.save and cfg.save_every and not cfg.resume:
        _save(run, 0)
    in_a_row = 0
    for step in range(run.start + 1, run.last + 1):
        run.where[:] = [step, "forward"]
        t0 = time.perf_counter()
        for grp in run.opt.param_groups:
            grp["lr"] = lr_at(step, cfg)
        if checker:
            checker.step = step
        rec = train_step(
            run.model, run.core, run.opt, run.next_batch, run.ep, clip=cfg.clip,
            grad_accum=cfg.grad_accum, checker=checker,
            autocast_dtype=torch.bfloat16 if cfg.dtype == "bf16" else None,
            on_phase=lambda p: run.where.__setitem__(1, p),
        )  # fmt: skip
        run.losses.append(rec.loss)
        run.times.append(time.perf_counter() - t0)
        for k, v in zip(PARTS, (rec.forward_s, rec.backward_s, rec.optimizer_s)):
            run.parts[k].append(v)
        _log(run, step, rec)
        for switch in run.replanner.step(step) if run.replanner else ():  # --replan
            if run.metrics:
                run.metrics.replan(step, switch)
            if run.rank == 0 and switch.step == step + 1:  # a new switch, not a measurement
                run.bar.print(replan_line(switch))
        in_a_row = in_a_row + 1 if rec.skipped else 0
        if in_a_row == MAX_SKIPPED:
            _diverged(run, step, in_a_row)
        if cfg.eval_every and step % cfg.eval_every == 0 and step != run.last:
            _eval(run, step)
        saving = cfg.save and cfg.save_every and step % cfg.save_every == 0 and step != run.last
        if saving and not rec.skipped:
            _save(run, step)
    run.bar.close()


def _diverged(run: Run, step: int, n: int) -> None:
    """Stop after `n` skipped steps in a row, the last `step`: every checkpoint of the state they
    started from or later is set aside (rank 0 renames it diverged-step-N, `latest` goes back
    to the newest one before), then every rank raises the same NonFiniteError naming it."""
    cfg, first = run.cfg, step - n + 1
    root = Path(cfg.save) if cfg.save else None
    if run.rank == 0 and root is not None and root.is_dir():
        set_aside(root, first - 1)  # the state of step first-1 gave the first skipped step
    agree(True)  # rank 0's renames are done before any rank names `latest`
    if root is not None and (root / "latest").is_file():
        name = (root / "latest").read_text().strip()
        good = f"last good checkpoint: {root / name}, which {root / 'latest'} names"
        if any(root.glob("diverged-step-*")):
            good += f" (those from step {first - 1} on are set aside as diverged-step-*)"
        good += ": resume it"
    else:
        good = "no checkpoint before them: rerun from the start"
    raise failures.NonFiniteError(
        f"the run diverged: steps {first}-{step} had a non-finite loss or gradient norm and were "
        f"skipped ({n} in a row, the most allowed; no weight changed in them); {good} with a "
        f"lower --lr (now {cfg.lr:g}) or --clip (now {cfg.clip:g}), or other loss weights (now "
        f"--aux-loss-weight {cfg.aux_loss_weight:g}, --z-loss-weight {cfg.z_loss_weight:g}); "
        "--check-finite names the module where it starts"
    )


def _log(run: Run, step: int, rec: StepRecord) -> None:
    """Rank 0: the metrics row, the step line (first, every --log-every, last, and every skipped
    step), the bar."""
    cfg, tps = run.cfg, run.tokens / run.times[-1]
    line = run.rank == 0 and (
        step == run.start + 1 or step % cfg.log_every == 0 or step == run.last
    )
    load = ""
    if run.metrics:
        ms = {k: round(1e3 * run.parts[k][-1], 3) for k in PARTS}
        load = run.metrics.write(
            step, rec.loss, lr_at(step, cfg), float(rec.grad_norm), tps, ms,
            line=line or rec.skipped, skipped=rec.skipped,
        )  # fmt: skip
    if line or (run.rank == 0 and rec.skipped):
        skipped = "  SKIPPED (non-finite: no weight changed)" if rec.skipped else ""
        run.bar.print(
            f"step {step:4d}  loss {rec.loss:.4f}  lr {lr_at(step, cfg):.2e}  "
            f"grad norm {rec.grad_norm:.3f}  tokens/s {tps:,.0f}  "
            f"(fwd {1e3 * rec.forward_s:.0f} ms, bwd {1e3 * rec.backward_s:.0f} ms, "
            f"opt {1e3 * rec.optimizer_s:.0f} ms){skipped}" + (f"  {load}" if load else "")
        )
    run.bar.update(step, run.start + 1, rec.loss)


def _eval(run: Run, step: int) -> float:
    run.where[1] = "eval"
    run.evals.append([step, evaluate(run.core, run.windows, run.cfg.batch)])
    if run.rank == 0:
        run.bar.print(f"step {step:4d}  eval loss {run.evals[-1][1]:.4f}")
    return run.evals[-1][1]


@stop_deferred()  # SIGINT/SIGTERM to the launcher: a save in progress completes first
def _save(run: Run, step: int) -> None:
    run.where[1] = "save"
    checkpoint.save(
        run.cfg.save,
        run.core,
        run.opt,
        step=step,
        rng={"torch": torch.get_rng_state(), "data": run.g.get_state()},
        meta={"args": run.cfg.settings(), "losses": run.losses, "evals": run.evals},
    )


def _finish(run: Run) -> None:
    """After the last step: the final eval (unless the last step had one), save, export."""
    cfg, last = run.cfg, run.last
    if cfg.eval_seqs and (not run.evals or run.evals[-1][0] != last):
        _eval(run, last)
    if cfg.eval_seqs and not math.isfinite(run.evals[-1][1]):  # the same value on every rank
        raise failures.NonFiniteError(
            f"the final eval loss (step {last}) is {run.evals[-1][1]}: the model is broken, so it "
            f"is not saved; {_last_good(cfg)}"
        )
    if cfg.save and run.times:
        _save(run, last)
        if run.rank == 0:
            print(f"checkpoint: {cfg.save} (step {last})", flush=True)
    if cfg.export:
        run.where[1] = "export"
        checkpoint.export_model(run.core, cfg.export, step=last, meta={"args": cfg.settings()})
        if run.rank == 0:
            print(f"exported: {cfg.export}", flush=True)


def _last_good(cfg: TrainConfig) -> str:
    root = Path(cfg.save) if cfg.save else None
    if root is not None and (root / "latest").is_file():
        return f"last good checkpoint: {root / (root / 'latest').read_text().strip()}"
    return "no checkpoint was saved"


def _summary(run: Run) -> dict:
    """The run's summary (rank 0 prints it as the last line): losses, evals, throughput and the
    mean step parts (the first step, which pays one-time set-up, left out), what ran."""
    cfg, losses, evals = run.cfg, run.losses, run.evals
    timed = run.times[1:] or run.times
    mean = {k: sum(v[1:] or v) / max(1, len(v[1:] or v)) for k, v in run.parts.items()}
    return {
        "initial_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "eval_loss": evals[-1][1] if evals else None,
        "tokens_per_s": run.tokens * len(timed) / sum(timed) if timed else 0.0,
        "steps": run.last,
        "world_size": run.world,
        "ep_size": run.ep.ep_size,
        "dp_size": run.ep.dp_size,
        "device": run.dev.type,
        "dtype": cfg.dtype,
        "grad_accum": cfg.grad_accum,
        **{
            k: getattr(cfg, k)
            for k in ("policy", "chunks", "micro_chunks", "grad_sync", "algorithm", "compressor")
        },
        "micro_chunks_auto": run.auto_micro,  # --micro-chunks auto: {"chosen", "predicted_ms"}
        "auto_step": run.auto_step,  # --auto-step: {"chosen", "plan", "reason", "predicted_ms"}
        "moe_layers": [m.running.summary() for m in run.moe],  # what runs ("auto": its choice)
        "replans": [s.as_dict() for s in run.replanner.history] if run.replanner else None,
        "step_time_s": {k: round(v, 6) for k, v in mean.items()},
        "losses": losses,
        "evals": evals,
    }


def _report(cfg: TrainConfig, result: dict) -> None:
    """Rank 0's last lines: the files written, then the summary as one JSON line."""
    if cfg.plot:
        plot(result["losses"], result["evals"], cfg.plot)
        print(f"plot: {cfg.plot}", flush=True)
    if cfg.log_file:
        print(f"metrics: {cfg.log_file}", flush=True)
    if cfg.tensorboard:
        print(f"tensorboard: {cfg.tensorboard}", flush=True)
    print(json.dumps(finite_or_none(result), allow_nan=False), flush=True)
