"""Helpers for the tests' kernel matrices: kernels compiled through the run's compile cache."""
from __future__ import annotations

from meld import config
from meld.codegen import compile_source


def nvcc(source: str, name: str, arch: str = "sm_90a") -> tuple[bytes, str]:
    """(cubin, log) from nvcc, as `compile_nvcc` returns them, through the compile cache that
    tests/conftest.py sets up for the run: a source that several tests build compiles once, and the log
    (ptxas's registers and spills, which the tests check) comes back with a cached cubin."""
    with config.scope(MELD_COMPILER="nvcc"):
        c = compile_source(source, name, arch)
    return c.cubin, c.log

