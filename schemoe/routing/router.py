"""Top-k routing with capacity: which expert buffer row each (token, choice) goes to.

Legend: T tokens on this rank, M model dim, E experts, k choices per token, C capacity,
G expert groups, n = E / G experts per group.

Scores, selection and weights (all fp32, whatever the activations' dtype or autocast):

    logits = x W^T (+ b_logit);  s = softmax(logits) or sigmoid(logits)   (GateConfig.score)
    selection score  = s + b  (b: the aux-loss-free bias, selection only; 0 without it)
    group-limited:   group score = sum of its 2 highest selection scores (1 if n = 1), or
                     its highest (group_score="max"); the top_groups best groups stay, the
                     others' experts are masked out
    experts          = top-k of the selection scores, best first
    weights          = s of the chosen experts (never the bias), / (their sum + 1e-20) when
                       renormalize, then * scale

As Hugging Face transformers computes it (5.x): Mixtral (softmax, always renormalised), Qwen2/3-MoE
(softmax, norm_topk_prob), DeepSeek-V3 (sigmoid, e_score_correction_bias, n_group / topk_group,
norm_topk_prob, routed_scaling_factor). The one difference: they take the logits in the model's
dtype where the router weight is not fp32 (Qwen), this router always in fp32.

The dispatch buffer is expert-major: expert e owns rows [offset_e, offset_e + counts_e). With a
capacity factor f > 0 every expert owns C = ceil(f * k * T / E) rows (unused rows stay zero) and a
(token, choice) past C is dropped; with f = 0 (dropless) counts_e is exactly the number of choices
that picked e. Priority when an expert overflows: all first choices before any second choice
(GShard), and within a choice level by token position or, with priority="score", by the token's
top-1 score, highest first (batch-prioritised routing, Riquelme et al. 2021).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import GateConfig

__all__ = ["Routing", "capacity", "route", "scores", "select"]


@dataclass(frozen=True)
class Routing:
    """The routing plan of one layer call on one rank (index tensors only, no activations)."""

    probs_TE: torch.Tensor  # fp32 distribution over experts: softmax, or sigmoid / its row sum
    logits_TE: torch.Tensor  # fp32
    expert_TK: torch.Tensor  # long, chosen expert per choice
    weight_TK: torch.Tensor  # fp32 combine weight (0 where dropped), differentiable
    slot_TK: torch.Tensor  # long, row in the dispatch buffer, -1 where dropped
    # Rows per expert in the dispatch buffer (E entries) on the host; None in dropless mode until
    # the dispatcher reads `counts_E` (once, with the exchanged counts; dataclasses.replace).
    counts: tuple[int, ...] | None
    # long [E] on the device, dropless mode only; set means every choice is kept (layout.py
    # relies on it: slot_TK is then a permutation of the T k rows, no masks)
    counts_E: torch.Tensor | None = None
    weights_on_input: bool = False  # scale each choice's input by its weight, not its output

    @property
    def rows(self) -> int:
        """N, the dispatch buffer's rows: sum(counts), or T * k in dropless mode (every choice
        is kept), known without reading the counts."""
        return sum(self.counts) if self.counts is not None else self.slot_TK.numel()

    def host_counts(self) -> tuple[int, ...]:
        """`counts`, read from `counts_E` where not known yet (then a host sync)."""
        if self.counts is not None:
            return self.counts
        return tuple(int(c) for c in self.counts_E.tolist())  # host sync


def capacity(cfg: GateConfig, tokens: int) -> int:
    """C = min(ceil(f * k * T / E), T) (GShard): an expert takes each token at most once, so
    more than T rows could never fill; 0 tokens give C = 0."""
    return min(math.ceil(cfg.capacity_factor * cfg.top_k * tokens / cfg.num_experts), tokens)


def scores(logits_TE: torch.Tensor, cfg: GateConfig) -> torch.Tensor:
    """s [T, E]: softmax over the experts or an independent sigmoid per expert (fp32 in, out)."""
    if cfg.score == "sigmoid":
        return torch.sigmoid(logits_TE)
    return torch.softmax(logits_TE, dim=-1)


def select(select_TE: torch.Tensor, cfg: GateConfig) -> torch.Tensor:
    """expert_TK: the top-k of the selection scores [T, E] (no gradient), best first, among the
    experts of each token's `top_groups` best groups (group score: the sum of its two highest
    selection scores)."""
    T, E, G = select_TE.shape[0], cfg.num_experts, cfg.groups
    if cfg.kept_groups < G:
        n = E // G
        best = 1 if cfg.group_score == "max" else min(2, n)
        group_TG = select_TE.view(T, G, n).topk(best, dim=-1).values.sum(-1)
        top_TG = group_TG.topk(cfg.kept_groups, dim=-1).indices
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, top_TG, True)
        keep_TE = keep_TG[:, :, None].expand(T, G, n).reshape(T, E)
        select_TE = select_TE.masked_fill(~keep_TE, float("-inf"))
    return torch.topk(select_TE, cfg.top_k, dim=-1).indices


def route(
    x_TM: torch.Tensor,
    weight_EM: torch.Tensor,
    cfg: GateConfig,
    *,
    training: bool = False,
    bias_E: torch.Tensor | None = None,
    logit_bias_E: torch.Tensor | None = None,
) -> Routing:
    """Route T tokens (see the module docstring). The router always computes in fp32, whatever
    the activation, weight or bias dtype and autocast. `bias_E`: the selection bias; `logit_bias_E`:
    the learned logit bias (GateConfig.logit_bias)."""
    T, E, k = x_TM.shape[0], cfg.num_experts, cfg.top_k
    # 1. Scores in fp32 (autocast must not lower the router's precision).
    with torch.autocast(device_type=x_TM.device.type, enabled=False):
        logits_TE = x_TM.float() @ weight_EM.float().t()
        if logit_bias_E is not None:
            logits_TE = logits_TE + logit_bias_E.float()
        if training and cfg.noise_std > 0:
            logits_TE = logits_TE + torch.randn_like(logits_TE) * cfg.noise_std
        s_TE = scores(logits_TE, cfg)

        # 2. Top-k selection; the balancing bias changes the choice, never the weight.
        select_TE = s_TE.detach() if bias_E is None else s_TE.detach() + bias_E.float()
        expert_TK = select(select_TE, cfg)
        weight_TK = s_TE.gather(1, expert_TK)
        if cfg.renormalize:
            weight_TK = weight_TK / (weight_TK.sum(-1, keepdim=True) + 1e-20)
        if cfg.scale != 1.0:
            weight_TK = weight_TK * cfg.scale
        probs_TE = s_TE if cfg.score == "softmax" else s_TE / s_TE.sum(-1, keepdim=True)

    # 3. Position of each choice inside its expert, in priority order (choice-major).
    if cfg.priority == "score" and T > 0:
        order_T = torch.argsort(s_TE.detach().max(-1).values, descending=True, stable=True)
    else:
        order_T = torch.arange(T, device=x_TM.device)
    expert_KT = expert_TK[order_T].t()  # [k, T] in priority order
    flat = expert_KT.reshape(-1)
    # A stable sort by expert keeps the priority order within each expert, so a choice's
    # position is its rank in the sorted order minus its expert's first rank (no [k T, E]
    # one-hot, whose cumsum grows with E; never [T, E, C]). searchsorted, not bincount: no sync.
    order = torch.argsort(flat, stable=True)
    sorted_flat = flat[order]
    first_E1 = torch.searchsorted(sorted_flat, torch.arange(E + 1, device=flat.device))
    pos_sorted = torch.arange(flat.numel(), device=flat.device) - first_E1[sorted_flat]
    pos_flat = torch.empty_like(flat).scatter_(0, order, pos_sorted)
    pos_TK = torch.empty_like(expert_TK)
    pos_TK[order_T] = pos_flat.view(k, T).t()

    # 4. Capacity and buffer rows: expert e owns rows [offset_e, offset_e + counts_e).
    if cfg.dropless:
        # Every choice kept (N = T k rows); the counts and offsets stay on the device, so the
        # router reads nothing back: the dispatcher reads counts_E once, with the exchange.
        counts, counts_E = None, first_E1.diff()
        offsets_E = counts_E.cumsum(0) - counts_E  # exclusive
        keep_TK = torch.ones_like(expert_TK, dtype=torch.bool)
    else:
        # C rows per expert, C from the shape T alone: no data-dependent size (torch.compile).
        C = capacity(cfg, T)
        counts, counts_E = (C,) * E, None
        offsets_E = torch.arange(E, device=x_TM.device) * C
        keep_TK = pos_TK < C
    slot_TK = torch.where(keep_TK, offsets_E[expert_TK] + pos_TK, torch.full_like(pos_TK, -1))
    weight_TK = weight_TK * keep_TK
    on_input = cfg.weights_on == "input"
    return Routing(probs_TE, logits_TE, expert_TK, weight_TK, slot_TK, counts, counts_E, on_input)
