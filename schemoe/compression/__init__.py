"""Compressors for all-to-all payloads: a registry of plug-ins (see base.py for the protocol).

Built-ins: `none` (identity), `fp16`, `bf16` (casts), `fp8` (e4m3, per-row scale), `int8`
(per-row min-max), `zfp` (fixed-rate ZFP; needs `pip install 'schemoe[zfp]'`).

Options ({compressor: {option: value}}, e.g. {"zfp": {"rate": 4}}) are a compressor's keyword
arguments; `check_options` refuses any the compressor they name does not take, and `build` runs it
on every entry, so a typo fails on every path (the Python API, `schemoe train`, the benches).
"""

import inspect
import typing
from collections.abc import Mapping, Sequence
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
    "check_options",
    "option_names",
]

# A declared option type -> (the Python types a value may have, how an error names them).
_KINDS: dict[object, tuple[tuple[type, ...], str]] = {
    float: ((int, float), "a number"),
    int: ((int,), "an int"),
    bool: ((bool,), "true or false"),
    str: ((str,), "a string"),
}


def build(name: str, options: Mapping[str, Mapping[str, Any]] | None = None) -> Compressor:
    """A compressor instance by name; `options` maps compressor names to keyword arguments,
    e.g. build("zfp", {"zfp": {"rate": 4}}). Unknown names raise ValueError listing the known;
    every entry of `options` is checked (`check_options`), not only `name`'s."""
    cls = COMPRESSORS.get(name)
    check_options(options or {})
    kwargs = dict((options or {}).get(name, {}))
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if not kwargs:
            raise
        given = ", ".join(_spell(name, k, v) for k, v in kwargs.items())
        raise ValueError(f"compressor option {given}: {e}") from None


def option_names(name: str) -> list[str]:
    """The keyword arguments compressor `name` takes (ValueError listing the known names)."""
    return list(inspect.signature(COMPRESSORS.get(name)).parameters)


def check_options(
    options: Mapping[str, Mapping[str, Any]], chosen: Sequence[str] | None = None
) -> None:
    """Raise ValueError unless every option names a registered compressor (one of `chosen` when
    given: an option of a compressor the run does not use is a mistake), an option it takes, and
    a value of the type its constructor declares (`rate: float` takes a number, not "abc").
    Ranges are the constructor's to check (`build` names the option when it refuses one)."""
    if not isinstance(options, Mapping):
        raise TypeError(f"compressor options must be a mapping, got {options!r}")
    for name, kwargs in options.items():
        if not isinstance(kwargs, Mapping):
            raise TypeError(f"options for compressor {name!r} must be a mapping, got {kwargs!r}")
        for key, value in kwargs.items():
            spelled = _spell(name, key, value)
            if name not in COMPRESSORS:
                known = ", ".join(COMPRESSORS.names())
                raise ValueError(
                    f"compressor option {spelled}: no compressor {name!r}; known: {known}"
                )
            if chosen is not None and name not in chosen:
                raise ValueError(
                    f"compressor option {spelled} is for {name}, which this run does not use "
                    f"(it uses {', '.join(dict.fromkeys(chosen))}); drop it or choose {name}"
                )
            params = option_names(name)
            if key not in params:
                takes = f"its options: {', '.join(params)}" if params else "it takes none"
                raise ValueError(
                    f"compressor option {spelled}: {name} has no option {key!r}; {takes}"
                )
            kind = _KINDS.get(_hints(COMPRESSORS.get(name)).get(key))
            if kind is None:
                continue  # an undeclared (or exotic) type: the constructor checks it
            types, what = kind
            if isinstance(value, bool) != (bool in types) or not isinstance(value, types):
                raise ValueError(
                    f"compressor option {spelled}: {key} must be {what}, got {value!r}"
                )


def _hints(cls: type) -> dict[str, object]:
    """The declared types of `cls`'s constructor arguments ({} when it declares none)."""
    try:
        return typing.get_type_hints(cls.__init__)
    except (NameError, TypeError):  # an annotation this module cannot resolve: not checked
        return {}


def _spell(name: str, key: str, value: object) -> str:
    """An option as `--compressor-option` takes it: zfp.rate=4."""
    return f"{name}.{key}={value}"
