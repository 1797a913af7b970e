"""`int8`: per-row min-max quantisation to 8-bit codes, rounded to nearest, min and scale in the row.

Shapes: x [N, M] float -> payload [N, 8 + M] uint8 = [min as fp32 | scale as fp32 | M codes]
-> [N, M] dtype, decoded as min + code * scale with scale = (max - min) / 255. ~4x smaller than
fp32. The paper's INT8 sent scales and offsets as separate tensors (three all-to-alls); here they
ride in the row, so the payload splits at any row and one transfer is one all-to-all.

Error bound, per row (eps = 2^-24, fp32's unit roundoff):
    |err| <= (max - min) / 255 / 2 * (1 + 2^-13) + 4 eps * max(|min|, |max|)
i.e. half a quantisation step, plus the rounding of the fp32 arithmetic. Constant rows (zero rows
included) are exact: their scale is 0 and every value decodes to the stored min.

inf/NaN: a row holding any inf or NaN decodes to all NaN (min and scale are stored as NaN), so a
loss scaler still sees the overflow; other rows are unaffected. So does a row whose range max -
min overflows fp32 (only possible when |x| > ~1.7e38). A decode to float16 of values beyond 65504
gives inf, as torch's cast does.
"""

from __future__ import annotations

import torch

from .base import COMPRESSORS
from .rowscaled import RowScaled

__all__ = ["INT8"]

_LEVELS = 255.0


@COMPRESSORS.register("int8")
class INT8(RowScaled):
    """Per-row min-max uint8 codes; constant rows exact; rows with inf/NaN come back all NaN."""

    name = "int8"
    header = 8  # the row's min and scale, fp32 each

    def _encode_into(self, x_nM: torch.Tensor, out_nW: torch.Tensor) -> None:
        # 1. per-row offset and step; min/max propagate NaN, and inf gives a non-finite step.
        lo_n1, hi_n1 = torch.aminmax(x_nM, dim=1, keepdim=True)
        step_n1 = ((hi_n1 - lo_n1) / _LEVELS).float()
        bad_n1 = ~torch.isfinite(step_n1)
        lo_n1 = torch.where(bad_n1, torch.nan, lo_n1.float())
        step_n1 = torch.where(bad_n1, torch.nan, step_n1)
        # 2. codes: (x - min) / step lies in [0, 255 (1 + 2^-22)], so rounding lands in 0..255
        # with no clamp; constant rows (step 0) and bad rows divide by 1 instead. Bad rows compute
        # NaN codes and NaN -> uint8 is undefined, so zero them (no host sync).
        q_nM = torch.sub(x_nM, lo_n1).div_(torch.where(step_n1 > 0, step_n1, 1.0)).round_()
        q_nM.nan_to_num_(0.0, 0.0, 0.0)
        out_nW[:, 8:].copy_(q_nM)
        out_nW[:, :8] = torch.cat([lo_n1, step_n1], dim=1).view(torch.uint8)

    def _decode(
        self, meta_N2: torch.Tensor, codes_NM: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        lo_N1, step_N1 = meta_N2[:, :1], meta_N2[:, 1:]
        if dtype == torch.float32:
            return torch.addcmul(lo_N1, codes_NM, step_N1)
        y_NM = torch.empty(codes_NM.shape, dtype=dtype, device=codes_NM.device)
        return torch.addcmul(lo_N1, codes_NM, step_N1, out=y_NM)  # computed in fp32, one cast
