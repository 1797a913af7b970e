"""Shared by the multi-rank tests: build a layer and the reference from one seed, run both, and
compare forward and backward.

Tolerances (fp32): the layer and the reference do the same arithmetic in a different order
(bmm vs one matmul per expert, buffer gathers, chunked GEMMs, a different summation order of
expert-weight gradients over ranks and chunks). Each output element is a sum of O(H) products of
O(1) values, so reordering moves it by a few ulps of fp32 (1.2e-7 relative) times sqrt(H);
atol=2e-5 / rtol=2e-4 leaves ~10x headroom over that while catching any wrong row, weight or
dropped token (those show up as O(1) errors).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from schemoe import MoELayer
from schemoe import config as c
from schemoe.costmodel.hardware import preset
from schemoe.layer.reference import reference_moe
from schemoe.tuning.auto import TUNED, AutoTuner

ATOL, RTOL = 2e-5, 2e-4
ALGOS = ("naive", "pairwise", "pipe", "hier2d", "leader")  # the built-in all-to-all algorithms
POLICIES = ("sequential", "tutel", "schemoe", "fastermoe")  # the built-in fixed-order policies


def layer_config(
    policy: str = "schemoe",
    algorithm: str = "naive",
    *,
    chunks: int = 2,
    experts: int = 8,
    capacity_factor: float = 1.0,
    dims: tuple[int, int] = (12, 20),
    rpn: int | None = None,
    uniform: bool = False,
    compression: str = "none",
    schedule: c.ScheduleConfig | None = None,
    **gate,
) -> c.MoEConfig:
    """The multi-rank tests' layer: top-2 of `experts`, (model, hidden) = `dims`, `rpn` ranks per
    node, `policy` over `chunks` (or the given `schedule`), `compression` both ways; `gate` adds
    c.GateConfig fields (aux_loss_weight=...)."""
    return c.MoEConfig(
        gate=c.GateConfig(num_experts=experts, top_k=2, capacity_factor=capacity_factor, **gate),
        experts=c.ExpertConfig(model_dim=dims[0], hidden_dim=dims[1]),
        parallel=c.ParallelConfig(ranks_per_node=rpn, uniform_tokens=uniform),
        schedule=schedule or c.ScheduleConfig(policy=policy, chunks=chunks),
        collective=c.CollectiveConfig(algorithm=algorithm),
        compression=c.CompressionConfig(forward=compression, backward=compression),
    )


def global_weights(layer: MoELayer, seed: int, gate_bias_rows=()) -> dict[str, torch.Tensor]:
    """Deterministic unsharded weights with the layer's global shapes."""
    g = torch.Generator().manual_seed(seed)
    E, P = layer.config.gate.num_experts, layer.topology.world
    out = {}
    for name, t in layer.global_state().items() if P == 1 else _shapes(layer).items():
        shape = t.shape if isinstance(t, torch.Tensor) else t
        out[name] = torch.randn(shape, generator=g) * (0.5 if "gate" in name else 0.3)
    for e in gate_bias_rows:
        out["gate_weight"][e] = -3.0  # with positive inputs expert e is never chosen
    del E
    return out


def _shapes(layer: MoELayer) -> dict[str, tuple[int, ...]]:
    P = layer.topology.world
    out = {}
    for name, p in layer.named_parameters():
        shape = tuple(p.shape)
        if getattr(p, "schemoe_expert", False):
            shape = (shape[0] * P, *shape[1:])
        out[name] = shape
    return out


def inputs(world: int, tokens: list[int], M: int, seed: int, positive: bool = False):
    g = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(t, M, generator=g) for t in tokens]
    if positive:
        xs = [x.abs() + 0.1 for x in xs]
    grads = [torch.randn(t, M, generator=g) for t in tokens]
    return xs, grads


def run_layer(layer: MoELayer, x: torch.Tensor, gy: torch.Tensor):
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y, aux = layer(x)
    ((y * gy).sum() + aux).backward()
    grads = {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in layer.named_parameters()
    }
    return y.detach(), aux.detach(), x.grad.clone(), grads


def run_reference(weights, cfg: c.MoEConfig, xs, gys, bias=None):
    w = {n: t.clone().requires_grad_(True) for n, t in weights.items()}
    xs = [x.clone().requires_grad_(True) for x in xs]
    ys, auxes = reference_moe(xs, w, cfg, bias)
    loss = sum((y * gy).sum() + a for y, gy, a in zip(ys, gys, auxes))
    if loss.requires_grad:  # False only when no rank has a token
        loss.backward()
    z = lambda t: t.grad if t.grad is not None else torch.zeros_like(t)
    return ys, auxes, [z(x) for x in xs], {n: z(t) for n, t in w.items()}


def step_without_host_sync(layer: MoELayer, x: torch.Tensor) -> None:
    """One forward and backward of a CUDA `layer` under torch.cuda.set_sync_debug_mode("error"):
    a host-device sync in either raises (call the layer once before, to warm it)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, aux = layer(x)
        (y.sum() + aux).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def close(a: torch.Tensor, b: torch.Tensor, what: str, atol=ATOL, rtol=RTOL) -> None:
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}")
    if not torch.allclose(a, b, atol=atol, rtol=rtol):
        err = (a - b).abs().max().item()
        raise AssertionError(f"{what}: max abs error {err:.3e} > atol {atol} / rtol {rtol}")


def check_against_reference(
    cfg: c.MoEConfig,
    tokens: list[int],
    seed: int,
    positive=False,
    dead_experts=(),
    atol=ATOL,
    rtol=RTOL,
    bias=None,
    **layer_kw,
) -> dict:
    """Build the layer on this rank, compare output, aux, and all grads with the reference
    (`bias`: the aux-loss-free selection bias [E] set on both)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(seed)
    layer = MoELayer(cfg, **layer_kw)
    if cfg.schedule.policy in TUNED:  # planned on a fixed preset: never a profile on disk
        AutoTuner(layer, hardware=preset("local"))
    weights = global_weights(layer, seed, dead_experts)
    layer.load_global_state(weights)
    if bias is not None:
        layer.expert_bias.copy_(bias)
    xs, gys = inputs(len(tokens), tokens, cfg.experts.model_dim, seed, positive)
    y, aux, gx, grads = run_layer(layer, xs[rank], gys[rank])
    ry, raux, rgx, rgrads = run_reference(weights, cfg, xs, gys, bias)
    tag = f"[{cfg.gate.top_k=} {cfg.gate.capacity_factor=} {tokens=} rank {rank}]"
    close(y, ry[rank].detach(), f"output {tag}", atol, rtol)
    close(aux, raux[rank].detach(), f"aux {tag}", atol, rtol)
    close(gx, rgx[rank], f"input grad {tag}", atol, rtol)
    sl = layer.expert_slice()
    for name, g in grads.items():
        if getattr(dict(layer.named_parameters())[name], "schemoe_expert", False):
            close(g, rgrads[name][sl], f"grad {name} {tag}", atol, rtol)
        else:
            if dist.is_initialized():
                dist.all_reduce(g)  # dense grads: what DDP's all-reduce would sum
            close(g, rgrads[name], f"grad {name} {tag}", atol, rtol)
    return {"y": y, "gx": gx, "grads": grads}
