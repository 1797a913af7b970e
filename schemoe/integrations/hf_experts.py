"""Expert modules for Hugging Face families whose experts are not MoELayer's built-in swiglu FFN;
MoELayer runs them through its `expert_factory` (one module per local expert).

Legend: M model dim, I expert intermediate size, n rows of one expert.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["GptOssExpert"]


class GptOssExpert(nn.Module):
    """One GPT-OSS expert, as transformers 5.25 computes it (GptOssExperts):

        h = x gate_up_proj + gate_up_proj_bias        [n, 2I], gate and up interleaved
        gate = min(h[:, 0::2], limit), up = clamp(h[:, 1::2], -limit, limit)
        y = ((up + 1) * gate * sigmoid(alpha * gate)) down_proj + down_proj_bias

    Weights in the family's layout (row e of its [E, ...] tensors): gate_up_proj [M, 2I],
    gate_up_proj_bias [2I], down_proj [I, M], down_proj_bias [M]. forward(x [n, M]) -> [n, M].
    """

    def __init__(self, model_dim: int, inter: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.zeros(model_dim, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(2 * inter))
        self.down_proj = nn.Parameter(torch.zeros(inter, model_dim))
        self.down_proj_bias = nn.Parameter(torch.zeros(model_dim))

    def forward(self, x_nM: torch.Tensor) -> torch.Tensor:
        h = x_nM @ self.gate_up_proj + self.gate_up_proj_bias
        gate = h[..., ::2].clamp(min=None, max=self.limit)
        up = h[..., 1::2].clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return ((up + 1) * glu) @ self.down_proj + self.down_proj_bias

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"
