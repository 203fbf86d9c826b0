"""tools/cascade_tasks.py's analysis on a synthetic launch: a real plan, task durations made from a known cost
model, so the fit must give that model back."""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from meld.runtime.profile import CtaSpan, TaskRecord, Trace
from meld.scheduler.split_reduce_plan import GroupTable, plan_split_reduce

_spec = importlib.util.spec_from_file_location("meld_tools_cascade_tasks",
                                               Path(__file__).parents[1] / "tools" / "cascade_tasks.py")
cascade_tasks = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cascade_tasks   # (its dataclass looks its module up)
_spec.loader.exec_module(cascade_tasks)

P = 16


def _plan(batch=64):
    """A 64-request batch: a shared 4096-token prefix (slices of 128 rows at group 4) and suffixes of 200-900."""
    lens = np.random.default_rng(1).integers(200, 900, batch)
    pages = -(-lens // P)
    shared = GroupTable(np.array([0, batch]), np.array([0, 256]), np.arange(256, dtype=np.int64), np.array([P]))
    own = GroupTable(np.arange(batch + 1, dtype=np.int64), 256 + np.r_[0, np.cumsum(pages)].astype(np.int64),
                     np.arange(256, 256 + pages.sum(), dtype=np.int64), (lens - (pages - 1) * P).astype(np.int64))
    return plan_split_reduce([shared, own], batch, 8, 4, P, 132)


def test_the_fit_gives_back_the_cost_model_and_the_cta_times():
    plan = _plan()
    t = plan.task_columns()
    model = {True: (3.0, 10.0), False: (6.0, 30.0)}   # (fixed µs, ns a token): split, row block
    clock, tasks, spans = {}, [], []
    for i in range(plan.num_tasks):
        cta, n = int(t["cta"][i]), int(t["kv_end"][i] - t["kv_begin"][i])
        fixed, rate = model[bool(t["event_count"][i] * 4 <= 16)]
        start = clock.get(cta, 1000)
        end = start + int(1e3 * fixed + rate * n)
        tasks.append(TaskRecord(cta, cta, "piece", i, start, end))
        tasks.append(TaskRecord(cta, cta, "merge-hbm", i, end, end + 2000))
        clock[cta] = end + 2000
    spans = [CtaSpan(c, c, 1000, end, c, 0) for c, end in clock.items()]
    s = cascade_tasks.summarise(Trace(tasks, spans, 0, 1, 1), plan)
    fits = {c["name"].split()[0]: c for c in s["classes"]}
    assert set(fits) == {"split", "row"}
    for name, split in (("split", True), ("row", False)):
        assert fits[name]["fixed_us"] == pytest.approx(model[split][0], abs=0.01)
        assert fits[name]["ns_per_token"] == pytest.approx(model[split][1], abs=0.01)
    assert s["merges"]["n"] == plan.num_tasks and s["merges"]["median_us"] == pytest.approx(2.0)
    assert s["cta_end_us"]["max"] == pytest.approx((max(clock.values()) - 1000) / 1e3)
    assert s["span_us"] == pytest.approx(s["cta_end_us"]["max"])
    assert "ns/token" in cascade_tasks.report("synthetic", s)


def test_one_length_fits_a_fixed_cost_only():
    assert cascade_tasks.fit(np.array([5.0, 5.5, 6.0]), np.array([64, 64, 64])) == (5.5, 0.0)


def test_it_refuses_to_run_without_the_profiled_build(monkeypatch):
    monkeypatch.delenv("MELD_PROFILE", raising=False)
    with pytest.raises(SystemExit):
        cascade_tasks.main([])
