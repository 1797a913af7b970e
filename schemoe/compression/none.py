"""`none`: the payload goes as it is (bitwise exact, no copy)."""

from __future__ import annotations

import torch

from .base import COMPRESSORS

__all__ = ["NoCompression"]


@COMPRESSORS.register("none")
class NoCompression:
    name = "none"
    lossless = True

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def decode(self, b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
        return b if b.dtype == dtype else b.to(dtype)

    def wire_bytes(self, rows: int, cols: int, itemsize: int = 4) -> int:
        return rows * cols * itemsize
