"""Handles: the int that names an operator to its torch custom op (a custom op takes tensors and scalars,
not Python objects), as vLLM names an attention layer by a string looked up in its forward context.

A leaf module: the operators' base registers every operator here and `torch_ops` looks handles up, so
neither imports the other. Operators are held weakly: registering keeps nothing alive, and a handle whose
operator is gone raises ValueError naming it.
"""
from __future__ import annotations

import functools
import itertools
import weakref
from typing import TypeVar

_T = TypeVar("_T")
_live: dict[int, weakref.ref] = {}
_handles = itertools.count()


def _forget(handle: int, _ref: weakref.ref) -> None:
    _live.pop(handle, None)


def register(op: object) -> int:
    """A new handle naming `op` (held weakly: the handle is forgotten when `op` is collected)."""
    handle = next(_handles)
    _live[handle] = weakref.ref(op, functools.partial(_forget, handle))
    return handle


def lookup(handle: int, kind: type[_T]) -> _T:
    """The live operator `handle` names, which must be a `kind`."""
    ref = _live.get(handle)
    op = None if ref is None else ref()
    if isinstance(op, kind):
        return op
    if op is None:
        raise ValueError(f"handle={handle!r} names no live meld operator (never registered, or its operator "
                         "was garbage-collected)")
    raise ValueError(f"handle={handle!r} names a {type(op).__name__}, not a {kind.__name__}")
