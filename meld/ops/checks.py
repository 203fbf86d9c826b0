"""Input checks shared by the operators: every bad input becomes a ValueError naming the argument and
the offending value, before anything reaches a kernel."""
from __future__ import annotations

import torch


def check_tensor(name: str, t: object, *, dtype: torch.dtype | tuple[torch.dtype, ...], ndim: int,
                 device: torch.device | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if device is not None and not same_device(t.device, device):
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    return t


def same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.type == "cpu" or (a.index or 0) == (b.index or 0))


def check_shape(name: str, t: torch.Tensor, expected: tuple[int | None, ...], meaning: str) -> None:
    if len(t.shape) != len(expected) or any(e is not None and s != e for s, e in zip(t.shape, expected)):
        shown = tuple("*" if e is None else e for e in expected)
        raise ValueError(f"{name} must have shape {shown} ({meaning}), got {tuple(t.shape)}")


def check_positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value
