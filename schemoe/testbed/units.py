"""Rates and latencies as the testbed's command line spells them ('400mbit', '2ms')."""

from __future__ import annotations

import re

__all__ = ["parse_latency", "parse_rate"]

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_rate(text: str, what: str = "rate") -> float:
    """'400mbit' -> 4e8 bits/s. Units: bit, kbit, mbit, gbit, tbit (powers of 1000)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ValueError(
            f"{what} {text!r}: expected a positive number and one of {', '.join(_RATE_UNITS)} "
            "(e.g. 400mbit; tc's 'bps' means bytes/s and is not accepted to avoid confusion)"
        )
    return float(m.group(1)) * _RATE_UNITS[unit]


def parse_latency(text: str | None) -> float:
    """'2ms' -> 0.002 s; None or '0' -> 0. Units: us, ms, s."""
    if text is None or str(text).strip() in ("", "0"):
        return 0.0
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)\s*", str(text))
    if not m:
        raise ValueError(f"latency {text!r}: expected a number and us, ms or s (e.g. 2ms)")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]
