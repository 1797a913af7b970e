"""`fp8`: float8 e4m3 codes with one fp32 scale per row (amax / 448), packed into the row.

Shapes: x [N, M] float -> payload [N, 4 + M] uint8 = [scale as fp32 (4 bytes) | M e4m3 codes]
-> [N, M] dtype. ~4x smaller than fp32. Each row carries its own scale, so the payload splits at
any row. Codes are `torch.float8_e4m3fn` (3 mantissa bits, max 448, no inf).

Error bound, per row with amax = max |x| and s = amax / 448 (rounded to fp32):
    |err| <= max(|x| / 16, s / 1024) + 448 * 2^-150   (plus fp32 rounding, relative 2^-23)
|x| / 16 is e4m3's half step for values the scale maps to normal codes (|x| >= 2^-6 s); s / 1024
is half the subnormal step. The last term only matters when amax < ~5e-36 and s is itself an fp32
subnormal; a row with amax < ~3e-43 decodes to zeros. Zero rows and constant rows (x = c: codes
are all 448, decoded 448 * s) stay within the bound; zero rows are exact.

inf/NaN: a row holding any inf or NaN decodes to all NaN (its scale is stored as NaN), so a loss
scaler still sees the overflow; other rows are unaffected. Finite inputs never overflow (|q| <=
448 by construction); a decode to float16 of values beyond 65504 gives inf, as torch's cast does.
"""

from __future__ import annotations

import torch

from .base import COMPRESSORS
from .rowscaled import RowScaled

__all__ = ["FP8"]

_E4M3_MAX = 448.0


@COMPRESSORS.register("fp8")
class FP8(RowScaled):
    """e4m3 with a per-row fp32 scale; rows with inf/NaN come back all NaN."""

    name = "fp8"
    header = 4  # the row's scale, fp32

    def _encode_into(self, x_nM: torch.Tensor, out_nW: torch.Tensor) -> None:
        # 1. per-row scale; amax propagates NaN and inf, and such rows get a NaN scale.
        amax_n1 = x_nM.abs().amax(dim=1, keepdim=True)
        s_n1 = (amax_n1 / _E4M3_MAX).float()
        s_n1 = torch.where(torch.isfinite(s_n1), s_n1, torch.nan)
        # 2. codes; zero (and underflowed) scales divide by 1, so zero rows encode to zeros.
        q_nM = x_nM / torch.where(s_n1 > 0, s_n1, 1.0)
        # A subnormal scale can round down, pushing |q| a hair past 448: saturate (NaN stays).
        q_nM.clamp_(-_E4M3_MAX, _E4M3_MAX)
        out_nW[:, 4:].view(torch.float8_e4m3fn).copy_(q_nM)
        out_nW[:, :4] = s_n1.view(torch.uint8)

    def _decode(
        self, s_N1: torch.Tensor, codes_NM: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        y_NM = codes_NM.view(torch.float8_e4m3fn).to(torch.float32).mul_(s_N1)
        return y_NM if dtype == torch.float32 else y_NM.to(dtype)
