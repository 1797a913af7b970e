"""The training step: the one function `schemoe train` runs each step and `schemoe bench step`
times, so the benchmark measures exactly the step the trainer takes.

    rec = train_step(model, core, opt, batches, ep, clip=1.0, grad_accum=2)
    rec.loss, rec.grad_norm, rec.skipped, rec.forward_s, rec.backward_s, rec.optimizer_s

A step whose loss or gradient norm is not finite changes nothing: its optimizer step (and the
expert-bias update) is skipped on every rank alike, and `rec.skipped` says so; the caller
decides how many in a row end the run (`schemoe train`: loop.MAX_SKIPPED).

The model's contract: `model(x_BL)` returns (logits_BLV, aux), aux a scalar loss (the MoE
layers' auxiliary losses). Nothing here knows the model's class.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..dist import failures
from ..dist.devices import control_tensor
from ..layer.moe import MoELayer
from ..layer.parallel import ExpertParallel, average_expert_gradients, clip_grad_norm_

__all__ = ["StepRecord", "train_step"]

Batch = tuple[torch.Tensor, torch.Tensor]  # (tokens_BL, targets_BL) on the model's device


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step: the loss (mean over micro-batches and ranks), the global gradient
    norm before clipping (NaN when the loss was not finite), and the host wall time of its parts
    (forward: fetching the batches, forward and loss; backward; optimizer: the rest, from the
    expert-gradient average on). `skipped`: the loss or the gradient norm was not finite, so
    no weight, optimizer state or expert bias changed."""

    loss: float
    grad_norm: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    skipped: bool = False


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def train_step(
    model: nn.Module,
    core: nn.Module,
    opt: torch.optim.Optimizer,
    batches: Callable[[], Batch],
    ep: ExpertParallel | None,
    *,
    clip: float,
    grad_accum: int = 1,
    autocast_dtype: torch.dtype | None = None,
    group=None,
    checker: failures.FiniteChecker | None = None,
    on_phase: Callable[[str], None] | None = None,
    step: int | None = None,
    advice: str = "",
) -> StepRecord:
    """One optimizer step over `grad_accum` micro-batches; returns its StepRecord.

    1. zero the gradients; per micro-batch (`batches()` gives it): forward under autocast
       (`autocast_dtype`, None: off), cross-entropy in fp32, backward of (loss + aux) /
       grad_accum; DDP's `no_sync()` on all but the last, so it all-reduces once.
    2. the loss, mean over micro-batches and the ranks of `group` (None: the default group):
       one all-reduce, one HOST SYNC; not finite: skip to 4.
    3. average_expert_gradients over `ep` (None: the MoE layers' own group), then
       clip_grad_norm_ to `clip` (0: measure only; HOST SYNC). Whether the norm is finite is
       agreed over `group` (one all-reduce of one int): the dense part is the same on every
       rank after the data-parallel all-reduce and the expert part is all-reduced over the EP
       group, so the norms agree already, but a skip must be the same decision everywhere, so
       it is made one. Finite: optimizer step and the aux-loss-free expert bias update of every
       MoE layer of `core` that has one.
    4. not finite (loss or norm): no optimizer step; the gradients are dropped and the routing
       load counted for the bias update is reset, so the step leaves no trace but `skipped`.

    `model` is `core` or its data-parallel wrapper; `checker` (--check-finite) checks each
    micro-batch's loss and, after averaging, the gradients; `on_phase` hears "forward",
    "backward", "optimizer" as they begin (for failure reports). Collective: every rank of
    the groups calls it with the same `grad_accum`. `step` and `advice` are accepted for
    callers of the version that raised on a non-finite loss, and unused."""
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be an int >= 1, got {grad_accum!r}")
    phase = on_phase or (lambda _: None)
    opt.zero_grad(set_to_none=True)
    fwd = bwd = 0.0
    stat = None
    for micro in range(grad_accum):
        last = micro == grad_accum - 1
        sync = (
            contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        )
        with sync:
            ta = time.perf_counter()
            phase("forward")
            x, y = batches()
            with torch.autocast(
                x.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None
            ):
                logits, aux = model(x)
                flat = logits.float().reshape(-1, logits.shape[-1])
                loss = F.cross_entropy(flat, y.reshape(-1))
            if checker:
                checker.check_loss(loss)
            stat = torch.zeros((), device=loss.device) if stat is None else stat
            stat += loss.detach() / grad_accum
            tb = time.perf_counter()
            phase("backward")
            ((loss + aux) / grad_accum).backward()
            fwd, bwd = fwd + tb - ta, bwd + time.perf_counter() - tb
    if (n := _size(group)) > 1:
        dist.all_reduce(stat, group=group)
        stat /= n
    mean = stat.item()  # host sync: decides whether to go on
    t0 = time.perf_counter()
    phase("optimizer")
    gnorm, ok = math.nan, math.isfinite(mean)  # the same on every rank: an all-reduced mean
    if ok:
        average_expert_gradients(core, ep)  # the mean-loss gradient, as DDP's dense ones
        if checker:
            checker.check_grads()
        gnorm = clip_grad_norm_(core, clip, ep)
        ok = _everywhere(math.isfinite(gnorm), group)
    if ok:
        opt.step()
    else:
        opt.zero_grad(set_to_none=True)
    # The bias moves once per optimizer step, from the load of all its micro-batches and ranks.
    dp_group = ep.dp_group if ep is not None and ep.dp_size > 1 else None
    for m in core.modules():
        if isinstance(m, MoELayer) and m.expert_bias is not None:
            if ok:
                m.update_expert_bias(dp_group)
            else:
                m.expert_load.zero_()  # as update_expert_bias leaves it: this step never counted
    return StepRecord(mean, gnorm, fwd, bwd, time.perf_counter() - t0, skipped=not ok)


def _everywhere(ok: bool, group) -> bool:
    """Whether `ok` holds on every rank of `group` (one all-reduce of one int; HOST SYNC)."""
    if _size(group) == 1:
        return ok
    flag = control_tensor([int(ok)], dtype=torch.int64, group=group)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
