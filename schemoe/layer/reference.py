"""A single-process MoE with the same math as MoELayer, written as plainly as possible.

It is the ground truth of the tests: loops over ranks, choices and tokens, one expert at a time,
no buffers, no all-to-all, no chunks. `xs[r]` holds the tokens of rank r; routing and capacity
are per rank, as in MoELayer (each rank routes its own tokens). Routing is chosen token by token
with Python sorts (every GateConfig mode: softmax / sigmoid scores, the logit bias, groups, top
groups scored by their best two or best one, scale, weights on outputs or inputs, the selection
bias `bias` [E]), not with the router's tensor code.

`weights` is the unsharded state of MoELayer.global_state(): gate_weight [E, M] (+ gate_bias [E]),
experts.w1_EMH [E, M, H], experts.w2_EHM [E, H, M] (+ experts.w3_EMH for swiglu,
experts.b1_EH / experts.b2_EM with bias; shared.w1_HM, shared.w2_MH (+ shared.w3_HM,
shared.gate_1M) with shared experts).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import MoEConfig

__all__ = ["reference_moe"]


def _expert(x: torch.Tensor, w: dict[str, torch.Tensor], e: int, act: str) -> torch.Tensor:
    h = x @ w["experts.w1_EMH"][e]
    if "experts.b1_EH" in w:
        h = h + w["experts.b1_EH"][e]
    if act == "relu":
        a = F.relu(h)
    elif act == "gelu":
        a = F.gelu(h)
    else:
        a = F.silu(h) * (x @ w["experts.w3_EMH"][e])
    y = a @ w["experts.w2_EHM"][e]
    if "experts.b2_EM" in w:
        y = y + w["experts.b2_EM"][e]
    return y


def _choose(s: list[float], bias: torch.Tensor | None, g) -> list[int]:
    """One token's k experts, best first: the top-k of s + bias among the experts of its
    top_groups best groups, a group scored by the sum of its two best s + bias."""
    sel = [v + (float(bias[e]) if bias is not None else 0.0) for e, v in enumerate(s)]
    n = g.num_experts // g.groups
    top = 1 if g.group_score == "max" else 2
    best = lambda group: sum(sorted((sel[e] for e in group), reverse=True)[:top])
    groups = [range(q * n, (q + 1) * n) for q in range(g.groups)]
    kept = sorted(groups, key=best, reverse=True)[: g.kept_groups]
    allowed = [e for group in kept for e in group]
    return sorted(allowed, key=lambda e: -sel[e])[: g.top_k]


def _shared(x: torch.Tensor, w: dict[str, torch.Tensor], act: str) -> torch.Tensor:
    h = x @ w["shared.w1_HM"].t()
    a = {"relu": F.relu, "gelu": F.gelu}[act](h) if act != "swiglu" else None
    if a is None:
        a = F.silu(h) * (x @ w["shared.w3_HM"].t())
    y = a @ w["shared.w2_MH"].t()
    if "shared.gate_1M" in w:
        y = torch.sigmoid(x @ w["shared.gate_1M"].t()) * y
    return y


def reference_moe(
    xs: list[torch.Tensor],
    weights: dict[str, torch.Tensor],
    config: MoEConfig,
    bias: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Returns (outputs per rank, aux loss per rank). Differentiable in xs and weights."""
    g = config.gate
    E, k = g.num_experts, g.top_k
    ys, auxes = [], []
    for x in xs:
        T = x.shape[0]
        logits = x.float() @ weights["gate_weight"].float().t()
        if "gate_bias" in weights:  # GateConfig.logit_bias
            logits = logits + weights["gate_bias"].float()
        if g.score == "sigmoid":
            score = torch.sigmoid(logits)
            probs = score / score.sum(-1, keepdim=True)  # what the aux loss balances
        else:
            score = probs = torch.softmax(logits, dim=-1)
        choice = torch.tensor([_choose(score[t].tolist(), bias, g) for t in range(T)])
        choice = choice.view(T, k).long()
        w = score.gather(1, choice)
        if g.renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * g.scale
        if g.priority == "score":
            order = sorted(range(T), key=lambda t: -float(score[t].max()))
        else:
            order = list(range(T))
        cap = math.inf if g.dropless else math.ceil(g.capacity_factor * k * T / E)
        # Which (token, choice) pairs keep a slot: first choices of all tokens, then second...
        filled = [0] * E
        kept: list[tuple[int, int, int]] = []  # (token, choice, expert)
        for j in range(k):
            for t in order:
                e = int(choice[t, j])
                if filled[e] < cap:
                    filled[e] += 1
                    kept.append((t, j, e))
        y = torch.zeros(T, x.shape[1], dtype=torch.float32)
        for e in range(E):
            mine = [(t, j) for t, j, ee in kept if ee == e]
            if not mine:
                continue
            xe = x[[t for t, _ in mine]]
            on_input = g.weights_on == "input"  # expert(w x) rather than w expert(x)
            if on_input:
                xe = xe * torch.stack([w[t, j] for t, j in mine])[:, None].to(x.dtype)
            out = _expert(xe, weights, e, config.experts.activation)
            for n, (t, j) in enumerate(mine):
                wt = 1.0 if on_input else w[t, j]
                y = y.index_add(0, torch.tensor([t]), (out[n].float() * wt)[None])
        if config.shared is not None:  # always-on experts, every token, one FFN of num x H
            y = y + _shared(x, weights, config.experts.activation).float()
        ys.append(y.to(x.dtype))
        aux = probs.new_zeros(())
        if T > 0:
            frac = torch.zeros(E)
            for t in range(T):
                for j in range(k):
                    frac[int(choice[t, j])] += 1.0 / (T * k)
            if g.aux_loss_weight > 0:
                aux = aux + g.aux_loss_weight * E * (frac * probs.mean(0)).sum()
            if g.z_loss_weight > 0:
                aux = aux + g.z_loss_weight * (torch.logsumexp(logits, -1) ** 2).mean()
        auxes.append(aux)
    return ys, auxes
