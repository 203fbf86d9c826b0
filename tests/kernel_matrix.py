"""Helpers for the tests' kernel matrices: kernels compiled through the run's compile cache, and pairwise
coverage of a large matrix (the rest behind the `full_matrix` marker)."""
from __future__ import annotations

import itertools

import pytest

from meld import config
from meld.codegen import compile_source


def nvcc(source: str, name: str, arch: str = "sm_90a") -> tuple[bytes, str]:
    """(cubin, log) from nvcc, as `compile_nvcc` returns them, through the compile cache that
    tests/conftest.py sets up for the run: a source that several tests build compiles once, and the log
    (ptxas's registers and spills, which the tests check) comes back with a cached cubin."""
    with config.scope(MELD_COMPILER="nvcc"):
        c = compile_source(source, name, arch)
    return c.cubin, c.log


def pairwise(cases: list[tuple], keep=lambda case: False) -> list:
    """`cases` (tuples of one parameter each position) as pytest params: a subset in which every pair of
    values that two positions take together in some case appears together at least once runs by default;
    the rest are marked `full_matrix` (off unless asked for with `-m full_matrix`). The subset holds the
    cases `keep` names (the default builds, say) and then, greedily in order, the case covering the most
    pairs not yet covered, so it is the same every run."""
    def pairs(case):
        return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(case)), 2)}

    picked = set(filter(keep, cases))
    left = set().union(*map(pairs, cases)) - set().union(*map(pairs, picked))
    while left:
        best = max((c for c in cases if c not in picked), key=lambda c: len(pairs(c) & left))
        picked.add(best)
        left -= pairs(best)
    return [pytest.param(*c) if c in picked else pytest.param(*c, marks=pytest.mark.full_matrix) for c in cases]
