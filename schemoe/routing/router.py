"""Top-k routing with capacity: which expert buffer row each (token, choice) goes to.

Legend: T tokens on this rank, M model dim, E experts, k choices per token, C capacity.

The dispatch buffer is expert-major: expert e owns rows [offset_e, offset_e + counts_e). With a
capacity factor f > 0 every expert owns C = ceil(f * k * T / E) rows (unused rows stay zero) and a
(token, choice) past C is dropped; with f = 0 (dropless) counts_e is exactly the number of choices
that picked e. Priority when an expert overflows: all first choices before any second choice
(GShard), and within a choice level by token position or, with priority="score", by the token's
top-1 probability, highest first (batch-prioritised routing, Riquelme et al. 2021).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import GateConfig

__all__ = ["Routing", "capacity", "route"]


@dataclass(frozen=True)
class Routing:
    """The routing plan of one layer call on one rank (index tensors only, no activations)."""

    probs_TE: torch.Tensor  # fp32 softmax of the logits
    logits_TE: torch.Tensor  # fp32
    expert_TK: torch.Tensor  # long, chosen expert per choice
    weight_TK: torch.Tensor  # fp32 combine weight (0 where dropped), differentiable
    slot_TK: torch.Tensor  # long, row in the dispatch buffer, -1 where dropped
    counts: tuple[int, ...]  # rows per expert in the dispatch buffer (E entries)

    @property
    def rows(self) -> int:
        return sum(self.counts)


def capacity(cfg: GateConfig, tokens: int) -> int:
    """C = min(ceil(f * k * T / E), T) (GShard): an expert takes each token at most once, so
    more than T rows could never fill; 0 tokens give C = 0."""
    return min(math.ceil(cfg.capacity_factor * cfg.top_k * tokens / cfg.num_experts), tokens)


def route(
    x_TM: torch.Tensor,
    weight_EM: torch.Tensor,
    cfg: GateConfig,
    *,
    training: bool = False,
    bias_E: torch.Tensor | None = None,
) -> Routing:
    """Route T tokens. The router always computes in fp32, whatever the activation dtype."""
    T, E, k = x_TM.shape[0], cfg.num_experts, cfg.top_k
    # 1. Scores in fp32 (autocast must not lower the router's precision).
    with torch.autocast(device_type=x_TM.device.type, enabled=False):
        logits_TE = x_TM.float() @ weight_EM.float().t()
    if training and cfg.noise_std > 0:
        logits_TE = logits_TE + torch.randn_like(logits_TE) * cfg.noise_std
    probs_TE = torch.softmax(logits_TE, dim=-1)

    # 2. Top-k selection; the balancing bias changes the choice, never the weight.
    select_TE = probs_TE.detach() if bias_E is None else probs_TE.detach() + bias_E
    expert_TK = torch.topk(select_TE, k, dim=-1).indices
    weight_TK = probs_TE.gather(1, expert_TK)
    if cfg.renormalize:
        weight_TK = weight_TK / weight_TK.sum(-1, keepdim=True).clamp_min(1e-20)

    # 3. Position of each choice inside its expert, in priority order (choice-major).
    if cfg.priority == "score" and T > 0:
        order_T = torch.argsort(probs_TE.detach().max(-1).values, descending=True, stable=True)
    else:
        order_T = torch.arange(T, device=x_TM.device)
    expert_KT = expert_TK[order_T].t()  # [k, T] in priority order
    flat = expert_KT.reshape(-1)
    onehot = torch.nn.functional.one_hot(flat, E)  # [k*T, E]; never [T, E, C]
    pos_flat = (onehot.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)
    pos_TK = torch.empty_like(expert_TK)
    pos_TK[order_T] = pos_flat.view(k, T).t()

    # 4. Capacity and buffer rows.
    if cfg.dropless:
        counts_E = onehot.sum(0) if T > 0 else torch.zeros(E, dtype=torch.long)
        counts = tuple(int(c) for c in counts_E.tolist())  # host sync: splits must be known
        keep_TK = torch.ones_like(expert_TK, dtype=torch.bool)
    else:
        C = capacity(cfg, T)
        counts = (C,) * E
        keep_TK = pos_TK < C
    offsets_E = torch.tensor((0,) + counts[:-1], device=x_TM.device).cumsum(0)
    slot_TK = torch.where(keep_TK, offsets_E[expert_TK] + pos_TK, torch.full_like(pos_TK, -1))
    weight_TK = weight_TK * keep_TK
    return Routing(probs_TE, logits_TE, expert_TK, weight_TK, slot_TK, counts)
