"""`schemoe train`: a short expert-parallel training run of a small GPT with MoE layers.

    schemoe train --nproc 4 --steps 30          # spawns 4 local CPU ranks (gloo)
    torchrun --nproc-per-node 4 -m schemoe train --steps 30   # or under any launcher

The corpus needs no download: by default the text of Python's own standard-library sources,
byte-level tokens (vocabulary 256); `--corpus PATH` takes a text file or a folder of them.
Dense weights are data-parallel (DDP, all-reduced), experts are expert-parallel over all ranks.
Rank 0 prints step, loss and tokens/s, and a last line of JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .config import (
    CollectiveConfig,
    CompressionConfig,
    ExpertConfig,
    GateConfig,
    MoEConfig,
    ParallelConfig,
    ScheduleConfig,
)
from .lm import GPT, GPTConfig
from .parallel import ddp_ignore_experts

__all__ = ["register", "load_corpus", "moe_config_from_args", "train"]


def load_corpus(path: str | None, max_bytes: int) -> torch.Tensor:
    """Byte tokens of a text file, a folder of .py/.txt/.md files, or the Python stdlib sources."""
    root = Path(path) if path else Path(sysconfig.get_paths()["stdlib"])
    if not root.exists():
        raise ValueError(f"corpus path {str(root)!r} does not exist")
    files = [root] if root.is_file() else sorted(
        p for p in root.rglob("*") if p.suffix in (".py", ".txt", ".md") and p.is_file()
    )
    buf = bytearray()
    for f in files:
        if len(buf) >= max_bytes:
            break
        buf += f.read_bytes()[: max_bytes - len(buf)]
    if len(buf) < 10_000:
        raise ValueError(f"corpus at {str(root)!r} has only {len(buf)} bytes; need >= 10000")
    return torch.frombuffer(bytes(buf), dtype=torch.uint8).long()


def moe_config_from_args(a: argparse.Namespace) -> MoEConfig:
    return MoEConfig(
        gate=GateConfig(num_experts=a.experts, top_k=a.top_k, capacity_factor=a.capacity_factor,
                        aux_loss_weight=a.aux_loss_weight),
        experts=ExpertConfig(model_dim=a.dim, hidden_dim=a.hidden, activation=a.activation),
        parallel=ParallelConfig(ranks_per_node=a.ranks_per_node),
        schedule=ScheduleConfig(policy=a.policy, chunks=a.chunks),
        collective=CollectiveConfig(algorithm=a.algorithm),
        compression=CompressionConfig(forward=a.compress, backward=a.compress_backward),
    )


def _batch(data: torch.Tensor, batch: int, seq: int, g: torch.Generator):
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
    idx = starts[:, None] + torch.arange(seq + 1)
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


def train(rank: int, world: int, a: argparse.Namespace) -> dict:
    """One rank's training loop (torch.distributed already initialised)."""
    torch.manual_seed(a.seed)  # same dense init on every rank; experts seed per expert
    data = load_corpus(a.corpus, a.corpus_bytes)
    split = int(data.numel() * 0.95)
    train_data, eval_data = data[:split], data[split:]
    model = GPT(GPTConfig(seq_len=a.seq_len, layers=a.layers, heads=a.heads),
                moe_config_from_args(a), seed=a.seed)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(ddp_ignore_experts(model))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(a.seed * 7919 + rank)
    losses, times = [], []
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        x, y = _batch(train_data, a.batch, a.seq_len, g)
        logits, aux = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        (loss + aux).backward()
        opt.step()
        stat = loss.detach().clone()
        if world > 1:
            dist.all_reduce(stat)
            stat /= world
        times.append(time.perf_counter() - t0)
        losses.append(stat.item())
        if rank == 0 and (step == 1 or step % a.log_every == 0 or step == a.steps):
            tps = a.batch * a.seq_len * world / times[-1]
            print(f"step {step:4d}  loss {losses[-1]:.4f}  tokens/s {tps:,.0f}", flush=True)
    timed = times[1:] or times  # the first step pays one-time setup
    result = {
        "initial_loss": losses[0],
        "final_loss": losses[-1],
        "tokens_per_s": a.batch * a.seq_len * world * len(timed) / sum(timed),
        "steps": a.steps,
        "world_size": world,
        "policy": a.policy,
        "chunks": a.chunks,
        "algorithm": a.algorithm,
        "compress": a.compress,
        "losses": [round(v, 5) for v in losses],
    }
    if rank == 0:
        print(json.dumps(result), flush=True)
    return result


def _spawned(rank: int, world: int, a: argparse.Namespace) -> dict:
    return train(rank, world, a)


def _main(a: argparse.Namespace) -> int:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun / srun
        from ._dist import init_process_group

        torch.set_num_threads(a.threads)
        init_process_group("gloo", a.timeout)
        try:
            train(dist.get_rank(), dist.get_world_size(), a)
        finally:
            dist.destroy_process_group()
        return 0
    from ._dist import spawn

    spawn(_spawned, a.nproc, a, timeout=a.timeout, threads=a.threads)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=4, help="local ranks to spawn (default 4)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--aux-loss-weight", type=float, default=0.01)
    p.add_argument("--activation", default="gelu")
    p.add_argument("--policy", default="schemoe")
    p.add_argument("--chunks", type=int, default=2)
    p.add_argument("--algorithm", default="naive")
    p.add_argument("--compress", default="none", help="forward (activation) compressor")
    p.add_argument("--compress-backward", default="none", help="gradient compressor")
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", default=None, help="text file or folder (default: Python stdlib)")
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout, seconds")


def register(sub) -> None:
    p = sub.add_parser("train", help="short expert-parallel training run of a small MoE GPT")
    add_arguments(p)
    p.set_defaults(func=_main)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m schemoe.train")
    add_arguments(parser)
    sys.exit(_main(parser.parse_args()))
