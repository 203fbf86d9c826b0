"""Work tables declared once (meld/ir/work_table.py): host packing agrees with the generated C layout."""
import numpy as np
import pytest

from meld.ir.work_table import CTA_TABLE, MOE_TILE, ROW_BLOCKS, Table


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


def test_max_entries_keeps_every_flat_index_in_an_int32():
    n = MOE_TILE.max_entries
    assert MOE_TILE.index(MOE_TILE.fields[-1], n - 1, n) <= 2 ** 31 - 1 < MOE_TILE.width * (n + 1) - 1


def test_family_tables_are_views_of_the_one_task_layout():
    """Decode/MLA segments, grouped pieces, TP pieces and MoE tiles are rows of TASK: the same width and order, the
    shared header at the same indices, their own kinds."""
    from meld.ir.work_table import SPLIT_TASK, TASK, TP_PIECE

    header = ("kind", "cta", "slot", "event_first", "event_count")
    views = (CTA_TABLE, SPLIT_TASK, TP_PIECE, MOE_TILE)
    for view in views:
        assert (view.width, view.field_major) == (TASK.width, TASK.field_major)
        assert all(view.fields.index(f) == TASK.fields.index(f) for f in header)
        assert f"constexpr int {view.name.upper()}_TASK_KIND = {view.kind};" in view.c_source()
    assert len({v.kind for v in views}) == len(views)
    with pytest.raises(TypeError, match="not fields"):
        TASK.view("Bad", "piece", nope="x")


def _task_rows(flat, count):
    from meld.ir.work_table import TASK

    return TASK.unpack(flat, count)


def test_every_family_planner_emits_task_rows():
    """Each planner's rows read as TASK rows: decode and MLA (NumPy and the host build of the GPU planner),
    grouped attention and MoE (NumPy and host): kind, CTA, range, slot and events agree with the family's view."""
    from meld.ir.work_table import SPLIT_TASK
    from meld.scheduler import GroupTable, Topology, plan_decode, plan_split_reduce
    from meld.scheduler.decode_plan_host import plan_decode_host
    from meld.scheduler.moe_plan import plan_moe, plan_moe_host
    from meld.scheduler.split_reduce_plan import plan_split_reduce_numpy

    rng = np.random.default_rng(3)
    L = rng.integers(0, 3000, 37)
    pages = -(-L // 16)
    indptr = np.r_[0, np.cumsum(pages)].astype(np.int64)
    last = np.where(L > 0, L - (pages - 1) * 16, 16).astype(np.int64)
    for kvh, group in ((4, 8), (1, 16)):   # GQA decode; MLA (one latent kv head)
        for s in (plan_decode(L, indptr[:-1], kvh, group, Topology(20)),
                  plan_decode_host(indptr, last, 16, kvh, group, Topology(20))):
            t = _task_rows(s.cta.reshape(-1), s.num_ctas)
            assert np.all(t["kind"] == CTA_TABLE.kind) and np.array_equal(t["cta"], np.arange(s.num_ctas))
            assert np.all(t["slot"] == -1) and np.array_equal(t["event_first"], t["first"])
            it = s.items()
            assert np.array_equal(np.bincount(it["cta"], minlength=s.num_ctas), t["event_count"])
    B, P = 6, 16
    prefix = GroupTable(np.array([0, 3, 6], dtype=np.int64), np.array([0, 40, 50], dtype=np.int64),
                        np.arange(50, dtype=np.int64), np.full(2, P, dtype=np.int64))
    own = GroupTable(np.arange(B + 1, dtype=np.int64), np.arange(0, 3 * B + 1, 3, dtype=np.int64),
                     np.arange(3 * B, dtype=np.int64), np.full(B, 5, dtype=np.int64))
    for plan in (plan_split_reduce_numpy([prefix, own], B, 2, 4, P, 7),
                 plan_split_reduce([prefix, own], B, 2, 4, P, 7)):
        t, named = _task_rows(plan.tasks, plan.num_tasks), plan.task_columns()
        assert np.all(t["kind"] == SPLIT_TASK.kind) and np.array_equal(t["first"], t["last"])
        assert np.all(np.diff(t["cta"]) >= 0) and np.all(t["event_count"] > 0) and np.all(t["slot"] >= 0)
        assert np.array_equal(t["arg0"], named["producer"]) and np.array_equal(t["begin"], named["kv_begin"])
    ids = np.stack([rng.permutation(9)[:3] for _ in range(40)])
    for plan in (plan_moe(ids, 9, 16, 3, 2, 5), plan_moe_host(ids, 9, 16, 3, 2, 5)):
        t, named = _task_rows(plan.tiles, plan.num_tiles), plan.tile_columns()
        assert plan.num_tiles == len(plan.row_blocks) * 5 and np.all(t["kind"] == MOE_TILE.kind)
        assert np.all(t["cta"] == -1) and np.all(t["slot"] == -1) and np.all(t["event_count"] == 1)
        assert np.array_equal(t["first"], t["last"]) and np.array_equal(t["end"], t["begin"] + 1)
        assert np.array_equal(t["event_first"], t["first"]) and np.array_equal(t["arg0"], named["gemm"])
