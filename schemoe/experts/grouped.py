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
bitwise identical to the kernel on this build, forward and backward (tests/test_experts.py); on
CUDA, equal groups (capacity mode) run one bmm instead (one launch, rounding as the GEMM's).

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
    """Whether `torch._grouped_mm` runs on (device, dtype); on the CPU also that it agrees with
    the loop. Built on the device (no host-to-device copy) and, off the CPU, nothing read back:
    the first call may run under torch.cuda.set_sync_debug_mode("error")."""
    if _KERNEL is None or dtype not in GROUPED_DTYPES:
        return False
    x = torch.linspace(-1, 1, 24, device=device, dtype=dtype).view(3, 8)
    w = torch.linspace(-1, 1, 128, device=device, dtype=dtype).view(2, 8, 8)
    offs = torch.arange(1, 4, 2, dtype=torch.int32, device=device)  # groups of 1 and 2 rows
    try:
        y = _KERNEL(x, w, offs)
    except (RuntimeError, NotImplementedError):
        return False
    return device.type != "cpu" or torch.equal(y, loop_mm(x, w, (1, 2)))


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
    if x_NK.is_cuda and len(set(counts)) == 1:
        # CUDA-only: equal groups (capacity mode) as one bmm, one launch, as the loop impl does.
        El, n = len(counts), counts[0]
        return torch.bmm(x_NK.view(El, n, x_NK.shape[-1]), w_EKJ).reshape(El * n, -1)
    return loop_mm(x_NK, w_EKJ, counts)


for _dt in GROUPED_DTYPES:  # the CPU's answer at import (a few microseconds each)
    grouped_kernel("cpu", _dt)
