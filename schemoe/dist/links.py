"""The links a run's ranks talk over, as a profile's key names them: the inter-node rate, the
intra-node rate (and what a rank link shapes), or "unshaped" for either.

    Links()                                   # loopback or a real network: nothing shaped
    Links(inter_bps=4e8)                      # testbed `up --rate 400mbit`
    Links(inter_bps=3e8, intra_bps=1e8)       # ... `--intra-rate 100mbit` (intra_link "shared")
    Links.of_run()                            # where this process runs (below)
    Links.parse("inter=4e+08,intra=unshaped") == Links(inter_bps=4e8)

A run learns its links from where it runs (`of_run`): on the emulated testbed, from the state
file `schemoe testbed up` writes (STATE_FILE), when this process's rendezvous address
(MASTER_ADDR, set by the testbed launcher) is one of the testbed's addresses; anywhere else
(loopback, a real cluster) nothing schemoe shaped: `Links()`. Reading MASTER_ADDR describes where
the run is; it changes nothing the library does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

__all__ = ["INTRA_LINKS", "STATE_FILE", "Links"]

STATE_FILE = "/run/schemoe/testbed.json"  # written by `schemoe testbed up` (testbed/netns.py)
INTRA_LINKS = ("shared", "separate")  # what a rank link shapes (docs/testbed.md)
UNSHAPED = "unshaped"


def _rate(text: str, what: str) -> float | None:
    if text == UNSHAPED:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(
            f"{what} rate {text!r}: expected bit/s (e.g. 4e+08) or 'unshaped'"
        ) from None


@dataclass(frozen=True)
class Links:
    """Link rates in bit/s each way; None: not shaped. `intra_link` matters only with an intra
    rate: the rank link shapes all of a rank's bytes ("shared") or only intra-node ones."""

    inter_bps: float | None = None
    intra_bps: float | None = None
    intra_link: str = "shared"

    def __post_init__(self) -> None:
        for what, v in (("inter", self.inter_bps), ("intra", self.intra_bps)):
            if v is not None and not v > 0:
                raise ValueError(f"{what}_bps must be > 0 bit/s or None (unshaped), got {v!r}")
        if self.intra_link not in INTRA_LINKS:
            raise ValueError(f"intra_link {self.intra_link!r}: expected one of {INTRA_LINKS}")
        if self.intra_bps is None and self.intra_link != "shared":
            raise ValueError(f"intra_link {self.intra_link!r} needs an intra rate")

    def __str__(self) -> str:
        inter = UNSHAPED if self.inter_bps is None else f"{self.inter_bps:g}"
        intra = UNSHAPED if self.intra_bps is None else f"{self.intra_bps:g}"
        if self.intra_bps is not None and self.intra_link != "shared":
            intra += f"/{self.intra_link}"
        return f"inter={inter},intra={intra}"

    @classmethod
    def parse(cls, text: str) -> Links:
        """The inverse of str(); also the old one-rate form ("4e+08", "unshaped": intra
        unshaped)."""
        if "=" not in text:
            return cls(_rate(text, "inter"))
        fields = dict(kv.partition("=")[::2] for kv in text.split(","))
        if sorted(fields) != ["inter", "intra"]:
            raise ValueError(f"links {text!r}: expected 'inter=RATE,intra=RATE[/separate]'")
        intra, _, mode = fields["intra"].partition("/")
        return cls(_rate(fields["inter"], "inter"), _rate(intra, "intra"), mode or "shared")

    @classmethod
    def of_run(cls, state_file: str = STATE_FILE) -> Links:
        """This process's links: the testbed's when it runs there (see the module docstring),
        else unshaped."""
        try:
            with open(state_file) as f:
                bed = json.load(f)
        except FileNotFoundError:
            return cls()
        if os.environ.get("MASTER_ADDR") not in bed["addresses"]:
            return cls()  # a testbed is up, but this run is not on it
        intra = bed.get("intra_rate_bps") or None
        return cls(bed["rate_bps"], intra, bed.get("intra_link", "shared") if intra else "shared")
