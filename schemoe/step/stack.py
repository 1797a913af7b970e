"""The stack runtime: a model's MoE blocks as stages, a batch cut into m micro-chunks, all of it
one scheduled task graph (scheduling/stack.py), forward AND backward.

Legend: B batch (cut into m micro-chunks of B / m), M model dim, N dispatch-buffer rows.

A stage is (pre, MoELayer, post):

    pre(x) -> (x_res, h)       norm, attention, residual ...: h is the MoE input, x_res what
                               post adds the MoE output to (any dense blocks before it too)
    moe: route + encode (in AT, with pre) -> the region's C/A/D/E tasks -> decode (in PO)
    post(x_res, y) -> x_out    default x_res + y (and any dense blocks after the last stage)

For each block b and micro-chunk j the executor runs AT (pre, router, encode), the MoE layer's
own region tasks through a `region.ChunkRunner` (the same machinery MoELayer.forward uses), and
PO (decode, post), in the order the stack policy gives: with "wavefront", micro-chunk j+1's
attention runs while micro-chunk j's dispatch all-to-all is on the wire. A custom autograd
Function wraps the stack: its backward runs the backward stack schedule, calling autograd per
stage and micro-chunk (PO, each chunk's experts, AT), so backward all-to-alls overlap other
micro-chunks' attention backward.

Arithmetic and order: every task computes the same thing whatever the policy; weight gradients
are summed in one fixed order (the sequential policy's backward order), so every stack policy
gives bitwise the results of "sequential" at the same m (at m > 1 random draws, router noise or
dropout, come from one CPU stream per block and micro-chunk). Across m, the cut is along the batch:
attention and the expert FFNs see exactly the rows they see at m = 1; what changes:
  * capacity mode: capacity is per micro-chunk, C = ceil(f k (T / m) / E) (each micro-chunk is
    a layer call of T / m tokens), so which tokens are dropped can differ from m = 1;
  * the aux loss is the whole batch's: the load-balancing loss E sum_e f_e P_e from f and P
    averaged over the micro-chunks (it is a product of per-batch means: the stack computes it
    once all micro-chunks are routed, and hands each micro-chunk's P its share of the gradient),
    the z-loss (a mean over tokens) averaged over them;
  * dropless outputs and gradients equal m = 1 up to the order of floating-point sums (weight
    gradients summed over micro-chunks, matmuls over fewer rows).

Gradient buckets: the stack pumps the layers' Background queue between its tasks but, unlike a
region, does not hold a bucket back while its own all-to-alls are in flight: a bucket shares the
link with them (holding back measured up to 13% slower steps: docs/results/stack_queue_2026-12-07/).
DDP marks a bucket ready when autograd accumulates its weights' gradients, which for weights
inside the stack is when the stack's backward returns (they are outputs of one Function); so
under a scheduled gradient sync the stack hands each dense weight's gradient on as soon as it is
final (the layers' `grad_ready`; on CPU from a hook inside the backward task that computes it),
and the sync all-reduces them during it, before its backward returns (gradsync.GradSync.ready).
Not supported: double backward; layers whose policy is "auto"/"search" until a tuner has
configured them (the tuner's hooks see MoELayer calls, which the stack does not make).

The runtime (the per-call state, the task runner, the autograd Function) is step/runtime.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..scheduling import Direction
from .runtime import StackCall, StackFn, Stage, as_stages

__all__ = ["MoEStack", "Stage", "run_stack"]


def run_stack(
    stages: Sequence[Stage | tuple], x: torch.Tensor, micro_chunks: int, policy: str = "wavefront"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the stages on x [B, ...] cut into `micro_chunks` along the batch, under stack policy
    `policy` (scheduling.STACK_POLICIES: "sequential", "wavefront"). Returns (out [B, ...], the
    sum over stages of each stage's aux loss over the whole batch). Collective: every
    rank calls it with the same stages, m and policy."""
    if isinstance(micro_chunks, bool) or not isinstance(micro_chunks, int) or micro_chunks < 1:
        raise ValueError(f"micro_chunks must be an int >= 1, got {micro_chunks!r}")
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise TypeError(f"the stack input must be a Tensor with a batch dim, got {x!r:.60}")
    if x.shape[0] % micro_chunks:
        raise ValueError(
            f"batch {x.shape[0]} must be divisible by micro_chunks={micro_chunks} "
            "(micro-chunks are cut along the batch)"
        )
    st = StackCall(as_stages(stages), micro_chunks, policy)
    st.schedule(Direction.FORWARD)  # unknown policy / bad layers: raise before any work
    if torch.is_grad_enabled() and (x.requires_grad or st.params):
        return StackFn.apply(st, x, *st.params)
    return st.forward(x, grad=False)


class MoEStack(nn.Module):
    """A stack of (pre, MoELayer, post) stages run as one scheduled task graph over m
    micro-chunks (module docstring). forward(x [B, ...]) -> (out [B, ...], aux loss).

    Args:
        stages: Stage or (pre, moe, post) tuples; post may be None (residual add).
        micro_chunks: m (B must be divisible by it).
        policy: the stack policy, "wavefront" (default) or "sequential".
    """

    def __init__(
        self, stages: Sequence[Stage | tuple], micro_chunks: int = 1, policy: str = "wavefront"
    ) -> None:
        super().__init__()
        self.stages = as_stages(stages)
        self.pre = nn.ModuleList(s.pre for s in self.stages)
        self.moe = nn.ModuleList(s.moe for s in self.stages)
        self.post = nn.ModuleList(s.post or nn.Identity() for s in self.stages)
        self.micro_chunks, self.policy = micro_chunks, policy

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return run_stack(self.stages, x, self.micro_chunks, self.policy)
