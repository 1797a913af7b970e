"""Shared body of the byte codecs with per-row fp32 metadata (fp8, int8).

Each payload row is `header` bytes of fp32 metadata (scales, offsets) followed by one code byte
per value: x [N, M] float -> payload [N, header + M] uint8 -> [N, M] dtype. A subclass states
`name` and `header` and supplies two functions of one row chunk:

    _encode_into(x_nM, out_nW)   x_nM is float32 (float64 stays float64), M >= 1; writes the row's
                                 metadata bytes and codes into out_nW [n, header + M]
    _decode(meta_NK, codes_NM, dtype) -> [N, M] dtype, meta_NK the header as K = header / 4 fp32
"""

from __future__ import annotations

import torch

from .base import check_input, check_payload, payload_floats, row_chunks

__all__ = ["RowScaled"]


class RowScaled:
    """encode/decode/wire_bytes for `header` fp32-metadata bytes plus one byte per value."""

    name = ""
    lossless = False
    header = 0

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[N, M] float -> [N, header + M] uint8; with M = 0 the metadata bytes are zeros."""
        x_NM = check_input(self.name, x)
        n, m = x_NM.shape
        out_NW = torch.empty(n, self.header + m, dtype=torch.uint8, device=x.device)
        if m == 0:
            return out_NW.zero_()
        for rows in row_chunks(n, m):
            x_nM = x_NM[rows]
            self._encode_into(x_nM if x_nM.dtype == torch.float64 else x_nM.float(), out_NW[rows])
        return out_NW

    def decode(self, b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
        """[N, header + cols] uint8 -> [N, cols] dtype."""
        check_payload(self.name, b, self.wire_bytes(1, cols))
        return self._decode(payload_floats(b[:, : self.header]), b[:, self.header :], dtype)

    def wire_bytes(self, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> int:
        """`header` metadata bytes plus one byte per value, per row, whatever the input dtype."""
        return rows * (self.header + cols)

    def _encode_into(self, x_nM: torch.Tensor, out_nW: torch.Tensor) -> None:
        raise NotImplementedError

    def _decode(
        self, meta_NK: torch.Tensor, codes_NM: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        raise NotImplementedError
