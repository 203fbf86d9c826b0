"""Every `MELD_*` setting in one place, read live (so tests can override them with `scope`).

| variable          | default          | meaning                                                        |
| ----------------- | ---------------- | -------------------------------------------------------------- |
| MELD_CACHE_DIR    | ~/.cache/meld    | compiled kernels (cubin, source, log), keyed by content hash   |
| MELD_DUMP_DIR     | (unset)          | write every stage (task graph, schedule, .cu, cubin) here      |
| MELD_COMPILER     | auto             | `nvrtc`, `nvcc`, or `auto` (NVRTC, falling back to nvcc)       |
| MELD_ARCH         | sm_90a           | target architecture of generated kernels                       |
| MELD_PROFILE      | 0                | 1: kernels record per-task timestamps; eager runs write traces |
| MELD_PROFILE_DIR  | meld-profile     | where MELD_PROFILE=1 writes Chrome/Perfetto traces             |
| MELD_PROFILE_EVERY| 1                | a profiled kernel records one launch in this many (sampling)   |
| MELD_TUNING_DB    | (unset)          | JSON tuning database operators take their tuned configs from   |
| MELD_RECORD       | (unset)          | append sampled batches (plan()'s KV lengths) to this JSON-lines file |
| MELD_RECORD_EVERY | 100              | record one plan() in this many                                 |
| MELD_TORCH_FASTCALL | 1              | 0: the torch ops keep their Python kernels on the GPU (no C++ fast path) |
"""
from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Iterator

_DEFAULTS = {
    "MELD_CACHE_DIR": str(Path.home() / ".cache" / "meld"),
    "MELD_DUMP_DIR": "",
    "MELD_COMPILER": "auto",
    "MELD_ARCH": "sm_90a",
    "MELD_PROFILE": "0",
    "MELD_PROFILE_DIR": "meld-profile",
    "MELD_PROFILE_EVERY": "1",
    "MELD_TUNING_DB": "",
    "MELD_RECORD": "",
    "MELD_RECORD_EVERY": "100",
    "MELD_TORCH_FASTCALL": "1",
}


def get(name: str) -> str:
    if name not in _DEFAULTS:
        raise KeyError(f"unknown meld setting {name!r}; known: {sorted(_DEFAULTS)}")
    return os.environ.get(name, _DEFAULTS[name])


def cache_dir() -> Path:
    return Path(get("MELD_CACHE_DIR")).expanduser()


def made_dir(name: str, path: Path) -> Path:
    """`path`, the directory setting `name` (MELD_CACHE_DIR, MELD_DUMP_DIR) names, created if missing; a
    ValueError naming the setting where it cannot be (a file there, a folder that cannot be written)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:   # mkdir(exist_ok=True) says this only when something other than a directory is there
        raise ValueError(f"{name}={str(path)!r} is not a directory (a file is there)") from None
    except OSError as e:
        raise ValueError(f"{name}={str(path)!r}: cannot create the directory: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{name}={str(path)!r}: the directory cannot be written")
    return path


def dump_dir() -> Path | None:
    d = os.environ.get("MELD_DUMP_DIR")   # read directly: plan() asks on every call
    return Path(d).expanduser() if d else None


_ARCH = re.compile(r"sm_(\d+)a?")


def arch() -> str:
    """MELD_ARCH, an architecture meld's kernels can be built for: sm_90a (Hopper's wgmma), or sm_90 or newer."""
    a = get("MELD_ARCH")
    m = _ARCH.fullmatch(a)
    if m is None or int(m[1]) < 90:
        raise ValueError(f"MELD_ARCH={a!r}: expected sm_90a (meld's kernels need Hopper, sm_90 or newer)")
    return a


def _flag(name: str, yes: str) -> bool:
    """A 0/1 setting: 1 is True, 0 or empty False; anything else ("yes", "false") is a ValueError rather than a
    guess (`yes` says what 1 does)."""
    v = get(name)
    if v not in ("", "0", "1"):
        raise ValueError(f"{name}={v!r}: expected 1 ({yes}) or 0 (do not)")
    return v == "1"


def profile() -> bool:
    """MELD_PROFILE=1: build kernels that record per-task start/end times (meld/runtime/profile.py)."""
    return _flag("MELD_PROFILE", "profile")


def torch_fastcall() -> bool:
    """MELD_TORCH_FASTCALL=0: the torch ops keep their Python kernels on the GPU (meld.runtime.torch_fastcall);
    read when the first CUDA operator is built, which installs the C++ kernels otherwise."""
    return _flag("MELD_TORCH_FASTCALL", "the C++ fast path")


def profile_every() -> int:
    """MELD_PROFILE_EVERY=N: profiled kernels record one launch in N (the launch number is counted on the
    GPU, so CUDA-graph replays are sampled too); eager runs write Chrome traces only when N is 1."""
    v = get("MELD_PROFILE_EVERY")
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"MELD_PROFILE_EVERY={v!r}: expected a positive integer")
    return n


def profile_dir() -> Path:
    return Path(get("MELD_PROFILE_DIR")).expanduser()


def tuning_db() -> Path | None:
    """The tuning database operators read at construction (meld.tuning.db), or None."""
    path = get("MELD_TUNING_DB")
    return Path(path).expanduser() if path else None


def compiler() -> str:
    c = get("MELD_COMPILER")
    if c not in ("auto", "nvrtc", "nvcc"):
        raise ValueError(f"MELD_COMPILER={c!r}: expected auto, nvrtc or nvcc")
    return c


@contextlib.contextmanager
def scope(**settings: str) -> Iterator[None]:
    """Temporarily override settings, e.g. `with config.scope(MELD_COMPILER="nvcc"): ...`."""
    old = {k: os.environ.get(k) for k in settings}
    for k, v in settings.items():
        get(k)
        os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def dump(name: str, content: str | bytes) -> None:
    """Write one pipeline stage to MELD_DUMP_DIR, if set."""
    d = dump_dir()
    if d is None:
        return
    made_dir("MELD_DUMP_DIR", d)
    try:
        (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    except OSError as e:
        raise ValueError(f"MELD_DUMP_DIR={str(d)!r}: cannot write {name}: {e.strerror or e}") from None
