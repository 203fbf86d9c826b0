"""The C helper that validates and stages a host page table agrees with the NumPy checks: same verdict,
same offending entry, same staged bytes, same largest page index."""
import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meld.ops.page_table import check_page_table, max_page, page_table_error
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
    """The rules of the page-table checks (meld.ops.page_table), written out plainly in Python ints."""
    if indptr[0] != 0:
        return 1, None
    pages = np.diff(indptr.astype(object))
    for b, n in enumerate(pages):
        if n < 0:
            return 2, b
        if n > 0 and not 1 <= last[b] <= P:
            return 4, b
        if (n - 1) * P + int(last[b]) > 2 ** 31 - 1:
            return 6, b
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
    assert _numpy_message(indptr, last, indices, P) == _c_message(err, where, indptr, last, indices, P)
    if err == 0:
        assert np.array_equal(raw, np.r_[indptr, last])
        assert np.array_equal(staged[:nnz], indices[:nnz])
        assert top == (int(indices[:nnz].max()) if nnz else -1)


@pytest.mark.parametrize("indptr,P,code,where", [
    ([0, 2 ** 31 - 1, -2 ** 31 + 1], 1, 2, 1),     # the int32 difference wraps to +2: must not pass
    ([0, 3, 2 ** 31 - 1, -2 ** 31], 1, 2, 2),
    ([0, 2 ** 31 - 1, -2 ** 31 + 1], 16, 6, 0),    # 2**31 - 1 pages of 16 tokens: far too long
    ([0, 2 ** 27, 2 ** 27 + 1], 16, 6, 0),         # 2**27 full pages of 16: 2**31 tokens in request 0
])
def test_offsets_near_int32_limits(indptr, P, code, where):
    indptr = np.asarray(indptr, dtype=np.int32)
    last = np.full(len(indptr) - 1, P, dtype=np.int32)
    indices = np.zeros(4, dtype=np.int32)   # never reached: the offsets fail first
    err, at, *_ = _stage(indptr, last, indices, P)
    assert (err, at) == (code, where)
    with pytest.raises(ValueError, match="never decrease" if code == 2 else "more than 2147483647 KV tokens"):
        check_page_table(indptr, last, len(indices), P)


@settings(max_examples=300, deadline=None)
@given(offsets=st.lists(st.integers(-2 ** 31, 2 ** 31 - 1), min_size=1, max_size=6), P=st.sampled_from([1, 16, 1000]))
def test_wild_offsets_get_the_same_verdict_everywhere(offsets, P):
    """Any int32 offsets: the C helper, the NumPy checks and the plain rules agree on accepting them."""
    indptr = np.asarray([0] + offsets, dtype=np.int32)
    last = np.ones(len(offsets), dtype=np.int32)
    indices = np.zeros(8, dtype=np.int32)
    err, where, *_ = _stage(indptr, last, indices, P)
    code, at = _numpy_verdict(indptr, last, indices, P)
    assert err == code and (at is None or where == at)
    assert _numpy_message(indptr, last, indices, P) == _c_message(err, where, indptr, last, indices, P)


def _numpy_message(indptr, last, indices, P) -> str | None:
    try:
        check_page_table(indptr, last, len(indices), P)
        max_page(indices[:indptr[-1]])
    except ValueError as e:
        return str(e)
    return None


def _c_message(err, where, indptr, last, indices, P) -> str | None:
    try:
        if err:
            page_table_error(err, where, indptr, last, len(indices), indices, P)
    except ValueError as e:
        return str(e)
    return None
