"""`none`: the payload goes as it is (bitwise exact, no copy; any dtype)."""

from __future__ import annotations

import torch

from .base import COMPRESSORS

__all__ = ["NoCompression"]


@COMPRESSORS.register("none")
class NoCompression:
    """Identity: encode returns its input (aliased, not copied), decode casts only if asked."""

    name = "none"
    lossless = True

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def decode(self, b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
        return b if b.dtype == dtype else b.to(dtype)

    def wire_bytes(self, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> int:
        return rows * cols * dtype.itemsize
