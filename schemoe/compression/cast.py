"""`fp16` and `bf16`: cast each value to 16 bits; the row's bytes are the 16-bit values' bytes.

Shapes: x [N, M] float -> payload [N, 2M] uint8 -> [N, M] dtype. No per-row metadata, so every
row is independently decodable and the payload splits at any row. 2x smaller than fp32; an input
already in the target dtype goes through without a copy (the payload aliases it).

Error bounds (round to nearest even, |x| the input value):
    fp16: |err| <= 2^-11 |x| for normal results (|x| >= 2^-14 ~ 6.1e-5), and |err| <= 2^-25
          below that (subnormal spacing 2^-24; |x| <= 2^-25 becomes 0).
    bf16: |err| <= 2^-8 |x| for normal results (|x| >= 2^-126), |err| <= 2^-134 below.
A decode to a dtype other than the wire's rounds once more, as torch's cast does.

inf/NaN and overflow, elementwise:
    fp16: IEEE rounding: finite values with |x| >= 65520 (past 65504 by half a step or more)
          become +-inf, as torch's cast does; +-inf stays +-inf and NaN stays NaN. Overflow is
          never saturated to a finite value: a gradient scaled past fp16's range must reach the
          loss scaler as inf (found_inf), or the scaler would step on a wrong gradient and never
          back off.
    bf16: bf16 has fp32's exponent range; inf and NaN stay as they are, and only finite fp32
          values within half a bf16 step of fp32's maximum (|x| >= ~3.3962e38) round to inf,
          as IEEE rounding does.
"""

from __future__ import annotations

import torch

from .base import COMPRESSORS, check_input, check_payload

__all__ = ["BF16", "FP16"]


class _Cast:
    """Shared body of the casts: `wire` is the 16-bit dtype on the wire."""

    name = ""
    lossless = False
    wire = torch.float16

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[N, M] float -> [N, 2M] uint8 (the 16-bit values' bytes, native byte order)."""
        x_NM = check_input(self.name, x)
        if x_NM.dtype == self.wire:
            return x_NM.contiguous().view(torch.uint8)
        n, m = x_NM.shape
        out_NW = torch.empty(n, 2 * m, dtype=torch.uint8, device=x.device)
        self._cast_into(x_NM, out_NW.view(self.wire))
        return out_NW

    def _cast_into(self, x_NM: torch.Tensor, y_NM: torch.Tensor) -> None:
        y_NM.copy_(x_NM)  # round to nearest even, no temporaries

    def decode(self, b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
        """[N, 2 cols] uint8 -> [N, cols] dtype (aliases `b` when dtype is the wire dtype)."""
        check_payload(self.name, b, self.wire_bytes(1, cols))
        y_NM = b.contiguous().view(self.wire)
        return y_NM if dtype == self.wire else y_NM.to(dtype)

    def wire_bytes(self, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> int:
        """2 bytes per value, whatever the input dtype."""
        return 2 * rows * cols


@COMPRESSORS.register("fp16")
class FP16(_Cast):
    """IEEE half precision; finite overflow becomes inf, inf and NaN are kept."""

    name = "fp16"
    wire = torch.float16


@COMPRESSORS.register("bf16")
class BF16(_Cast):
    """bfloat16: fp32's range with an 8-bit significand; inf and NaN are kept."""

    name = "bf16"
    wire = torch.bfloat16
