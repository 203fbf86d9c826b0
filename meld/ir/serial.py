"""Reading meld.ir's JSON back: whatever the text, a reader fails only with its own ValueError (GraphError,
ScheduleError) naming what is wrong (not JSON, nested too deeply, a missing or unknown key, a value of the
wrong type or out of range), never a KeyError, TypeError or AttributeError from inside the constructor."""
from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from ..jsonfile import parse

INT32 = (-2 ** 31, 2 ** 31 - 1)


def document(text: object, what: str, error: type[ValueError], required: tuple[str, ...],
             optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON object `text` holds, with every `required` key and no key outside `required` + `optional`."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise error(f"{what} JSON must be str or bytes, got {type(text).__name__}")
    try:
        d = parse(text)
    except ValueError as e:
        raise error(f"{what}: {e}") from None
    return fields(d, what, error, required, optional)


def fields(d: object, what: str, error: type[ValueError], required: tuple[str, ...],
           optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """`d`, a JSON object with every `required` key and no key outside `required` + `optional`."""
    if not isinstance(d, dict):
        raise error(f"{what} must be a JSON object, got {type(d).__name__}")
    missing = [k for k in required if k not in d]
    if missing:
        raise error(f"{what} has no {', '.join(map(repr, missing))}")
    unknown = sorted(set(d) - set(required) - set(optional), key=str)
    if unknown:
        raise error(f"{what} has unknown keys {unknown}")
    return d


def integer(value: object, name: str, error: type[ValueError], low: int = INT32[0], high: int = INT32[1]) -> int:
    """An int (not a bool, not a float) in [low, high]."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not low <= value <= high:
        raise error(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return int(value)


def int32_array(value: object, name: str, error: type[ValueError], ndim: int = 1) -> np.ndarray:
    """A (nested) list of ints within int32 as an int32 array of `ndim` dimensions."""
    def ok(v: object, depth: int) -> bool:
        if depth == 0:
            return isinstance(v, numbers.Integral) and not isinstance(v, bool) and INT32[0] <= v <= INT32[1]
        return isinstance(v, list) and all(ok(x, depth - 1) for x in v)

    if not ok(value, ndim):
        raise error(f"{name} must be {'a list' if ndim == 1 else f'{ndim}-level nested lists'} of int32 values")
    try:
        a = np.asarray(value, dtype=np.int32)
    except ValueError:   # ragged rows
        raise error(f"{name} must have rows of one length") from None
    if a.ndim != ndim:
        raise error(f"{name} must have rows of one length")
    return a


def text(value: object, name: str, error: type[ValueError]) -> str:
    if not isinstance(value, str):
        raise error(f"{name} must be a string, got {value!r}")
    return value
