"""The C++ fast path of meld's torch ops (issue 42: an op call within 2 us of host time over `run()`).

A Python kernel of a torch op costs about the whole budget before it does anything (bench/RESULTS.md, "the floor
of each route"), so the ops' kernels on a device's dispatch keys (CUDA and AutogradCUDA) are C++
(host/torch_fastcall.cpp), compiled at first use with the system compiler against torch's headers and cached in
MELD_CACHE_DIR by source, flags and compiler. Each call looks for a launch record of its operator (by handle)
that applies: the launches the op's Python path made (function, grid, cluster attributes, a copy of the parameter
bytes), where each tensor's address goes in them, and the arguments they were made for (dtype, sizes, strides,
device, scalars, which are None; the addresses a tensor map holds). A call that matches patches its tensors'
addresses in and launches on torch's current stream; any other (the first of its kind, an input that requires grad,
an output overlapping an input, an address off 16 bytes...) goes to the op's twin `meld::_<op>_slow`, the Python
kernel, which checks everything, launches, and records the launches. An operator keeps a few records for each
address its records require (one operator often serves every layer of a model, each with its own tensors); a
plan() drops them all.

Where the library cannot be built the ops keep their Python kernels, and a warning says why, once.
"""
from __future__ import annotations

import ctypes
import struct
import threading
import warnings
import weakref
from importlib import resources

import torch

from . import fastcall

_lib: ctypes.CDLL | None | bool = False   # False: not tried yet
_installed: set[str] = set()   # the device types whose dispatch keys have the C++ kernels
_op_codes: dict[str, int] = {}   # each op's number in its records
_recording: list | None = None
_owner = 0   # the thread whose launches `_recording` collects
_with_record: set[int] = set()   # the handles that have a record
_watched: set[int] = set()   # the handles whose record is dropped when their operator goes


def load() -> ctypes.CDLL | None:
    """The compiled library, or None (warned once) where it cannot be built."""
    global _lib
    if _lib is False:
        from torch.utils import cpp_extension

        from .host_helper import _build

        why: list[str] = []
        try:
            flags = (*(f"-I{p}" for p in cpp_extension.include_paths()),
                     f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                     *(f"-L{p}" for p in cpp_extension.library_paths()),
                     *(f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu")
            source = resources.files("meld.runtime").joinpath("host/torch_fastcall.cpp").read_text()
            lib = _build("torch_fastcall", [f"// torch {torch.__version__}", source], "c++", flags, "c++20", why)
        except OSError as e:   # (no torch headers: cpp_extension cannot name them)
            lib, why = None, [str(e)]
        if lib is None:
            warnings.warn("meld's torch ops keep their Python kernels (about 2 us more host time per call): the C++ "
                          f"fast path could not be built: {why[0] if why else 'unknown reason'}", stacklevel=3)
        else:
            lib.meld_fc_error.restype = ctypes.c_char_p
            lib.meld_fc_set_launch.argtypes = [ctypes.c_void_p]
            lib.meld_fc_hits.restype = ctypes.c_int64
            lib.meld_fc_push.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_char_p,
                                         ctypes.c_int64]
            lib.meld_fc_drop.argtypes = [ctypes.c_int64]
            lib.meld_fc_register.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int64, ctypes.c_char_p,
                                             ctypes.c_int64]
        _lib = lib
    return _lib


def set_driver(lib: ctypes.CDLL) -> None:
    """Launch through `lib`'s cuLaunchKernelEx: libcuda, or a test's stand-in (tools/moe_eager.py's stub driver)."""
    load().meld_fc_set_launch(ctypes.cast(lib.cuLaunchKernelEx, ctypes.c_void_p))


def install(device_type: str, ops: dict[str, int]) -> bool:
    """Register the C++ kernels of `ops` ({op name in torch.ops.meld: index of its handle argument}) at
    `device_type`'s dispatch keys (its backend and autograd keys), each falling back to `meld::_<op>_slow`, which
    the caller has defined. False where the library cannot be built."""
    lib = load()
    if lib is None:
        return False
    key = {"cuda": "CUDA", "cpu": "CPU"}[device_type]
    if device_type == "cuda":
        set_driver(fastcall._cuda())
    for name, handle_arg in ops.items():
        code = _op_codes.setdefault(name, len(_op_codes))
        for k in (key, "Autograd" + key):   # (a Python autograd kernel before it would cost ~2 us: RESULTS)
            if lib.meld_fc_register(f"meld::{name}".encode(), f"meld::_{name}_slow".encode(), handle_arg, k.encode(),
                                    code):
                raise RuntimeError(f"meld: registering the C++ kernel of meld::{name} at {k}: "
                                   f"{lib.meld_fc_error().decode()}")
    _installed.add(device_type)
    return True


def installed(device: torch.device) -> bool:
    return device.type in _installed


def hits() -> int:
    """Calls the fast path has launched so far (all ops)."""
    return int(load().meld_fc_hits()) if _lib else 0


def drop(handle: int) -> None:
    """Forget `handle`'s records (its operator's launches changed: a plan())."""
    if handle in _with_record:   # (plan() is hot too: no library call for a handle without a record)
        _with_record.discard(handle)
        _lib.meld_fc_drop(handle)


def record_launch(func: int, cfg: fastcall.LaunchConfig, params: ctypes.Structure) -> None:
    """Called by every launch while `_recording` is set: keep a copy of it, if it is the recording thread's."""
    if threading.get_ident() == _owner:
        n = cfg.numAttrs
        attrs = bytes((fastcall.LaunchAttribute * n).from_address(ctypes.addressof(cfg.attrs.contents))) if n else b""
        _recording.append((func, (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY,
                                  cfg.blockDimZ, cfg.sharedMemBytes), attrs, bytes(params), type(params)))


def recorded(name: str, handle: int, op: object, args: tuple, written: tuple[int, ...],
             fields: dict[str, tuple[int, bool]], pinned: tuple[int, ...], call) -> None:
    """`call()`, op `name`'s checked Python path, recording its launches; then a record of `handle` from them, when
    every parameter field of `fields` ({field: (argument index, whether it may be the argument's address plus a fixed
    offset)}) holds its argument's address as the fast path would write it. `args`: the op's arguments; `written`:
    the outputs' indices; `pinned`: the tensors whose addresses are also in the launches elsewhere (tensor maps),
    which the record requires exactly."""
    global _recording, _owner
    if _recording is not None:   # (a call inside a recorded call: not recorded)
        return call()
    _recording, _owner = [], threading.get_ident()
    fastcall.recording = record_launch
    try:
        call()
    finally:
        launches, _recording, _owner = _recording, None, 0
        fastcall.recording = None
    spec = _spec(_op_codes[name], args, written, fields, pinned, launches, op) if launches else None
    if spec is None:   # (nothing launched, which the fast path cannot beat, or launches it cannot replay)
        return
    ints, blobs = spec
    arr = (ctypes.c_int64 * len(ints))(*ints)
    if _lib.meld_fc_push(handle, arr, len(ints), blobs, len(blobs)):
        raise RuntimeError(f"meld fast path: a malformed record: {_lib.meld_fc_error().decode()}")
    _with_record.add(handle)
    if handle not in _watched:
        _watched.add(handle)
        weakref.finalize(op, drop, handle)


def _spec(code: int, args: tuple, written: tuple[int, ...], fields: dict[str, tuple[int, bool]],
          pinned: tuple[int, ...], launches: list, op: object) -> tuple[list[int], bytes] | None:
    """The record as host/torch_fastcall.cpp's `parse` reads it, or None where the launches cannot be replayed by
    patching addresses (a field that does not hold its argument's address: a copy was launched)."""
    ints: list[int] = [code, len(args)]
    for i, a in enumerate(args):
        if a is None:
            ints.append(0)
        elif isinstance(a, torch.Tensor):
            if a.layout != torch.strided or a.dtype not in _SCALAR_TYPES:
                return None
            dev = a.device
            ints += [1, _SCALAR_TYPES[a.dtype], _DEVICE_TYPES[dev.type], -1 if dev.index is None else dev.index,
                     int(i in pinned), a.data_ptr(), int(i in written), a.dim(), *a.shape, *a.stride()]
        elif isinstance(a, float):
            ints += [2, struct.unpack("<q", struct.pack("<d", a))[0]]
        else:
            ints.append(3)
    patches: list[int] = []
    for li, (_, _, _, blob, ptype) in enumerate(launches):
        for name, (arg, offset_ok) in fields.items():
            t = args[arg]
            if t is None or not hasattr(ptype, name):
                continue
            field = getattr(ptype, name)
            if field.size != 8:   # (the fast path writes 8-byte addresses)
                return None
            off = field.offset
            addend = int.from_bytes(blob[off:off + 8], "little") - t.data_ptr()
            if addend and not offset_ok:
                return None
            patches += [li, off, arg, addend]
    ints += [len(patches) // 4, *patches, len(launches)]
    blobs = b""
    for func, dims, attrs, blob, _ in launches:
        ints += [func, *dims, len(attrs) // ctypes.sizeof(fastcall.LaunchAttribute), len(blob)]
        blobs += attrs + blob
    dev = op.device
    ints += [_DEVICE_TYPES[dev.type], -1 if dev.index is None else dev.index,
             ctypes.addressof(op._watchdog.record)]   # (`tripped` is the record's first field)
    return ints, blobs


_DEVICE_TYPES = {"cpu": 0, "cuda": 1}   # c10::DeviceType


_SCALAR_TYPES = {t: i for i, t in enumerate([   # c10::ScalarType's numbers (the enum's order)
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64,
    torch.complex32, torch.complex64, torch.complex128, torch.bool, torch.qint8, torch.quint8, torch.qint32,
    torch.bfloat16, torch.quint4x2, torch.quint2x4, torch.bits1x8, torch.bits2x4, torch.bits4x2, torch.bits8,
    torch.bits16, torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e5m2fnuz, torch.float8_e4m3fnuz])}
