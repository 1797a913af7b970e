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
    fp16: finite values beyond fp16's range (|x| > 65504) saturate to +-65504; +-inf stays
          +-inf and NaN stays NaN, so real overflow still reaches a loss scaler.
    bf16: bf16 has fp32's exponent range; inf and NaN stay as they are, and only finite fp32
          values within half a bf16 step of fp32's maximum (|x| >= ~3.3962e38) round to inf,
          as IEEE rounding does.
"""

from __future__ import annotations

import torch

from .base import COMPRESSORS, check_input, check_payload

__all__ = ["FP16", "BF16"]

_FP16_MAX = torch.finfo(torch.float16).max  # 65504


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
        out_NW = torch.empty(x_NM.shape[0], 2 * x_NM.shape[1], dtype=torch.uint8, device=x.device)
        out_NW.view(self.wire).copy_(self._prepare(x_NM))
        return out_NW

    def _prepare(self, x_NM: torch.Tensor) -> torch.Tensor:
        return x_NM

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
    """IEEE half precision; finite overflow saturates to +-65504, inf and NaN are kept."""

    name = "fp16"
    wire = torch.float16

    def _prepare(self, x_NM: torch.Tensor) -> torch.Tensor:
        # clamp() would also turn +-inf into +-65504; x - clamp(x, +-its dtype's max) is 0 for
        # finite x and +-inf (or NaN) otherwise, so adding it back restores inf without a mask
        # (bool masks cost more than the two clamps on CPU).
        if x_NM.dtype != torch.float64:
            x_NM = x_NM.float()
        big = torch.finfo(x_NM.dtype).max
        keep = torch.clamp(x_NM, -big, big)
        torch.sub(x_NM, keep, out=keep)
        return keep.add_(torch.clamp(x_NM, -_FP16_MAX, _FP16_MAX))


@COMPRESSORS.register("bf16")
class BF16(_Cast):
    """bfloat16: fp32's range with an 8-bit significand; inf and NaN are kept."""

    name = "bf16"
    wire = torch.bfloat16
