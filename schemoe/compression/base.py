"""The compression extension point.

A compressor turns rows of activations (or gradients) into rows of bytes of a fixed width, so an
all-to-all can still split the payload by rows and one transfer stays one all-to-all:

    encode: [N, M] float  -> [N, W] uint8   (W = wire_bytes(1, M); scales/offsets packed in the row)
    decode: [N, W] uint8  -> [N, M] dtype   (decode(b, dtype, cols=M))
    wire_bytes(rows, cols, dtype=float32) -> bytes on the wire for a [rows, cols] input of dtype

Because every row is self-contained, decode(encode(x)[a:b]) == decode(encode(x))[a:b]: an
all-to-all may split the payload at any row. Inputs may be float32, bfloat16 or float16 (and
float64, encoded as float32); N = 0 works. Each compressor's docstring states its error bound and
what it does with inf/NaN: the casts round elementwise; the block-scaled ones (fp8, int8, zfp)
turn a row holding any inf or NaN into an all-NaN row, so overflow still reaches a loss scaler.
encode may return a view of its input (fp16 of an fp16 tensor) and decode a view of its payload,
so neither may be written to while the other is in use.

`none` is the exception: it returns its input unchanged (any dtype), so uncompressed runs are
bitwise exact and free; its wire_bytes is the only one that depends on dtype. A compressor never
calls a collective; the scheduler composes them.

To add one:

    from schemoe.compression import COMPRESSORS

    @COMPRESSORS.register("mine")
    class Mine:
        name = "mine"
        lossless = False
        def encode(self, x): ...
        def decode(self, b, dtype, cols): ...
        def wire_bytes(self, rows, cols, dtype=torch.float32): ...

and select it with `MoEConfig(compression=CompressionConfig(forward="mine"))`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..registry import Registry

__all__ = [
    "CHUNK_VALUES",
    "COMPRESSORS",
    "Compressor",
    "check_input",
    "check_payload",
    "payload_floats",
    "row_chunks",
]


@runtime_checkable
class Compressor(Protocol):
    name: str
    lossless: bool

    def encode(self, x: torch.Tensor) -> torch.Tensor: ...

    def decode(self, b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor: ...

    def wire_bytes(self, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> int: ...


# name -> class constructed with no arguments (or the options of CompressionConfig).
COMPRESSORS: Registry[type] = Registry("compressor")


# Encoders run their elementwise steps over row chunks of about this many values, so that their
# fp32 temporaries (~1 MB) stay in cache and are recycled by the allocator: on CPU, whole-payload
# temporaries measured 3-5x slower (fresh pages fault in). On CUDA it costs a few extra launches.
CHUNK_VALUES = 1 << 18


def row_chunks(rows: int, cols: int) -> list[slice]:
    """Row slices covering 0..rows, each about CHUNK_VALUES values (at least one row)."""
    step = max(1, CHUNK_VALUES // max(cols, 1))
    return [slice(a, min(a + step, rows)) for a in range(0, rows, step)]


def check_input(name: str, x: torch.Tensor) -> torch.Tensor:
    """`x` detached, after checking it is a 2-D floating tensor (ValueError/TypeError if not)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{name}.encode expects a 2-D [rows, cols] tensor, got {_shape(x)}")
    if not x.is_floating_point():
        raise TypeError(f"{name}.encode expects a floating tensor, got {x.dtype}")
    return x.detach()


def check_payload(name: str, b: torch.Tensor, width: int) -> None:
    """Raise ValueError unless `b` is a 2-D uint8 payload of `width` bytes per row."""
    if not isinstance(b, torch.Tensor) or b.dim() != 2 or b.dtype != torch.uint8:
        raise ValueError(f"{name}.decode expects a 2-D uint8 payload, got {_shape(b)}")
    if b.shape[1] != width:
        raise ValueError(f"{name}.decode: payload has {b.shape[1]} bytes per row, expected {width}")


def payload_floats(b_NK: torch.Tensor) -> torch.Tensor:
    """[N, 4k] uint8 (a strided slice of a payload, e.g. its scale bytes) -> [N, k] float32.

    Copies first: a row slice of a payload is neither 4-byte strided nor 4-byte aligned."""
    buf_NK = torch.empty(b_NK.shape, dtype=torch.uint8, device=b_NK.device)
    return buf_NK.copy_(b_NK).view(torch.float32)


def _shape(t: object) -> str:
    return f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
