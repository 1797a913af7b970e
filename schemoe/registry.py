"""A tiny name -> object registry used by every extension point (policies, all-to-alls, compressors).

ALGOS = Registry[type]("all-to-all algorithm")

@ALGOS.register("mine")
class Mine: ...

ALGOS.get("mine")      # -> Mine
ALGOS.get("nope")      # ValueError: unknown all-to-all algorithm 'nope'; known: mine, naive
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to plug-ins. Unknown names raise ValueError listing the known ones."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._items: dict[str, T] = {}

    def register(self, name: str, *, replace: bool = False) -> Callable[[T], T]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what} name must be a non-empty string, got {name!r}")

        def deco(obj: T) -> T:
            if name in self._items and not replace:
                raise ValueError(
                    f"{self.what} {name!r} is already registered; pass replace=True to override"
                )
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown {self.what} {name!r}; known: {', '.join(sorted(self._items))}"
            ) from None

    def unregister(self, name: str) -> T:
        """Remove `name` and return what it named (tests register plug-ins in a fixture that
        removes them afterwards)."""
        if name not in self._items:
            raise ValueError(f"{self.what} {name!r} is not registered")
        return self._items.pop(name)

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items
