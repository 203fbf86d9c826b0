"""The C helper that validates and stages a host page table agrees with the NumPy checks: same verdict,
same offending entry, same staged bytes, same largest page index."""
import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meld.runtime import host_helper

lib = host_helper.load()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: plan() uses its NumPy path")


def _stage(indptr, last, indices, page_size):
    B = len(last)
    raw = np.full(2 * B + 1, -7, dtype=np.int32)
    staged = np.full(max(len(indices), 1), -7, dtype=np.int32)
    top, where = ctypes.c_int(-9), ctypes.c_longlong(-1)
    err = lib.meld_stage_page_table(indptr.ctypes.data, last.ctypes.data, indices.ctypes.data, B, len(indices),
                                    page_size, raw.ctypes.data, staged.ctypes.data, ctypes.byref(top),
                                    ctypes.byref(where))
    return err, where.value, raw, staged, top.value


def _numpy_verdict(indptr, last, indices, P):
    """The NumPy path's rules (meld.ops.decode_attention), written out plainly."""
    if indptr[0] != 0:
        return 1, None
    pages = np.diff(indptr)
    for b, n in enumerate(pages):
        if n < 0:
            return 2, b
        if n > 0 and not 1 <= last[b] <= P:
            return 4, b
    nnz = indptr[-1]
    if nnz > len(indices):
        return 3, None
    neg = np.flatnonzero(indices[:nnz] < 0)
    return (5, int(neg[0])) if len(neg) else (0, None)


@settings(max_examples=300, deadline=None)
@given(pages=st.lists(st.integers(-1, 5), max_size=20), P=st.sampled_from([1, 16]), data=st.data())
def test_agrees_with_numpy(pages, P, data):
    indptr = np.r_[0, np.cumsum(pages)].astype(np.int32)
    if data.draw(st.booleans()):
        indptr[0] = data.draw(st.integers(-1, 1))
    last = np.asarray(data.draw(st.lists(st.integers(-1, P + 1), min_size=len(pages), max_size=len(pages))),
                      dtype=np.int32)
    nnz = max(int(indptr[-1]), 0)
    indices = np.asarray(data.draw(st.lists(st.integers(-2, 1000), min_size=nnz, max_size=nnz + 3)), dtype=np.int32)
    err, where, raw, staged, top = _stage(indptr, last, indices, P)
    code, at = _numpy_verdict(indptr, last, indices, P)
    assert err == code
    if at is not None:
        assert where == at
    if err == 0:
        assert np.array_equal(raw, np.r_[indptr, last])
        assert np.array_equal(staged[:nnz], indices[:nnz])
        assert top == (int(indices[:nnz].max()) if nnz else -1)
