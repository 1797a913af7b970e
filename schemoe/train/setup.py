"""The set-up of one rank's `schemoe train` run: device, expert-parallel groups, --micro-chunks
auto, the corpus, the model and its data-parallel wrapper (DDP, or with --fsdp FSDP2's
`fully_shard` of the dense weights, one unit per block), the optimizer (built after the wrapper:
FSDP replaces the dense parameters), and --resume's state.
The Run it returns is what the loop (loop.py) advances."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..checkpoint import store as checkpoint
from ..dist.devices import local_device
from ..dist.topology import launcher_local_rank
from ..layer.moe import MoELayer
from ..layer.parallel import ExpertParallel, ddp_ignore_experts, init_expert_parallel
from ..step.gradsync import data_parallel
from ..tuning.auto import AutoTuner
from ..tuning.replan import Replanner
from .checks import HELD_OUT
from .config import TrainConfig
from .model import GPT, GPTConfig, batch, eval_windows, load_corpus
from .plan import auto_micro, auto_step
from .report import Metrics, Progress

__all__ = ["PARTS", "Run", "optimizer", "replanner", "restore", "setup"]

PARTS = ("forward", "backward", "optimizer")


def optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW (betas 0.9, 0.95) with weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )


@dataclass
class Run:
    """One rank's run: what set-up built (`cfg` with E and m resolved) and the state the loop
    advances (losses, evals, step times, where a failure would be reported)."""

    cfg: TrainConfig
    rank: int
    world: int
    dev: torch.device
    ep: ExpertParallel
    core: nn.Module
    model: nn.Module
    opt: torch.optim.Optimizer
    g: torch.Generator
    train_data: torch.Tensor
    windows: torch.Tensor
    moe: list[MoELayer]
    metrics: Metrics | None
    auto_micro: dict | None
    auto_step: dict | None
    tuner: AutoTuner
    replanner: Replanner | None = None
    losses: list[float] = field(default_factory=list)
    evals: list[list] = field(default_factory=list)
    start: int = 0
    times: list[float] = field(default_factory=list)
    parts: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in PARTS})
    where: list = field(default_factory=lambda: [0, "setup"])
    bar: Progress = field(init=False)

    def __post_init__(self) -> None:
        self.bar = Progress(self.last, self.rank == 0)

    @property
    def last(self) -> int:
        c = self.cfg
        return min(c.steps, c.stop_after) if c.stop_after else c.steps

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next training micro-batch (tokens_BL, targets_BL) of this rank's data stream, on
        the run's device."""
        x, y = batch(self.train_data, self.cfg.batch, self.cfg.seq_len, self.g)
        return x.to(self.dev, non_blocking=True), y.to(self.dev, non_blocking=True)

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step, all ranks."""
        return self.cfg.batch * self.cfg.seq_len * self.world * self.cfg.grad_accum


def setup(rank: int, world: int, cfg: TrainConfig) -> Run:
    """Device, groups, --auto-step and --micro-chunks auto (train/plan.py), the corpus, the model (seeded: the same dense init on
    every rank, experts seeded per expert), its data-parallel wrapper (DDP, or --fsdp: the
    model itself, sharded in place, so `model is core`) and the optimizer."""
    dev = local_device(cfg.device, launcher_local_rank(rank))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    ep = init_expert_parallel(cfg.ep_size or world)  # every rank: all EP and DP groups
    step_choice = None
    if cfg.auto_step:  # one plan for the step: policy, r, m, gradient sync (train/plan.py)
        cfg, step_choice = auto_step(cfg, world, ep.ep_group, rank)
    m, auto = cfg.micro_chunks, None
    if m == "auto":
        m, auto = auto_micro(cfg, world, ep.ep_group, rank)
    cfg = cfg.resolved(world, m)
    torch.manual_seed(cfg.seed)  # same dense init on every rank; experts seed per expert
    data = load_corpus(cfg.corpus, cfg.corpus_bytes)
    split = int(data.numel() * (1 - HELD_OUT))
    gpt = GPTConfig(seq_len=cfg.seq_len, layers=cfg.layers, heads=cfg.heads,
                    moe_every=cfg.moe_every, micro_chunks=cfg.micro_chunks,
                    checkpoint=cfg.activation_checkpointing)  # fmt: skip
    core = GPT(gpt, cfg.moe_config(world), group=ep.ep_group, seed=cfg.seed).to(dev)
    torch.manual_seed(cfg.seed * 7919 + 104729 + rank)  # per-rank stream: router noise
    model = core
    if world > 1 and cfg.fsdp:  # dense weights sharded over every rank, experts left to EP
        # Imported here, not at the top: torch.distributed.fsdp costs ~0.7 s of CPU at import,
        # which only --fsdp runs should pay (every `schemoe` command imports this module).
        from ..layer.fsdp import dense_mesh, fully_shard_dense

        model = fully_shard_dense(core, units=core.blocks, mesh=dense_mesh(dev))
    elif world > 1:  # buffers (the expert bias) have their own all-reduce: broadcast_buffers off
        model, _ = data_parallel(
            ddp_ignore_experts(core),
            sync=cfg.grad_sync,
            compress=cfg.grad_compressor,
            algorithm=cfg.grad_algorithm,
            bucket_mb=cfg.bucket_mb or (25.0 if cfg.grad_sync == "ddp" else 1.0),
            ranks_per_node=cfg.ranks_per_node,
            device_ids=[dev] if dev.type == "cuda" else None,
        )
    opt = optimizer(core, cfg.lr, cfg.weight_decay)
    g = torch.Generator().manual_seed(cfg.seed * 7919 + rank)
    moe = [x for x in core.modules() if isinstance(x, MoELayer)]
    metrics = Metrics(cfg, moe) if rank == 0 else None
    tuner = AutoTuner(core)  # resolves layers with policy "auto" / "search" on their first calls
    windows = eval_windows(data[split:], cfg.eval_seqs, cfg.seq_len, rank, world)
    return Run(cfg=cfg, rank=rank, world=world, dev=dev, ep=ep, core=core, model=model,
                opt=opt, g=g, train_data=data[:split], windows=windows, moe=moe,
                metrics=metrics, auto_micro=auto, auto_step=step_choice, tuner=tuner)  # fmt: skip


def replanner(run: Run) -> Replanner | None:
    """--replan: the Replanner of the run's MoE layers (after --resume's step and the bucket
    settling, whose routing it does not count), waiting for the AutoTuner; else None."""
    cfg = run.cfg
    if not cfg.replan:
        return None
    return Replanner(run.core, every=cfg.replan_every, budget=cfg.budget, start=run.start,
                     tuner=run.tuner, capacity_factors=cfg.replan_capacity_factors,
                     max_drop=cfg.replan_max_drop)  # fmt: skip


def restore(run: Run) -> None:
    """--resume: weights, optimizer, losses and evals so far, and the random streams (on
    another number of ranks: fresh, deterministic streams for the step reached)."""
    cfg, rank = run.cfg, run.rank
    if not cfg.resume:
        return
    got = checkpoint.load(
        cfg.resume, run.core, run.opt, allow_unverified=cfg.allow_unverified_checkpoint
    )
    run.start = got.step
    run.losses = list(got.meta.get("losses", []))[: run.start]
    run.evals = list(got.meta.get("evals", []))
    if got.rng is not None:
        torch.set_rng_state(got.rng["torch"])
        run.g.set_state(got.rng["data"])
    else:
        torch.manual_seed(cfg.seed * 7919 + 104729 + rank + 1_000_003 * run.start)
        run.g.manual_seed(cfg.seed * 7919 + rank + 1_000_003 * run.start)
    run.where[0] = run.start
