"""Input checks shared by the operators: every bad input becomes a ValueError naming the argument and
the offending value, before anything reaches a kernel. `expect` is on the plan()/run() hot path: one
cheap test of everything, and the detailed diagnosis only when that fails."""
from __future__ import annotations

import math
import numbers

import torch


def same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.type == "cpu" or (a.index or 0) == (b.index or 0))


def plain(t: object) -> object:
    """A tensor as meld reads it: a subclass (nn.Parameter, ...) as a plain torch.Tensor and one that
    requires grad detached, both without a copy (meld reads the memory and has no backward). Anything
    that is not a tensor is returned as it is, for `expect` to name."""
    if type(t) is torch.Tensor and not t.requires_grad:
        return t
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if type(t) is not torch.Tensor:
            with torch._C.DisableTorchFunctionSubclass():
                t = t.as_subclass(torch.Tensor)
    return t


def expect(name: str, t: object, dtype: torch.dtype, shape: tuple[int | None, ...], meaning: str,
           device: torch.device | None = None, contiguous: bool = False) -> None:
    """Require a tensor of `dtype` whose shape matches `shape` (None: any extent), on `device` (None: any)."""
    if type(t) is torch.Tensor and t.dtype == dtype and t.layout is torch.strided:
        try:
            ts = t.shape
        except RuntimeError:   # a nested tensor has no sizes: the diagnosis below names it
            ts = ()
        if len(ts) == len(shape) and (not contiguous or t.is_contiguous()) and (
                device is None or same_device(t.device, device)):
            for s, e in zip(ts, shape):
                if e is not None and s != e:
                    break
            else:
                return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided or t.is_nested:
        raise ValueError(f"{name} must be a dense (strided) tensor, got {'a nested' if t.is_nested else t.layout} "
                         "tensor")
    if t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if len(t.shape) != len(shape) or any(e is not None and s != e for s, e in zip(t.shape, shape)):
        shown = tuple("*" if e is None else e for e in shape)
        raise ValueError(f"{name} must have shape {shown} ({meaning}), got {tuple(t.shape)}")
    if device is not None and not same_device(t.device, device):
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


INT32_MAX = 2 ** 31 - 1   # sizes travel to the kernels as int32


def is_int(value: object) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive(name: str, value: object, high: int = INT32_MAX) -> int:
    """A positive integer (Python or NumPy, not bool) of at most `high`, as a Python int."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if value > high:
        raise ValueError(f"{name} must be at most {high}, got {value!r}")
    return int(value)


def check_finite(name: str, value: object, limit: float = math.inf) -> float:
    """A finite real number (int, float, NumPy scalar; not bool) of magnitude below `limit`."""
    try:
        finite = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    except OverflowError:   # an int beyond the float range
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not abs(float(value)) < limit:
        raise ValueError(f"{name} must have a magnitude below {limit:g}, got {value!r}")
    return float(value)


def _available() -> str:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ", ".join(["cpu"] + [f"cuda:{i}" for i in range(n)])


def resolve_device(device: object) -> torch.device:
    """`device` as a torch.device that exists on this machine ('cpu', or a CUDA device with its index);
    anything else is a ValueError that lists the devices there are."""
    try:   # an int is a CUDA ordinal, as torch reads it wherever CUDA exists
        d = torch.device("cuda", device) if isinstance(device, int) and not isinstance(device, bool) \
            else torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device={device!r} is not a device; available: {_available()}") from None
    if d.type == "cpu":
        return torch.device("cpu")
    if d.type != "cuda":
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}; available: {_available()}")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available on this machine; available: {_available()}")
    index = torch.cuda.current_device() if d.index is None else d.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r} does not exist; available: {_available()}")
    return torch.device("cuda", index)
