"""One matmul for all local experts: rows sorted by expert, each group times its own weight.

Legend: El local experts (groups), N rows, K inner dim, J output dim.

    y_NJ = group_mm(x_NK, w_EKJ, counts)    # y[rows of e] = x[rows of e] @ w[e]

Rows arrive sorted by local expert: the dispatch buffer is expert-major, and the chunk plan's
`perm` (schemoe.routing.layout.build_plan) regroups the rows an all-to-all delivers stacked by
source rank into expert order before the expert task runs, so expert e owns rows
[offs[e-1], offs[e]) with `counts[e]` rows.

Kernel: `torch._grouped_mm(x_NK, w_EKJ, offs)` where the build has it, with `offs` the int32
running sum of `counts` (the end row of each group, last entry N). What it needs (checked on
torch 2.13's CPU build; its CUDA kernel checks the same static-dimension alignment):
  * dtype float32, bfloat16 or float16;
  * 16-byte aligned row strides: K and J multiples of 16 / itemsize (4 in fp32, 8 in bf16);
  * int32 offsets ending at N (the kernel leaves rows past offs[-1] unwritten).

Padding rule: none along the rows. Groups of any size, 0 and 1 included, go to the kernel as they
are (it checks alignment along the static dimensions K and J only), so no pad row is added or
dropped; capacity mode's buffers already hold C rows per expert (unused rows zero), dropless
buffers exactly the routed rows. Shapes the kernel cannot take (K or J not aligned, float64, no
kernel for the device or dtype) run `loop_mm`, the same products group by group, which is
bitwise identical to the kernel on this build, forward and backward (tests/test_experts.py).

Whether the kernel exists is found once per (device type, dtype) by calling it on a tiny input:
for the CPU at import, for other devices at their first call (not at import, which must not
initialise CUDA). Never from an environment variable.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["GROUPED_DTYPES", "group_mm", "group_offsets", "grouped_kernel", "loop_mm"]

GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KERNEL = getattr(torch, "_grouped_mm", None)
_PROBED: dict[tuple[str, torch.dtype], bool] = {}


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs on (device, dtype) and agrees with the loop on a tiny
    case (within rounding: another device's kernel may sum in another order)."""
    if _KERNEL is None or dtype not in GROUPED_DTYPES:
        return False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=g).to(device, dtype)
    w = torch.randn(2, 8, 8, generator=g).to(device, dtype)
    offs = torch.tensor([1, 3], dtype=torch.int32, device=device)
    try:
        y = _KERNEL(x, w, offs)
    except (RuntimeError, NotImplementedError):
        return False
    # host sync, once per (device, dtype) for the process: the answer decides the code path
    return bool(torch.allclose(y.float(), loop_mm(x, w, (1, 2)).float(), rtol=2e-2, atol=2e-2))


def grouped_kernel(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether `group_mm` can use torch's grouped kernel on (device, dtype) (probed once)."""
    key = (torch.device(device).type, dtype)
    if key not in _PROBED:
        _PROBED[key] = _probe(torch.device(device), dtype)
    return _PROBED[key]


def group_offsets(counts: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """int32 [El] end row of each group (the running sum of `counts`), built from host ints:
    a host-to-device copy, no sync."""
    ends, total = [], 0
    for c in counts:
        total += int(c)
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def _aligned(x: torch.Tensor, w: torch.Tensor) -> bool:
    step = 16 // x.element_size()
    return x.shape[-1] % step == 0 and w.shape[-1] % step == 0


def loop_mm(x_NK: torch.Tensor, w_EKJ: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """The fallback: [N, J] with y[rows of e] = x[rows of e] @ w[e], one matmul per group."""
    # unbind, not w[e]: its backward stacks the El weight gradients once, where El selects
    # would each fill and add a whole [El, K, J] gradient.
    ws = w_EKJ.unbind(0)
    parts = [x @ ws[e] for e, x in enumerate(torch.split(x_NK, list(counts)))]
    if not parts:
        return x_NK.new_zeros((x_NK.shape[0], w_EKJ.shape[-1]))
    return torch.cat(parts)


def group_mm(
    x_NK: torch.Tensor,
    w_EKJ: torch.Tensor,
    counts: Sequence[int],
    offs: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [N, J]: each expert's rows of x [N, K] times its weight w [El, K, J].

    Args:
        x_NK: rows sorted by expert, `counts[e]` rows for expert e (sum(counts) == N).
        w_EKJ: one [K, J] weight per expert.
        counts: El host ints.
        offs: `group_offsets(counts, x.device)`, if the caller already built it (reused across
            projections); built here otherwise.

    Differentiable in x and w. One `torch._grouped_mm` where the kernel takes the shapes (see
    the module docstring), else `loop_mm`; the two give identical results.
    """
    assert len(counts) == w_EKJ.shape[0], "one count per expert"
    if (
        x_NK.dtype == w_EKJ.dtype
        and _aligned(x_NK, w_EKJ)
        and grouped_kernel(x_NK.device, x_NK.dtype)
    ):
        if offs is None:
            offs = group_offsets(counts, x_NK.device)
        return _KERNEL(x_NK.contiguous(), w_EKJ, offs)
    return loop_mm(x_NK, w_EKJ, counts)


for _dt in GROUPED_DTYPES:  # the CPU's answer at import (a few microseconds each)
    grouped_kernel("cpu", _dt)
