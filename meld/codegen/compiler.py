"""CUDA C++ -> cubin, with NVRTC first and nvcc as the fallback, cached on disk.

Why NVRTC: it ships as a pip wheel, needs no toolkit on the serving machine and compiles in-process.
nvcc stays as the fallback (and as a second opinion in the CPU tests). The cache key is the sha256 of
sorted JSON of everything that changes the binary — source, options, arch, compiler and its version,
meld's version — and entries are written atomically (temporary file + os.replace) so concurrent
processes never read a half-written cubin. The `.cu` is kept next to the `.cubin` for debugging, and the
compiler's log (with nvcc, ptxas's registers and spills: what the CPU tests check) as `.log`, written
before the cubin, so a cache hit returns the `Compiled` of the compile that filled it (two processes
compiling one source at once may leave one's log beside the other's cubin: the same compile, nvcc's
timings aside).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import config

COMMON_OPTIONS = ("-std=c++17", "-lineinfo")
NVCC_OPTIONS = ("-cubin", "-Xptxas=-v")   # -v: ptxas logs each kernel's registers, spills and shared memory


class CompileError(RuntimeError):
    """The generated source did not compile; the message carries the compiler log."""


@dataclass(frozen=True)
class Compiled:
    name: str
    cubin: bytes
    source: str
    compiler: str
    log: str


def _nvrtc_version() -> str | None:
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        return None
    err, major, minor = nvrtc.nvrtcVersion()
    return f"nvrtc-{major}.{minor}" if err == nvrtc.nvrtcResult.NVRTC_SUCCESS else None


def _nvcc_path() -> str | None:
    return shutil.which("nvcc") or (str(p) if (p := Path("/usr/local/cuda/bin/nvcc")).exists() else None)


@functools.lru_cache(maxsize=None)   # one `nvcc --version` a process, not one a compile
def _nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return "nvcc-" + out.strip().splitlines()[-1].split()[-1]


def _compile_nvrtc(source: str, name: str, arch: str) -> tuple[bytes, str]:
    from cuda.bindings import nvrtc

    def check(res, what: str, prog=None) -> None:
        err = res[0] if isinstance(res, tuple) else res
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            log = _nvrtc_log(nvrtc, prog) if prog is not None else ""
            raise CompileError(f"NVRTC {what} failed for {name} ({err.name}):\n{log}")

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    check(err, "create")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in COMMON_OPTIONS)]
        check(nvrtc.nvrtcCompileProgram(prog, len(opts), opts), "compile", prog)
        log = _nvrtc_log(nvrtc, prog)
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        check(err, "get cubin size")
        cubin = bytearray(size)   # NVRTC writes into it: never a bytes object (see _nvrtc_log)
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "get cubin")
        return bytes(cubin), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvrtc_log(nvrtc, prog) -> str:
    # A mutable buffer: an empty log has size 1, and `b" " * 1` is CPython's shared b" " object, which
    # NVRTC would overwrite with the terminating NUL for the whole process.
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = bytearray(size)
    nvrtc.nvrtcGetProgramLog(prog, log)
    return log.decode(errors="replace").rstrip("\x00 \n")


def compile_nvcc(source: str, name: str, arch: str, nvcc: str | None = None) -> tuple[bytes, str]:
    """Compile with nvcc (also used by the CPU tests to check every generated kernel)."""
    nvcc = nvcc or _nvcc_path()
    if nvcc is None:
        raise CompileError("nvcc not found on PATH (and NVRTC unavailable): cannot compile kernels")
    num = arch.removeprefix("sm_")
    with tempfile.TemporaryDirectory(prefix="meld-nvcc-") as tmp:
        src, out = Path(tmp) / f"{name}.cu", Path(tmp) / f"{name}.cubin"
        src.write_text(source)
        cmd = [nvcc, f"-gencode=arch=compute_{num},code=sm_{num}", *NVCC_OPTIONS, *COMMON_OPTIONS,
               "-o", str(out), str(src)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise CompileError(f"nvcc failed for {name}:\n{res.stderr}")
        return out.read_bytes(), res.stderr


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def compile_source(source: str, name: str, arch: str | None = None) -> Compiled:
    """Compile `source` to a cubin for `arch` (default MELD_ARCH), through the on-disk cache."""
    from .. import __version__

    arch = arch or config.arch()
    choice = config.compiler()
    nvrtc_ver = _nvrtc_version() if choice in ("auto", "nvrtc") else None
    if choice == "nvrtc" and nvrtc_ver is None:
        raise CompileError("MELD_COMPILER=nvrtc but cuda.bindings.nvrtc is not importable")
    nvcc = None if nvrtc_ver else _nvcc_path()
    if nvrtc_ver is None and nvcc is None:
        raise CompileError("no CUDA compiler: install cuda-python + nvidia-cuda-nvrtc, or put nvcc on PATH")
    compiler = nvrtc_ver or _nvcc_version(nvcc)
    options = COMMON_OPTIONS if nvrtc_ver else NVCC_OPTIONS + COMMON_OPTIONS
    key = hashlib.sha256(json.dumps(
        {"source": source, "options": options, "arch": arch, "compiler": compiler, "meld": __version__},
        sort_keys=True).encode()).hexdigest()[:24]
    cache = config.cache_dir()
    cubin_path, log_path = cache / f"{name}_{key}.cubin", cache / f"{name}_{key}.log"
    if cubin_path.exists() and log_path.exists():   # the cubin is written last: its log is there (or an old entry)
        cubin, log = cubin_path.read_bytes(), log_path.read_text()
    else:
        cubin, log = _compile_nvrtc(source, name, arch) if nvrtc_ver else compile_nvcc(source, name, arch, nvcc)
        config.made_dir("MELD_CACHE_DIR", cache)
        _atomic_write(cache / f"{name}_{key}.cu", source.encode())
        _atomic_write(log_path, log.encode())
        _atomic_write(cubin_path, cubin)
    config.dump(f"{name}.cu", source)
    config.dump(f"{name}.cubin", cubin)
    return Compiled(name, cubin, source, compiler, log)
