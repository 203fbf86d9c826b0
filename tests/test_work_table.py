"""Work tables declared once (meld/ir/work_table.py): host packing agrees with the generated C layout."""
import numpy as np
import pytest

from meld.ir.work_table import CTA_TABLE, MOE_TASK, ROW_BLOCKS, PackedWord, Table


@pytest.mark.parametrize("table", [CTA_TABLE, ROW_BLOCKS, Table("T", ("a", "b", "c"))])
def test_pack_unpack_round_trip_and_index(table):
    n = 5
    cols = {f: np.arange(n) * 10 + i for i, f in enumerate(table.fields)}
    flat = table.pack(n, **cols)
    back = table.unpack(flat, n)
    assert all(np.array_equal(back[f], cols[f]) for f in table.fields)
    for i, f in enumerate(table.fields):
        assert flat[table.index(f, 3, n)] == 30 + i
    assert (f"constexpr int {table.name.upper()}_{table.fields[1].upper()} = 1;") in table.c_source()


def test_table_refuses_unknown_fields():
    with pytest.raises(TypeError, match="declared"):
        CTA_TABLE.pack(2, u_begin=[0, 1])


def test_packed_word_layout_matches_its_c_source():
    w = int(MOE_TASK.pack(kind=1, col=37, row_block=1000))
    assert w == 1 | 37 << 1 | 1000 << 12
    src = MOE_TASK.c_source()
    assert "(kind << 0) | (col << 1) | (row_block << 12)" in src and "& 524287" in src
    with pytest.raises(ValueError, match="col"):
        MOE_TASK.pack(kind=0, col=MOE_TASK.limit("col"), row_block=0)
    with pytest.raises(ValueError, match="bits"):
        PackedWord("Big", (("a", 16), ("b", 16)))
