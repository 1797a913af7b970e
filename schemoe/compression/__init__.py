"""Compressors for all-to-all payloads: a registry of plug-ins (see base.py for the protocol).

Built-ins: `none` (identity), `fp16`, `bf16` (casts), `fp8` (e4m3, per-row scale), `int8`
(per-row min-max), `zfp` (fixed-rate ZFP; needs `pip install 'schemoe[zfp]'`).
"""

import inspect
from collections.abc import Mapping
from typing import Any

from .base import COMPRESSORS, Compressor
from .cast import BF16, FP16
from .fp8 import FP8
from .int8 import INT8
from .none import NoCompression
from .zfp import ZFP

__all__ = [
    "BF16",
    "COMPRESSORS",
    "FP8",
    "FP16",
    "INT8",
    "ZFP",
    "Compressor",
    "NoCompression",
    "build",
]


def build(name: str, options: Mapping[str, Mapping[str, Any]] | None = None) -> Compressor:
    """A compressor instance by name; `options` maps compressor names to keyword arguments,
    e.g. build("zfp", {"zfp": {"rate": 4}}). Unknown names raise ValueError listing the known."""
    cls = COMPRESSORS.get(name)
    kwargs = (options or {}).get(name, {})
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"options for compressor {name!r} must be a mapping, got {kwargs!r}")
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError:
        raise ValueError(
            f"options {dict(kwargs)!r} do not fit compressor {name!r}, whose options are "
            f"{_describe(cls)}"
        ) from None
    return cls(**kwargs)


def _describe(cls) -> str:
    params = [str(p) for p in inspect.signature(cls).parameters.values()]
    return "(" + ", ".join(params) + ")" if params else "none"
