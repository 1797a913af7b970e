"""`zfp`: fixed-rate ZFP (Lindstrom 2014) through the optional `zfpy` package, one stream per row.

Shapes: x [N, M] float -> payload [N, W] uint8 -> [N, M] dtype, W = Mp * rate / 8 where Mp is M
rounded up to whole 4-value blocks (and to whole bytes per row). rate is in bits per value:
`ZFP(rate=8)` (the default, as in the paper) is 4x smaller than fp32.

Why rows split: the [N, Mp] array is compressed as one 1-D array, so ZFP's 4-value blocks never
straddle two rows; in fixed-rate mode every block takes exactly 4 * rate bits, blocks are coded
independently, and with no header (write_header=False) the stream is the blocks back to back,
least significant bit first. So row i is exactly bytes [i W, (i + 1) W) of the stream, and any
run of rows decodes alone (padded to zfp's 64-bit words). Measured with zfpy 1.0.1; it assumes a
little-endian host, as zfp's bit stream does. Padding columns repeat the row's last value.

Error bound: fixed-rate ZFP has no hard bound. Measured on 8192 x 1024 rows: the worst row's max
|err| as a fraction of that row's max |x|, and the RMS error over the RMS value:

    rate   gaussian   gelu(gaussian)   layer-normed   smooth (sines)   RMS (smooth)
       8    0.16         0.15             0.16           0.016         0.055 (0.0027)
      12    0.011        0.0089           0.0095         0.00086       0.0034 (0.00012)
      16    0.00062      0.00072          0.00060        0.00005       0.00021 (0.000007)

tests/test_compression.py checks rate 8 against 0.25 (any data) and 0.03 (smooth), rate 16
against 0.002. The error of a value is relative to the max of its 4-value block, not of the row,
so small values next to large ones lose the most. Add 2^-98 (~3e-30) absolute: zfp's fp32 path
cannot scale blocks whose max is below 2^-98 (its 2^(30 - e) factor overflows fp32 and the block
decodes to garbage of that size), so values with |x| < 2^-98 are flushed to 0. Rates below 8 are allowed (down to 2.25, the
smallest zfp codes for fp32) but their errors reach the size of the values.

inf/NaN: a row holding any inf or NaN decodes to all NaN, and so does one holding any |x| >= 2^127
(~1.7e38): such a row is encoded as a row of fp32's max, whose first block's exponent field (255)
no other row can have, and decode checks that field. Other rows are unaffected. Finite values
just below 2^127 may still decode to +-inf at low rates (the reconstruction can overshoot).

Runs on the host: CUDA tensors are copied to the host and back (a host-device sync), and rows
are compressed in chunks on torch.get_num_threads() threads (zfpy releases the GIL).
"""

from __future__ import annotations

import math
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .base import COMPRESSORS, check_input, check_payload

__all__ = ["ZFP"]

_BAD = 2.0**127  # |x| at or above this has zfp's largest exponent code, the NaN-row marker
_TINY = 2.0**-98  # zfp's fp32 path overflows its block scale 2^(30 - e) for smaller block maxima
_CHUNK_VALUES = 1 << 18  # values per thread task, so small payloads stay on one thread


@COMPRESSORS.register("zfp")
class ZFP:
    """Fixed-rate ZFP, `rate` bits per value (4 * rate must be an integer in 9..128)."""

    name = "zfp"
    lossless = False

    def __init__(self, rate: float = 8) -> None:
        try:
            import zfpy
        except ImportError as e:
            raise ImportError("the zfp compressor needs zfpy: pip install 'schemoe[zfp]'") from e
        if isinstance(rate, bool) or not isinstance(rate, (int, float)):
            raise TypeError(f"zfp rate must be a number of bits per value, got {rate!r}")
        if sys.byteorder != "little":
            raise RuntimeError(
                "the zfp compressor slices zfp's bit stream by bytes: little-endian only"
            )
        bits = 4 * rate
        if not (9 <= bits <= 128 and float(bits).is_integer()):
            raise ValueError(f"zfp rate must be in 2.25..32 with 4 * rate an integer, got {rate}")
        self._zfpy = zfpy
        self.rate = float(rate)
        self._block_bits = int(bits)
        # Blocks per row must fill whole bytes: pad columns to `_unit` values.
        self._unit = 4 * (8 // math.gcd(self._block_bits, 8))

    def _padded(self, cols: int) -> int:
        return -(-cols // self._unit) * self._unit

    def _width(self, cols: int) -> int:
        return self._padded(cols) // 4 * self._block_bits // 8

    def wire_bytes(self, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> int:
        """rate / 8 bytes per (padded) value, whatever the input dtype."""
        return rows * self._width(cols)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[N, M] float -> [N, W] uint8."""
        x_NM = check_input(self.name, x).to("cpu", torch.float32)  # host copy: a sync on CUDA
        n, m = x_NM.shape
        mp, w = self._padded(m), self._width(m)
        if n == 0 or m == 0:
            return torch.empty(n, w, dtype=torch.uint8, device=x.device)
        a_NM = x_NM.abs()
        bad_N = ~(a_NM.amax(dim=1) < _BAD)  # NaN compares false, so NaN rows are bad too
        x_NM = x_NM.masked_fill(a_NM < _TINY, 0.0)  # a copy: the input stays as it is
        if bad_N.any():
            x_NM[bad_N] = torch.finfo(torch.float32).max
        if mp > m:
            x_NM = torch.cat([x_NM, x_NM[:, -1:].expand(n, mp - m)], dim=1)
        x_np = x_NM.contiguous().numpy()
        out_np = np.empty((n, w), dtype=np.uint8)

        def run(r0: int, r1: int) -> None:
            s = self._zfpy.compress_numpy(x_np[r0:r1].reshape(-1), rate=self.rate,
                                          write_header=False)  # fmt: skip
            out_np[r0:r1] = np.frombuffer(s, dtype=np.uint8, count=(r1 - r0) * w).reshape(-1, w)

        self._parallel(run, n, mp)
        return torch.from_numpy(out_np).to(x.device)

    def decode(self, b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
        """[N, W] uint8 -> [N, cols] dtype."""
        w = self._width(cols)
        check_payload(self.name, b, w)
        n, mp = b.shape[0], self._padded(cols)
        if n == 0 or cols == 0:
            return torch.empty(n, cols, dtype=dtype, device=b.device)
        b_np = b.cpu().contiguous().numpy()  # host copy: a sync on CUDA
        y_np = np.empty((n, mp), dtype=np.float32)

        def run(r0: int, r1: int) -> None:
            size = (r1 - r0) * w
            buf = np.zeros(size + (-size % 8) + 8, dtype=np.uint8)  # whole 64-bit words, + 1
            buf[:size] = b_np[r0:r1].reshape(-1)
            self._zfpy._decompress(buf, self._zfpy.type_float, [(r1 - r0) * mp],
                                   out=y_np[r0:r1].reshape(-1), rate=self.rate)  # fmt: skip

        self._parallel(run, n, mp)
        # The marker: first block nonzero (bit 0) with exponent field (bits 1..8) 255.
        bad_N = (b_np[:, 0] == 0xFF) & ((b_np[:, 1] & 1) == 1)
        y_np[bad_N] = np.nan
        y_NM = torch.from_numpy(y_np)[:, :cols]
        return y_NM.to(device=b.device, dtype=dtype).contiguous()

    @staticmethod
    def _parallel(fn, rows: int, cols: int) -> None:
        """fn(r0, r1) over row chunks, on up to torch.get_num_threads() threads."""
        tasks = min(torch.get_num_threads(), rows, -(-rows * cols // _CHUNK_VALUES))
        if tasks <= 1:
            fn(0, rows)
            return
        edges = [rows * i // tasks for i in range(tasks + 1)]
        with ThreadPoolExecutor(tasks) as pool:
            list(pool.map(fn, edges[:-1], edges[1:]))  # list() re-raises a task's exception
