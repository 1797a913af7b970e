"""Compressors for all-to-all payloads: a registry of plug-ins (see base.py for the protocol)."""

from .base import COMPRESSORS, Compressor
from .none import NoCompression

__all__ = ["COMPRESSORS", "Compressor", "NoCompression", "build"]


def build(name: str, options=None) -> Compressor:
    """A compressor instance by name; `options` maps compressor names to keyword arguments."""
    cls = COMPRESSORS.get(name)
    kwargs = dict((options or {}).get(name, {}))
    return cls(**kwargs)
