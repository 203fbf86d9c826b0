"""The host half of plan() in C: validate the page table and stage it in one pass.

Compiled at first use with the system C compiler (like Triton's launcher stubs) into MELD_CACHE_DIR,
keyed by the source and compiler, and loaded with ctypes. Where no compiler works, `load()` returns None
and plan() uses its NumPy path, which checks the same things (tests run both on the same inputs).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources

from .. import config

_SOURCE = "stage_page_table.c"
_lib: ctypes.CDLL | None | bool = False   # False: not tried yet


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src = resources.files("meld.runtime").joinpath("host", _SOURCE).read_text()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    key = hashlib.sha256((src + version).encode()).hexdigest()[:16]
    out = config.cache_dir() / f"stage_page_table_{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="meld-cc-") as tmp:
            c, so = os.path.join(tmp, _SOURCE), os.path.join(tmp, "lib.so")
            with open(c, "w") as f:
                f.write(src)
            res = subprocess.run([cc, "-O3", "-shared", "-fPIC", "-o", so, c], capture_output=True, text=True)
            if res.returncode != 0:
                return None
            fd, part = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".")
            os.close(fd)
            shutil.copyfile(so, part)
            os.replace(part, out)
    lib = ctypes.CDLL(str(out))
    fn = lib.meld_stage_page_table
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_longlong)]
    fn.restype = ctypes.c_int
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled helper, or None where it cannot be built (then callers use NumPy)."""
    global _lib
    if _lib is False:
        _lib = _build()
    return _lib
