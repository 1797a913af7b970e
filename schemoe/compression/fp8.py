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

from .base import COMPRESSORS, check_input, check_payload, payload_floats, row_chunks

__all__ = ["FP8"]

_E4M3_MAX = 448.0


@COMPRESSORS.register("fp8")
class FP8:
    """e4m3 with a per-row fp32 scale; rows with inf/NaN come back all NaN."""

    name = "fp8"
    lossless = False

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[N, M] float -> [N, 4 + M] uint8."""
        x_NM = check_input(self.name, x)
        n, m = x_NM.shape
        out_NW = torch.empty(n, 4 + m, dtype=torch.uint8, device=x.device)
        for rows in row_chunks(n, m):
            _encode_into(x_NM[rows], out_NW[rows])
        return out_NW

    def decode(self, b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
        """[N, 4 + cols] uint8 -> [N, cols] dtype."""
        check_payload(self.name, b, self.wire_bytes(1, cols))
        s_N1 = payload_floats(b[:, :4])
        y_NM = b[:, 4:].view(torch.float8_e4m3fn).to(torch.float32).mul_(s_N1)
        return y_NM if dtype == torch.float32 else y_NM.to(dtype)

    def wire_bytes(self, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> int:
        """4 scale bytes plus one byte per value, per row, whatever the input dtype."""
        return rows * (4 + cols)


def _encode_into(x_nM: torch.Tensor, out_nW: torch.Tensor) -> None:
    """Encode one row chunk [n, M] into its payload rows [n, 4 + M]."""
    if x_nM.dtype != torch.float64:
        x_nM = x_nM.float()
    n, m = x_nM.shape
    # 1. per-row scale; amax propagates NaN and inf, and such rows get a NaN scale.
    amax_n1 = x_nM.abs().amax(dim=1, keepdim=True) if m else x_nM.new_zeros(n, 1)
    s_n1 = (amax_n1 / _E4M3_MAX).float()
    s_n1 = torch.where(torch.isfinite(s_n1), s_n1, torch.nan)
    # 2. codes; zero (and underflowed) scales divide by 1, so zero rows encode to zeros.
    q_nM = x_nM / torch.where(s_n1 > 0, s_n1, 1.0)
    # A subnormal scale can round down, pushing |q| a hair past 448: saturate (NaN stays).
    q_nM.clamp_(-_E4M3_MAX, _E4M3_MAX)
    out_nW[:, 4:].view(torch.float8_e4m3fn).copy_(q_nM)
    out_nW[:, :4] = s_n1.view(torch.uint8)
