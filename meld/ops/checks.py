"""Input checks shared by the operators: every bad input becomes a ValueError naming the argument and
the offending value, before anything reaches a kernel. `expect` is on the plan()/run() hot path: one
cheap test of everything, and the detailed diagnosis only when that fails."""
from __future__ import annotations

import torch


def same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.type == "cpu" or (a.index or 0) == (b.index or 0))


def expect(name: str, t: object, dtype: torch.dtype, shape: tuple[int | None, ...], meaning: str,
           device: torch.device | None = None, contiguous: bool = False) -> None:
    """Require a tensor of `dtype` whose shape matches `shape` (None: any extent), on `device` (None: any)."""
    if type(t) is torch.Tensor and t.dtype == dtype and (not contiguous or t.is_contiguous()):
        ts = t.shape
        if len(ts) == len(shape) and (device is None or same_device(t.device, device)):
            for s, e in zip(ts, shape):
                if e is not None and s != e:
                    break
            else:
                return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if len(t.shape) != len(shape) or any(e is not None and s != e for s, e in zip(t.shape, shape)):
        shown = tuple("*" if e is None else e for e in shape)
        raise ValueError(f"{name} must have shape {shown} ({meaning}), got {tuple(t.shape)}")
    if device is not None and not same_device(t.device, device):
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def check_positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value
