"""All-to-all algorithms: a registry of plug-ins (see base.py for the protocol)."""

from .base import ALGORITHMS, AllToAll, Done, Pending, check_splits
from .naive import Naive

__all__ = ["ALGORITHMS", "AllToAll", "Pending", "Done", "check_splits", "Naive", "build"]

_BUILT: dict = {}


def build(name: str, topology) -> AllToAll:
    """The algorithm `name` for `topology`, constructed once and cached (it may create groups)."""
    key = (name, topology)
    if key not in _BUILT:
        _BUILT[key] = ALGORITHMS.get(name)(topology)
    return _BUILT[key]
