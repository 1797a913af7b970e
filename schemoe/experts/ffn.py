"""Experts: the batched FFN that holds a rank's local experts in one tensor per weight, and a
wrapper that runs a user's own expert modules.

Legend: El local experts, M model dim, H hidden dim, N rows, n rows of one expert.

Both take rows grouped by local expert with `counts[e]` rows for expert e and return the same
shape. BatchedFFN runs its experts as `ExpertConfig.impl` says: "grouped" (one grouped matmul
per projection over all local experts, schemoe.experts.grouped) or "loop" (one matmul per expert
and projection); the weights (w1_EMH, ...) are the same tensors either way, so checkpoints load
into both. Every parameter is marked `schemoe_expert = True` (see `schemoe.layer.parallel`), because expert
weights are sharded over the expert-parallel group and must not be all-reduced with dense weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ExpertConfig
from .grouped import group_mm, group_offsets

__all__ = ["BatchedFFN", "ModuleExperts", "mark_expert"]


def mark_expert(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.schemoe_expert = True
    return module


def _init(t: torch.Tensor, fan_in: int, seeds: Sequence[int]) -> None:
    # Each global expert draws from its own generator, so expert e has the same initial weights
    # whatever the number of ranks (a 4-rank model equals its 1-rank twin).
    bound = 1.0 / math.sqrt(fan_in)
    for i, s in enumerate(seeds):
        g = torch.Generator().manual_seed(s)
        t.data[i].copy_(torch.rand(t.shape[1:], generator=g) * 2 * bound - bound)


class BatchedFFN(nn.Module):
    """y = W2 act(W1 x + b1) + b2 per expert; swiglu: y = W2 (silu(W1 x) * (W3 x)).

    forward(x [N, M], counts) takes rows sorted by local expert (`counts[e]` rows for expert e)
    and returns [N, M]; `cfg.impl` picks one grouped matmul per projection ("grouped") or one
    matmul per expert and projection ("loop"), on the same weights.

    Args:
        cfg: dims, activation and impl.
        num_local: El, experts held by this rank.
        first_expert: global index of the first local expert (for initialisation).
        seed: base seed of the per-expert initialisation.
    """

    def __init__(
        self, cfg: ExpertConfig, num_local: int, first_expert: int = 0, seed: int = 0
    ) -> None:
        super().__init__()
        El, M, H = num_local, cfg.model_dim, cfg.hidden_dim
        self.cfg = cfg
        self.w1_EMH = nn.Parameter(torch.empty(El, M, H))
        self.w2_EHM = nn.Parameter(torch.empty(El, H, M))
        self.w3_EMH = nn.Parameter(torch.empty(El, M, H)) if cfg.activation == "swiglu" else None
        self.b1_EH = nn.Parameter(torch.zeros(El, H)) if cfg.bias else None
        self.b2_EM = nn.Parameter(torch.zeros(El, M)) if cfg.bias else None
        ids = [first_expert + i for i in range(El)]
        _init(self.w1_EMH, M, [seed * 1_000_003 + 3 * e for e in ids])
        _init(self.w2_EHM, H, [seed * 1_000_003 + 3 * e + 1 for e in ids])
        if self.w3_EMH is not None:
            _init(self.w3_EMH, M, [seed * 1_000_003 + 3 * e + 2 for e in ids])
        mark_expert(self)

    def _act(self, h: torch.Tensor, x: torch.Tensor, w3: torch.Tensor | None) -> torch.Tensor:
        """The activation; swiglu gates with x @ w3 (one expert's [M, H] or all [El, M, H])."""
        a = self.cfg.activation
        if a == "relu":
            return F.relu(h)
        if a == "gelu":
            return F.gelu(h)
        return F.silu(h) * torch.matmul(x, w3)

    def forward(self, x_NM: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """y [N, M] for rows x [N, M] sorted by local expert, `counts[e]` rows for expert e."""
        El = self.w1_EMH.shape[0]
        if len(counts) != El:
            raise ValueError(f"counts has {len(counts)} entries for {El} local experts")
        if self.cfg.impl == "grouped":
            return self._grouped(x_NM, counts)
        return self._loop(x_NM, counts)

    def _grouped(self, x_NM: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """One grouped matmul per projection over all local experts (no pad rows)."""
        offs = group_offsets(counts, x_NM.device)  # host ints -> device: no sync
        h = group_mm(x_NM, self.w1_EMH, counts, offs)
        if self.cfg.bias:
            # Row n's expert, to pick its biases; from host ints with output_size: no sync.
            sizes = torch.tensor(list(counts), device=x_NM.device)
            experts = torch.arange(len(counts), device=x_NM.device)
            expert_N = torch.repeat_interleave(experts, sizes, output_size=x_NM.shape[0])
            h = h + self.b1_EH[expert_N]
        if self.w3_EMH is not None:
            a = F.silu(h) * group_mm(x_NM, self.w3_EMH, counts, offs)
        else:
            a = self._act(h, x_NM, None)
        y = group_mm(a, self.w2_EHM, counts, offs)
        if self.cfg.bias:
            y = y + self.b2_EM[expert_N]
        return y

    def _loop(self, x_NM: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """One matmul per expert and projection (bmm when counts are equal on a GPU)."""
        El = self.w1_EMH.shape[0]
        if len(set(counts)) == 1 and x_NM.is_cuda:
            # Equal counts (capacity mode) on a GPU: one bmm over all local experts, one launch.
            # On the CPU the per-expert GEMMs below are as fast or faster (forward + backward,
            # M=256, H=1024, one thread: El=2 109.0 vs 108.8 ms, El=8 107.0 vs 113.6 ms).
            n = counts[0]
            x = x_NM.view(El, n, x_NM.shape[-1])
            h = torch.bmm(x, self.w1_EMH)
            if self.b1_EH is not None:
                h = h + self.b1_EH[:, None]
            y = torch.bmm(self._act(h, x, self.w3_EMH), self.w2_EHM)
            if self.b2_EM is not None:
                y = y + self.b2_EM[:, None]
            return y.reshape(El * n, y.shape[-1])
        # unbind, not w[e]: the backward of unbind stacks the El gradients once, where El
        # selects would each fill and add a whole [El, ...] gradient.
        w1, w2 = self.w1_EMH.unbind(0), self.w2_EHM.unbind(0)
        w3 = self.w3_EMH.unbind(0) if self.w3_EMH is not None else None
        b1 = self.b1_EH.unbind(0) if self.b1_EH is not None else None
        b2 = self.b2_EM.unbind(0) if self.b2_EM is not None else None
        outs = []
        # F.linear on the transposed view, not x @ w: the same products, but its kernels (and
        # its backward's) ran 5% faster here (M=256, H=1024, n=1280: 54.0 vs 57.2 ms fwd+bwd).
        for e, x in enumerate(torch.split(x_NM, list(counts))):
            h = F.linear(x, w1[e].t(), None if b1 is None else b1[e])
            a = self._act(h, x, None if w3 is None else w3[e])
            outs.append(F.linear(a, w2[e].t(), None if b2 is None else b2[e]))
        return torch.cat(outs)


class ModuleExperts(nn.Module):
    """Runs one user module per local expert; each maps [n, M] -> [n, M].

    Args:
        factory: called with the global expert index, returns that expert's module.
        num_local: El, experts on this rank; first_expert: global index of the first.
    """

    def __init__(
        self, factory: Callable[[int], nn.Module], num_local: int, first_expert: int = 0
    ) -> None:
        super().__init__()
        self.first_expert = first_expert
        self.experts = nn.ModuleList(factory(first_expert + i) for i in range(num_local))
        for m in self.experts:
            if not isinstance(m, nn.Module):
                raise TypeError(f"expert factory must return nn.Module, got {type(m).__name__}")
        mark_expert(self)

    def forward(self, x_NM: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        if len(counts) != len(self.experts):
            raise ValueError(f"counts has {len(counts)} entries for {len(self.experts)} experts")
        parts = torch.split(x_NM, list(counts))
        outs = []
        for i, (m, x) in enumerate(zip(self.experts, parts)):
            y = m(x)
            if not isinstance(y, torch.Tensor) or y.shape != x.shape:
                got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
                raise ValueError(
                    f"expert {self.first_expert + i} ({type(m).__name__}) must map [n, M] -> "
                    f"[n, M]: given {tuple(x.shape)}, it returned {got}"
                )
            outs.append(y)
        return torch.cat(outs)
