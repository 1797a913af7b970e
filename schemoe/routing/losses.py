"""Router losses and the aux-loss-free balancing bias, as pure functions.

Shapes: T tokens, E experts, k choices per token.
"""

from __future__ import annotations

import torch

__all__ = ["choice_fractions", "load_balancing_loss", "router_z_loss", "update_balance_bias"]


def load_balancing_loss(probs_TE: torch.Tensor, expert_TK: torch.Tensor) -> torch.Tensor:
    """GShard / Switch load-balancing loss: E * sum_e f_e * P_e.

    f_e is the fraction of the T*k routing choices that picked expert e (before capacity drops),
    P_e the mean router probability of e. For k = 1 this is exactly the Switch Transformer loss
    (Fedus et al. 2021, eq. 4); for k > 1 every choice counts, as in GShard's top-2 and in
    Hugging Face's Mixtral `load_balancing_loss_func` up to its factor k. It is 1 at perfect balance.
    Returns 0 for an empty batch.
    """
    T, E = probs_TE.shape
    if T == 0:
        return probs_TE.sum() * 0.0
    return E * torch.sum(choice_fractions(probs_TE, expert_TK) * probs_TE.mean(0))


def choice_fractions(probs_TE: torch.Tensor, expert_TK: torch.Tensor) -> torch.Tensor:
    """f_E: the fraction of the T k routing choices that picked each expert (no gradient)."""
    counts_E = torch.zeros(probs_TE.shape[1], device=probs_TE.device, dtype=probs_TE.dtype)
    counts_E.index_add_(
        0, expert_TK.reshape(-1), torch.ones_like(expert_TK, dtype=probs_TE.dtype).reshape(-1)
    )
    return counts_E / expert_TK.numel()


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss (Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)^2."""
    if logits_TE.shape[0] == 0:
        return logits_TE.sum() * 0.0
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def update_balance_bias(bias_E: torch.Tensor, load_E: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing (DeepSeek-V3, Wang et al. 2024): b_e += rate * sign(mean load - load_e).

    Overloaded experts get their selection bias lowered, underloaded ones raised. The bias only
    affects which experts are chosen, never the combine weights. Returns the new bias.
    """
    load_E = load_E.to(bias_E.dtype)
    return bias_E + rate * torch.sign(load_E.mean() - load_E)
