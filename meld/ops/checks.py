"""Input checks shared by the operators: every bad input becomes a ValueError naming the argument and
the offending value, before anything reaches a kernel. `expect` is on the plan()/run() hot path: one
cheap test of everything, and the detailed diagnosis only when that fails."""
from __future__ import annotations

import math
import numbers

import torch


def same_device(a: torch.device, b: torch.device) -> bool:
    """Equal devices, "cuda" and "cuda:0" alike (equality first: reading .type costs more, on every plan())."""
    return a == b or a.type == b.type and (a.type == "cpu" or (a.index or 0) == (b.index or 0))


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


def exactly(t: object, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...], device: torch.device,
            contiguous: bool = False) -> bool:
    """Whether t is a plain torch.Tensor (no subclass) that needs no grad, dense (and contiguous), of one of
    `dtypes`, exactly `shape`, on `device` as a tensor names it (a CUDA device with its index): then `expect`
    passes for it and `plain(t)` is t. An eager call's one cheap test of its usual inputs; anything else goes
    to the full checks, which convert and diagnose."""
    try:
        return (usual(t, device) and t.dtype in dtypes and t.shape == shape
                and (not contiguous or t.is_contiguous()))
    except RuntimeError:   # a nested tensor has no sizes
        return False


def usual(t: object, device: torch.device) -> bool:
    """Whether t is a plain torch.Tensor (no subclass) that needs no grad, dense, on `device` as a tensor names it:
    one whose dispatch reaches `device`'s kernels of a torch op, as the direct call's checks see it."""
    return (type(t) is torch.Tensor and t.device == device and t.layout is torch.strided and not t.requires_grad
            and not t.is_nested)


INT32_MAX = 2 ** 31 - 1   # sizes travel to the kernels as int32


def is_int(value: object) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, high: int, what: str) -> int:
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be a {what} int, got {value!r}")
    if value > high:
        raise ValueError(f"{name} must be at most {high}, got {value!r}")
    return int(value)


def check_positive(name: str, value: object, high: int = INT32_MAX) -> int:
    """A positive integer (Python or NumPy, not bool) of at most `high`, as a Python int."""
    return _check_int(name, value, 1, high, "positive")


def check_count(name: str, value: object, high: int = INT32_MAX) -> int:
    """A non-negative integer (Python or NumPy, not bool) of at most `high`, as a Python int."""
    return _check_int(name, value, 0, high, "non-negative")


def check_dtype_name(dtype: object) -> str:
    """A task graph's dtype attribute: a name such as 'bfloat16' (graphs are JSON: no torch dtypes)."""
    if not isinstance(dtype, str) or not dtype:
        raise ValueError(f"dtype must be a name such as 'bfloat16', got {dtype!r}")
    return dtype


SEED_RANGE = (-2 ** 63, 2 ** 64 - 1)   # the seeds torch.Generator.manual_seed takes


def check_seed(name: str, value: object, span: int = 1) -> int:
    """An int that seeds torch generators: value, ..., value + span - 1 all in SEED_RANGE."""
    low, high = SEED_RANGE
    if not is_int(value) or not low <= value <= high - (span - 1):
        raise ValueError(f"{name} must be an int in [{low}, {high - (span - 1)}] (it seeds torch generators"
                         f"{'' if span == 1 else f' with {name} .. {name} + {span - 1}'}), got {value!r}")
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


def check_scale(name: str, value: object, limit: float = math.inf) -> float:
    """A dequantisation scale: a positive finite number (`check_finite`) of magnitude below `limit`."""
    x = check_finite(name, value, limit)
    if not x > 0:
        raise ValueError(f"{name} must be positive (a dequantisation scale), got {value!r}")
    return x


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


def check_tensors(tensors: dict[str, object], optional: dict[str, object] | None = None) -> None:
    """Arguments that must be tensors (`tensors`) or tensors or None (`optional`), checked before they reach a
    torch custom op, whose schema check would refuse them with a RuntimeError from torch's dispatcher."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (optional or {}).items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")


def check_pair(a: str, va: object, b: str, vb: object) -> None:
    """Arguments that only mean something together: both given or neither."""
    if (va is None) != (vb is None):
        given, missing = (a, b) if vb is None else (b, a)
        raise ValueError(f"{a} and {b} go together: got {given} without {missing}")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [start, end) from t's first element to the end of its last (torch's strides are >= 0)."""
    lo = t.data_ptr()
    if t.is_contiguous():   # (run()'s tensors: the cheap case first)
        return lo, lo + t.nbytes
    last = sum(s * (n - 1) for s, n in zip(t.stride(), t.shape))
    return lo, lo + (last + 1) * t.element_size()


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of t may share memory (zero strides, or strides that do not step past the
    dimensions below them: `expand`, `as_strided`); conservative for exotic interleavings."""
    if t.numel() <= 1 or t.is_contiguous():
        return False
    reach = 0   # the elements the smaller strides span: the next stride must step past them
    for stride, n in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (n - 1)
    return False


def check_output(name: str, t: torch.Tensor, reads: dict[str, object]) -> None:
    """One preallocated output: `check_outputs({name: t}, reads)`."""
    check_outputs({name: t}, reads)


def check_outputs(outputs: dict[str, torch.Tensor | None], reads: dict[str, object]) -> None:
    """Preallocated outputs (already of the right dtype, shape and device; None skipped) that a kernel may
    write: every element its own memory, none of it shared with `reads` (the tensors the kernel reads while
    it writes them; None and non-tensors skipped) or with an earlier output, and nothing autograd forbids
    writing in place (a leaf that requires grad, or a view of one). Each span is computed once: run() calls
    this on every launch."""
    spans = [(n, r, *_span(r)) for n, r in reads.items() if isinstance(r, torch.Tensor) and r.numel()]
    for name, t in outputs.items():
        if t is None:
            continue
        if _overlaps_itself(t):
            raise ValueError(f"{name} has elements that share memory (shape {tuple(t.shape)}, strides {t.stride()}): "
                             "the kernel writes every element, so each needs its own")
        if t.requires_grad and torch.is_grad_enabled() and (t if t._base is None else t._base).is_leaf:
            raise ValueError(f"{name} is a leaf tensor that requires grad (or a view of one): meld writes it in "
                             "place, which autograd forbids; pass a buffer that does not require grad")
        if not t.numel():
            continue
        lo, hi = _span(t)
        for other, r, rlo, rhi in spans:
            if lo < rhi and rlo < hi:
                raise ValueError(f"{name} (strides {t.stride()}) shares memory with {other} (strides {r.stride()}): "
                                 f"the kernel would overwrite what it reads; pass a separate {name}")
        spans.append((name, t, lo, hi))


# --- autograd: meld's kernels are for inference ---------------------------------------------------------
def grad_inputs(*ts: object) -> tuple | None:
    """The inputs that require grad, when grad mode is on and any does (else None: the usual case). A plain loop:
    every op call and run() asks, and any() over a generator is slower (bench/RESULTS.md, "the op call's host
    path")."""
    if torch.is_grad_enabled():
        for t in ts:
            if getattr(t, "requires_grad", False):
                return tuple(t for t in ts if getattr(t, "requires_grad", False))
    return None


class _NoBackward(torch.autograd.Function):
    """Ties an op's outputs to its inputs that require grad, so that asking for a gradient through them
    reaches meld and gets a clear answer instead of a gradient that silently leaves the op out."""

    @staticmethod
    def forward(ctx, op, n_inputs, in_place, *tensors):   # the inputs that require grad, then the outputs
        ctx.op = op
        outs = tensors[n_inputs:]
        if in_place:
            ctx.mark_dirty(*outs)
            return outs
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(f"{ctx.op} has no backward: meld's kernels are for inference (run it under "
                                  "torch.no_grad(), or use a differentiable implementation for training)")


def no_backward(op: str, grads: tuple | None, outputs: tuple[torch.Tensor, ...],
                in_place: bool = True) -> tuple[torch.Tensor, ...]:
    """`outputs` of `op` tied to `grads` (`grad_inputs` of its inputs), so a backward through them raises
    NotImplementedError naming `op`. In place, the caller's tensors themselves carry the tie (an out= buffer
    used later must not pass a gradient around the op; an output that required grad loses its old history);
    otherwise new views carry it (outputs that are views of an operator's own memory, which stays untied)."""
    if not torch.is_grad_enabled() or not (grads or any(o.requires_grad for o in outputs)):
        return outputs
    grads = grads or ()
    return _NoBackward.apply(op, len(grads), in_place, *grads, *outputs)
