"""The package's tiers, bottom up: the one place the order is written. A module may import from
its own tier or any tier below, never above (not even inside a function); tests/test_layering.py
checks it and docs/architecture.md quotes it. Each name is a folder of `schemoe/` or one of the
few modules at its root."""

from __future__ import annotations

__all__ = ["TIERS", "tier_of"]

TIERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("parts", ("config", "registry", "trace", "cliargs", "dist", "collectives", "compression",
               "routing", "experts")),
    ("scheduling", ("scheduling",)),
    ("planning", ("costmodel",)),
    ("layer", ("layer", "step")),
    ("tuning", ("tuning",)),
    ("training", ("train", "checkpoint", "integrations")),
    ("tools", ("bench", "profile", "testbed", "cli", "__main__", "tiers")),
)  # fmt: skip


def tier_of(module: str) -> int:
    """The tier index (0 = parts) of a dotted module name under schemoe; the package itself
    (its __init__ re-exports the public API) sits at the layer tier."""
    parts = module.split(".")
    if len(parts) == 1:
        return 3
    for i, (_, names) in enumerate(TIERS):
        if parts[1] in names:
            return i
    raise ValueError(f"{module}: its top-level name {parts[1]!r} is in no tier of TIERS")
