"""Compressor throughput, size and error on realistic activations, one process.

For every registered compressor (zfp only if zfpy imports): encode and decode throughput in GB/s
of the uncompressed fp32 input (median over --repeats, candidates interleaved A B C A B C ...
after --warmup rounds, by the shared `output.measure`), ratio = input bytes / wire bytes, and the
max abs and RMS error of decode(encode(x)) against x. The activations are [rows, cols] fp32:
half GELU of gaussians (an expert's hidden layer), half layer-normed rows with a few outlier
channels (the hidden state an MoE layer dispatches).

    python -m schemoe.bench.compress --rows 8192 --cols 1024     # or: schemoe bench compress
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..cliargs import Check, Parser, for_flag, names
from ..compression import COMPRESSORS, Compressor, build
from ..dist.timing import measure
from . import output

__all__ = ["CHECKS", "activations", "add_arguments", "main", "run"]

# Each flag's range, checked right after parsing (cliargs.Parser.add_checks), beyond
# cliargs.FLAG_CHECKS (--repeats, --warmup).
CHECKS = {"--rows": Check(1), "--cols": Check(1), "--compressors": Check()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=8192, help="rows (tokens) of the payload")
    p.add_argument("--cols", type=int, default=1024, help="values per row (model dim)")
    p.add_argument("--repeats", type=int, default=10, help="timed rounds (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument(
        "--compressors",
        type=names,
        default=None,
        help=f"comma-separated, default all of: {', '.join(COMPRESSORS.names())}",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the codecs run (default: cuda if available)")  # fmt: skip


def activations(rows: int, cols: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[rows, cols] fp32: GELU of gaussians, then layer-normed rows with outlier channels."""
    g = torch.Generator().manual_seed(0)
    half = rows // 2
    gelu_HM = F.gelu(torch.randn(half, cols, generator=g) * 2)
    gamma_M = 1 + 0.2 * torch.randn(cols, generator=g)
    gamma_M[: max(1, cols // 256)] = 20.0
    ln_HM = F.layer_norm(torch.randn(rows - half, cols, generator=g) * 3 + 1, (cols,)) * gamma_M
    return torch.cat([gelu_HM, ln_HM]).to(device)


def _available(asked: list[str] | None) -> dict[str, Compressor]:
    """The compressors --compressors names (ValueError naming the flag: unknown, or zfp without
    zfpy), else every registered one that is installed."""
    if asked:
        with for_flag("--compressors"):
            return {name: build(name) for name in asked}
    out = {}
    for name in COMPRESSORS.names():
        with contextlib.suppress(ImportError):  # not installed (zfp without zfpy): skipped
            out[name] = build(name)
    return out


def _timed(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    def call() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a host-device sync, so the sample covers the work

    return call


def run(args: argparse.Namespace) -> dict:
    """Measure every compressor; returns {"results": [row per compressor], "config": {...}}.

    Prints nothing: `schemoe bench compress` and `main` print header, table and JSON line.
    The flags' ranges (CHECKS) are checked when they are parsed."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch.cuda.is_available() is False; use --device cpu")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    comps = _available(args.compressors)
    x_NM = activations(args.rows, args.cols, device)
    payloads, candidates, rows = {}, {}, []
    for name, c in comps.items():
        payloads[name] = c.encode(x_NM)
        candidates[f"{name}:encode"] = _timed(lambda c=c: c.encode(x_NM), device)
        candidates[f"{name}:decode"] = _timed(
            lambda c=c, b=payloads[name]: c.decode(b, torch.float32, args.cols), device
        )
    stats = measure(candidates, warmup=args.warmup, repeats=args.repeats)
    gb = x_NM.nbytes / 1e9
    for name, c in comps.items():
        err_NM = (c.decode(payloads[name], torch.float32, args.cols) - x_NM).double()
        rows.append(
            {
                "compressor": name,
                "encode_gbps": gb / max(stats[f"{name}:encode"].median_ms / 1e3, 1e-9),
                "decode_gbps": gb / max(stats[f"{name}:decode"].median_ms / 1e3, 1e-9),
                "ratio": x_NM.nbytes / c.wire_bytes(args.rows, args.cols),
                "max_abs_err": err_NM.abs().max().item(),
                "rms_err": math.sqrt(err_NM.pow(2).mean().item()),
            }
        )
    config = {
        "rows": args.rows,
        "cols": args.cols,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "device": str(device),
        "input_rms": x_NM.double().pow(2).mean().sqrt().item(),
        "input_max_abs": x_NM.abs().max().item(),
    }
    return {"results": rows, "config": config}


def main(argv: list[str] | None = None) -> int:
    """Standalone: header, table, and the JSON line last."""
    p = Parser(prog="python -m schemoe.bench.compress", description=__doc__)
    add_arguments(p)
    p.add_checks(CHECKS)
    args = p.parse_args(argv)
    summary = run(args)
    config = {k: v for k, v in vars(args).items()}
    head = output.header("schemoe bench compress", config, "one process", "none (local codec)")
    rows = summary["results"]
    output.report(head, rows, list(rows[0]) if rows else [], summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
