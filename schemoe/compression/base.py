"""The compression extension point.

A compressor turns rows of activations (or gradients) into rows of bytes of a fixed width, so an
all-to-all can still split the payload by rows and one transfer stays one all-to-all:

    encode: [N, M] float  -> [N, W] uint8   (W = wire_bytes(1, M); scales/offsets packed in the row)
    decode: [N, W] uint8  -> [N, M] dtype

`none` is the exception: it returns its input unchanged (any dtype), so uncompressed runs are
bitwise exact and free. A compressor never calls a collective; the scheduler composes them.

To add one:

    from schemoe.compression import COMPRESSORS

    @COMPRESSORS.register("mine")
    class Mine:
        name = "mine"
        lossless = False
        def encode(self, x): ...
        def decode(self, b, dtype, cols): ...
        def wire_bytes(self, rows, cols): ...

and select it with `MoEConfig(compression=CompressionConfig(forward="mine"))`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..registry import Registry

__all__ = ["Compressor", "COMPRESSORS"]


@runtime_checkable
class Compressor(Protocol):
    name: str
    lossless: bool

    def encode(self, x: torch.Tensor) -> torch.Tensor: ...

    def decode(self, b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor: ...

    def wire_bytes(self, rows: int, cols: int) -> int: ...


# name -> class constructed with no arguments (or the options of CompressionConfig).
COMPRESSORS: Registry[type] = Registry("compressor")
