"""Shared (always-on) experts: the FFN every token goes through, run as the schedule's task S.

Legend: T tokens of this rank, M model dim, Hs the shared hidden dim (num x hidden_dim).

    y_TM = combine(routed rows) + s_TM,   s_TM = [sigmoid(x_TM w_g)] * W2 act(W1 x_TM)

n shared experts of hidden dim H sum to one FFN of hidden dim n H (the hidden units are
independent), so they are held and run as one: three GEMMs (two without swiglu) in one task.
The weights are dense, replicated on every rank of the expert-parallel group (not marked
`schemoe_expert`): data-parallel gradient averaging treats them as the gate weight.

The S task (scheduling/tasks.py) runs inside the scheduled region, forward and backward, on the
compute thread wherever the policy placed it; `region.py` calls the functions below.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ExpertConfig, MoEConfig, SharedExpertConfig
from ..scheduling import Direction, Policy, Schedule, TaskGraph, make_schedule, place_shared

__all__ = [
    "SharedExperts",
    "build_shared",
    "region_schedule",
    "shared_backward",
    "shared_forward",
    "shared_params",
]


def _uniform(shape: tuple[int, ...], fan_in: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(fan_in)
    return torch.rand(shape, generator=g) * 2 * bound - bound


class SharedExperts(nn.Module):
    """The shared experts of one layer as one FFN, weights in nn.Linear layout ([out, in]).

    Args:
        cfg: number, hidden dim, gate.
        experts: the routed experts' config (model dim and activation).
        seed: the layer's seed (the same on every rank, so the replicas start equal).

    forward(x_TM [T, M]) -> [T, M].
    """

    def __init__(self, cfg: SharedExpertConfig, experts: ExpertConfig, seed: int = 0) -> None:
        super().__init__()
        M, H = experts.model_dim, cfg.total_hidden
        self.cfg, self.activation = cfg, experts.activation
        # Seeds of the form s * 1_000_003 - j: the routed experts use s * 1_000_003 + 3 e + i.
        base = seed * 1_000_003
        self.w1_HM = nn.Parameter(_uniform((H, M), M, base - 1))
        self.w2_MH = nn.Parameter(_uniform((M, H), H, base - 2))
        swiglu = experts.activation == "swiglu"
        self.w3_HM = nn.Parameter(_uniform((H, M), M, base - 3)) if swiglu else None
        self.gate_1M = nn.Parameter(_uniform((1, M), M, base - 4)) if cfg.gated else None

    def forward(self, x_TM: torch.Tensor) -> torch.Tensor:
        h_TH = F.linear(x_TM, self.w1_HM)
        if self.activation == "relu":
            a_TH = F.relu(h_TH)
        elif self.activation == "gelu":
            a_TH = F.gelu(h_TH)
        else:
            a_TH = F.silu(h_TH) * F.linear(x_TM, self.w3_HM)
        y_TM = F.linear(a_TH, self.w2_MH)
        if self.gate_1M is not None:
            y_TM = torch.sigmoid(F.linear(x_TM, self.gate_1M)) * y_TM
        return y_TM

    def extra_repr(self) -> str:
        c = self.cfg
        return f"num={c.num}, hidden_dim={c.hidden_dim}, gated={c.gated}, placement={c.placement}"


def build_shared(config: MoEConfig, seed: int) -> SharedExperts | None:
    """The layer's shared experts, or None when `config.shared` is None."""
    if config.shared is None:
        return None
    return SharedExperts(config.shared, config.experts, seed)


def region_schedule(
    config: MoEConfig, policy: Policy, links: tuple[str, ...], direction: Direction, costs=None
) -> tuple[TaskGraph, Schedule]:
    """The region's (TaskGraph, Schedule) of `direction` under `policy`: with an S task when the
    layer has shared experts, placed as `config.shared.placement` says."""
    shared = config.shared is not None
    graph = TaskGraph(config.schedule.chunks, links, direction, policy.partition, shared)
    sched = make_schedule(policy.name, graph, costs)
    return graph, place_shared(sched, config.shared.placement) if shared else sched


def shared_params(shared: nn.Module | None) -> list[nn.Parameter]:
    return [] if shared is None else [p for p in shared.parameters() if p.requires_grad]


def shared_forward(shared: nn.Module, x_TM: torch.Tensor, saved: dict) -> Callable:
    """The S task of a forward that will be differentiated: its graph is built on a leaf and
    kept in `saved["S"]` for `shared_backward`; returns s_TM detached."""

    def fn() -> torch.Tensor:
        leaf = x_TM.detach().requires_grad_(True)
        with torch.enable_grad():
            y = shared(leaf)
        saved["S"] = (leaf, y)
        return y.detach()

    return fn


def shared_backward(
    saved: dict, params: Sequence[torch.Tensor], g_TM: torch.Tensor, keep: bool
) -> Callable:
    """The S task of backward: (gradient of x_TM, gradients of `params`, zeros where unused)
    from the graph `shared_forward` saved and the output gradient g_TM."""

    def fn() -> tuple[torch.Tensor, list[torch.Tensor]]:
        if "S" not in saved:
            raise RuntimeError(
                "this MoE region's backward already ran and freed its shared-expert graph; to "
                "run backward through it again, pass retain_graph=True the first time"
            )
        leaf, y = saved["S"] if keep else saved.pop("S")
        grads = torch.autograd.grad(
            y, (leaf, *params), g_TM.to(y.dtype), allow_unused=True, retain_graph=keep
        )
        full = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, (leaf, *params))]
        return full[0], full[1:]

    return fn
