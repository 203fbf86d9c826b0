"""Host code in C and C++, compiled at first use with the system compiler (like Triton's launcher stubs)
into MELD_CACHE_DIR, keyed by the source and compiler, and loaded with ctypes:

- the host half of decode's plan(): validate the page table and stage it in one pass (`load()`); where no
  compiler works it returns None and plan() uses its NumPy path, which checks the same things (tests run
  both on the same inputs);
- the fused MoE's host planner (`load_moe_plan()`), built from the same plan rules as the GPU planner
  (templates/moe_plan.h), for the CPU reference executor;
- decode's host planner (`load_decode_plan()`): the GPU planner's own source (templates/decode_plan.h)
  compiled as C++ for a block of one thread, for the CPU reference executor and `DecodeAttention.schedule`;
  grouped attention's likewise (`load_split_reduce_plan()`, templates/split_reduce_plan.h);
- the GPU proxy thread of meld.distributed's proxy transport (`load_proxy()`), which must run without the GIL.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources

import numpy as np

from .. import config

_SOURCE = "stage_page_table.c"
_lib: ctypes.CDLL | None | bool = False   # False: not tried yet
_moe_lib: ctypes.CDLL | None = None
_decode_lib: ctypes.CDLL | None = None
_split_lib: ctypes.CDLL | None = None
_proxy_lib: ctypes.CDLL | None = None
_COMPILERS = {"c": ("CC", "cc", "gcc"), "c++": ("CXX", "c++", "g++")}   # the variable, then the names tried


def _read(pkg: str, path: str) -> str:
    return resources.files(pkg).joinpath(path).read_text()


def _build(name: str, sources: list[str], lang: str = "c", flags: tuple[str, ...] = (), std: str = "c++17",
           why: list[str] | None = None) -> ctypes.CDLL | None:
    """Compile the concatenated `sources` (texts in `lang`: "c", or "c++" as `std`) into lib `name`, with `flags`
    after the source (include and library paths, libraries); None without a working compiler ($CC, cc or gcc for
    C; $CXX, c++ or g++ for C++) or where the compiler fails, and then `why`, if given, gets the reason."""
    env, *names = _COMPILERS[lang]
    cc = os.environ.get(env) or next(filter(None, map(shutil.which, names)), None)
    if cc is None:
        if why is not None:
            why.append(f"no {lang} compiler (${env}, {' or '.join(names)})")
        return None
    src = "\n".join(sources)
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        if why is not None:
            why.append(f"{cc} --version failed: {e}")
        return None
    key = hashlib.sha256((src + version + ("\n".join(flags) if flags else "")
                          + ("" if std == "c++17" else std)).encode()).hexdigest()[:16]
    out = config.cache_dir() / f"{name}_{key}.so"
    if not out.exists():
        config.made_dir("MELD_CACHE_DIR", out.parent)
        with tempfile.TemporaryDirectory(prefix="meld-cc-") as tmp:
            c, so = os.path.join(tmp, f"{name}.{'cpp' if lang == 'c++' else 'c'}"), os.path.join(tmp, "lib.so")
            with open(c, "w") as f:
                f.write(src)
            std_flag = [f"-std={std}"] if lang == "c++" else []
            res = subprocess.run([cc, *std_flag, "-O3", "-shared", "-fPIC", "-o", so, c, *flags], capture_output=True,
                                 text=True)
            if res.returncode != 0:
                if why is not None:
                    why.append(f"{cc} failed: {res.stderr.strip()[-2000:]}")
                return None
            fd, part = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".")
            os.close(fd)
            shutil.copyfile(so, part)
            os.replace(part, out)
    return ctypes.CDLL(str(out))


def _build_stage() -> ctypes.CDLL | None:
    lib = _build("stage_page_table", [_read("meld.runtime", f"host/{_SOURCE}")])
    if lib is None:
        return None
    fn = lib.meld_stage_page_table
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_longlong)]
    fn.restype = ctypes.c_int
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled helper, or None where it cannot be built (then callers use NumPy)."""
    global _lib
    if _lib is False:
        _lib = _build_stage()
    return _lib


def load_moe_plan() -> ctypes.CDLL:
    """The MoE host planner; RuntimeError where no C++ compiler works (the CPU executor needs it)."""
    global _moe_lib
    if _moe_lib is None:
        from ..ir.work_table import MOE_TILE

        lib = _build("moe_plan", [_read("meld.runtime", "host/one_thread.h"), MOE_TILE.c_source(),
                                  _read("meld.codegen", "templates/moe_plan.h"),
                                  _read("meld.runtime", "host/moe_plan.cpp")], "c++")
        if lib is None:
            raise RuntimeError("meld.MoE(device='cpu') compiles its host planner with the system C++ compiler "
                               "(c++ or g++, or $CXX), and none worked")
        fn = lib.meld_moe_plan
        fn.argtypes = [ctypes.c_void_p, *[ctypes.c_int] * 7, *[ctypes.c_void_p] * 6, ctypes.c_int]
        fn.restype = ctypes.c_longlong
        _moe_lib = lib
    return _moe_lib


def load_decode_plan() -> ctypes.CDLL:
    """Decode's host planner; RuntimeError where no C++ compiler works (the CPU executor and `schedule` need it)."""
    global _decode_lib
    if _decode_lib is None:
        from ..codegen.decode_kernel import plan_source
        from ..codegen.source import SMEM_PER_CTA_MAX

        # (built with token requests: the one host planner serves both GPU builds, token_requests=1 planning as
        # the default build does)
        lib = _build("decode_plan", [_read("meld.runtime", "host/one_thread.h"), plan_source(1, token_requests=True),
                                     f"#define PLAN_SMEM_BYTES {SMEM_PER_CTA_MAX}",
                                     _read("meld.runtime", "host/decode_plan.cpp")], "c++")
        if lib is None:
            raise RuntimeError("meld.DecodeAttention plans on the host (device='cpu', and `schedule`) with the GPU "
                               "planner's source compiled by the system C++ compiler (c++ or g++, or $CXX), and "
                               "none worked")
        fn = lib.meld_decode_plan_host
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = None
        _decode_lib = lib
    return _decode_lib


def load_split_reduce_plan() -> ctypes.CDLL:
    """Grouped attention's host planner; RuntimeError where no C++ compiler works (the CPU executor needs it)."""
    global _split_lib
    if _split_lib is None:
        from ..codegen.params import SPLIT_PLAN_PARAMS
        from ..ir.work_table import EVENT, SPLIT_TASK

        lib = _build("split_reduce_plan", [_read("meld.runtime", "host/one_thread.h"), "#define PLAN_THREADS 1",
                                           SPLIT_PLAN_PARAMS.c_source(), SPLIT_TASK.c_source(), EVENT.c_source(),
                                           _read("meld.codegen", "templates/split_reduce_plan.h"),
                                           _read("meld.runtime", "host/split_reduce_plan.cpp")], "c++")
        if lib is None:
            raise RuntimeError("meld's grouped attention (CascadeDecode) plans on the host with the GPU planner's "
                               "source compiled by the system C++ compiler (c++ or g++, or $CXX), and none worked")
        fn = lib.meld_split_reduce_plan_host
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = None
        _split_lib = lib
    return _split_lib


class ProxyConfig(ctypes.Structure):
    """gpu_proxy.cpp's MeldProxyConfig."""
    _fields_ = [("records", ctypes.c_void_p), ("head", ctypes.c_void_p), ("capacity", ctypes.c_longlong),
                ("peers", ctypes.c_void_p), ("window_bytes", ctypes.c_ulonglong), ("chunk", ctypes.c_ulonglong),
                ("seed", ctypes.c_ulonglong), ("poll_ns", ctypes.c_longlong), ("world", ctypes.c_int),
                ("rank", ctypes.c_int), ("ordered", ctypes.c_int), ("device", ctypes.c_int), ("engine", ctypes.c_int)]


PROXY_OP = np.dtype([("kind", "<i4"), ("dst", "<i4"), ("stream", "<i4"), ("pad", "<i4"), ("start", "<u8"),
                     ("count", "<u8"), ("value", "<i8")])   # gpu_proxy.cpp's Op


def load_proxy() -> ctypes.CDLL:
    """The GPU proxy (runtime/host/gpu_proxy.cpp); RuntimeError where no C++ compiler works."""
    global _proxy_lib
    if _proxy_lib is None:
        lib = _build("gpu_proxy", [_read("meld.runtime", "host/gpu_proxy.cpp")], "c++")
        if lib is None:
            raise RuntimeError("meld.distributed's proxy transport compiles its host thread with the system C++ compiler "
                               "(c++ or g++, or $CXX), and none worked")
        lib.meld_proxy_start.argtypes = [ctypes.POINTER(ProxyConfig), ctypes.c_char_p, ctypes.c_int]
        lib.meld_proxy_start.restype = ctypes.c_void_p
        lib.meld_proxy_error.argtypes = [ctypes.c_void_p]
        lib.meld_proxy_error.restype = ctypes.c_char_p
        lib.meld_proxy_landed.argtypes = [ctypes.c_void_p]
        lib.meld_proxy_landed.restype = ctypes.c_longlong
        lib.meld_proxy_stop.argtypes = [ctypes.c_void_p]
        lib.meld_proxy_stop.restype = None
        lib.meld_proxy_plan.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_ulonglong,
                                        ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_void_p,
                                        ctypes.c_longlong]
        lib.meld_proxy_plan.restype = ctypes.c_longlong
        lib.meld_proxy_config_bytes.restype = ctypes.c_longlong
        if lib.meld_proxy_config_bytes() != ctypes.sizeof(ProxyConfig):
            raise RuntimeError(f"gpu_proxy.cpp's MeldProxyConfig is {lib.meld_proxy_config_bytes()} bytes, "
                               f"host_helper.ProxyConfig {ctypes.sizeof(ProxyConfig)}")
        _proxy_lib = lib
    return _proxy_lib


def proxy_plan(records: np.ndarray, world: int, window_bytes: int, ordered: bool, chunk: int,
               seed: int = 0) -> np.ndarray:
    """The operations the GPU proxy issues for `records` (transport.COMMAND), in its order (`PROXY_OP`):
    its schedule without CUDA, for the tests."""
    from ..distributed.transport import PUT

    lib = load_proxy()
    recs = np.ascontiguousarray(records)
    cap = sum(-(-int(r["count"]) // chunk) if int(r["op"]) == PUT else 1 for r in recs) + 1
    out = np.zeros(cap, dtype=PROXY_OP)
    n = lib.meld_proxy_plan(recs.ctypes.data, len(recs), world, window_bytes, int(ordered), chunk, seed,
                            out.ctypes.data, cap)
    if n < 0:
        raise ValueError("a record the GPU proxy rejects (rank, window range or op)")
    return out[:n]
