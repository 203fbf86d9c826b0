"""tools/gpu_suite.py on the CPU: longest-first dealing, the parsers of pytest's duration and skip reports,
and main() end to end over a few CPU tests standing in for the GPU suite (a pass, a skip, a failure)."""
import importlib.util
import json
import sys
import textwrap
from pathlib import Path

_TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(_TOOLS))          # gpu_suite imports its neighbour sanitize, as when run as a script
_spec = importlib.util.spec_from_file_location("meld_tools_gpu_suite", _TOOLS / "gpu_suite.py")
suite = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = suite
_spec.loader.exec_module(suite)


def test_longest_first_onto_the_least_loaded_worker_in_collection_order():
    ids = [f"t{i}" for i in range(6)]
    seconds = {"t0": 1, "t1": 9, "t2": 4, "t3": 4, "t4": 1, "t5": 3}
    w = suite.deal_lpt(ids, seconds, 2)
    assert sorted(i for x in w for i in x.ids) == ids
    assert [x.expected_s for x in w] == [11, 11]
    for x in w:
        assert x.ids == sorted(x.ids, key=ids.index), "a worker keeps collection order"
    unknown = suite.deal_lpt(["a", "b", "c"], {}, 5)
    assert len(unknown) == 3 and all(len(x.ids) == 1 for x in unknown), "never more workers than tests"


def test_shards_split_the_suite_once_each_and_evenly():
    ids = [f"t{i}" for i in range(7)]
    seconds = {"t0": 1, "t1": 9, "t2": 4, "t3": 4, "t4": 1, "t5": 3, "t6": 2}
    parts = [suite.shard(ids, seconds, k, 3) for k in (1, 2, 3)]
    assert sorted(i for p in parts for i in p) == ids, "every test in exactly one shard"
    loads = [sum(seconds[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(seconds.values()) and max(loads) == 9
    assert all(p == sorted(p, key=ids.index) for p in parts), "collection order inside a shard"
    assert suite.shard(ids, seconds, 1, 1) == ids and suite.shard(ids[:2], seconds, 3, 3) == []
    assert suite.parse_shard("2/3") == (2, 3)
    for bad in ("0/2", "3/2", "1", "a/b"):
        try:
            suite.parse_shard(bad)
        except Exception as e:
            assert "--shard" in str(e)
        else:
            raise AssertionError(f"--shard {bad} was accepted")


def test_parsers_read_pytest_reports():
    text = textwrap.dedent("""\
        ============================= slowest durations ==============================
        2.50s call     tests/test_a.py::test_x[1-2]
        0.25s setup    tests/test_a.py::test_x[1-2]
        0.01s teardown tests/test_b.py::test_y
        =========================== short test summary info ============================
        SKIPPED [2] tests/test_c.py:15: needs two CUDA GPUs in one node
        SKIPPED [1] tests/test_d.py:3: one-long needs B >= 2
        """)
    assert suite.parse_durations(text) == {"tests/test_a.py::test_x[1-2]": 2.75, "tests/test_b.py::test_y": 0.01}
    assert suite.parse_skips(text) == {"needs two CUDA GPUs in one node": 2, "one-long needs B >= 2": 1}


def test_main_reports_every_test_and_fails_on_a_failure(tmp_path, monkeypatch, capsys):
    f = tmp_path / "test_stand_in.py"
    f.write_text(textwrap.dedent("""\
        import pytest
        def test_ok(): pass
        def test_skip(): pytest.skip("not here")
        @pytest.mark.parametrize("x", [1, 2])
        def test_param(x): assert x == 1
        """))
    ids = [f"{f}::test_ok", f"{f}::test_skip", f"{f}::test_param[1]", f"{f}::test_param[2]"]
    monkeypatch.setattr(suite, "collect", lambda markers, extra: {suite.SHARED: (ids[1:], ""), suite.ALONE: (ids[:1], "")})
    rc = suite.main(["--workers", "3", "--out", str(tmp_path / "out"), "--durations", str(tmp_path / "none.json")])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL -- 4 collected, 2 passed, 1 failed, 1 skipped" in out
    assert "4 tests on 3 workers, then 1 alone" in out and out.index("worker 3: 1 tests") > out.index("worker 2:"), (
        "the trap tests run after the others")
    assert "skipped 1: not here" in out
    assert "FAILED " in out and "test_param[2] - assert 2 == 1" in out, "the failure's message reaches the caller"
    timed = json.loads((tmp_path / "out" / "gpu_durations.json").read_text())
    assert {Path(i).name for i in timed} == {Path(i).name for i in ids}, "every test's seconds are recorded"
    monkeypatch.setattr(suite, "collect", lambda markers, extra: {suite.SHARED: (ids[:3], ""), suite.ALONE: ([], "")})
    assert suite.main(["--workers", "2", "--out", str(tmp_path / "out2")]) == 0
    assert "PASS -- 3 collected, 2 passed, 0 failed, 1 skipped" in capsys.readouterr().out


def test_main_runs_one_shard_and_names_it(tmp_path, monkeypatch, capsys):
    f = tmp_path / "test_stand_in.py"
    f.write_text("def test_a(): pass\ndef test_b(): pass\ndef test_c(): pass\n")
    ids = [f"{f}::test_a", f"{f}::test_b", f"{f}::test_c"]
    monkeypatch.setattr(suite, "collect", lambda markers, extra: {suite.SHARED: (ids, ""), suite.ALONE: ([], "")})
    durations = tmp_path / "d.json"
    durations.write_text(json.dumps({ids[0]: 5, ids[1]: 1, ids[2]: 1}))
    ran = []
    for k in (1, 2):
        assert suite.main(["--workers", "2", "--shard", f"{k}/2", "--out", str(tmp_path / f"o{k}"),
                           "--durations", str(durations)]) == 0
        out = capsys.readouterr().out
        assert f"gpu suite (shard {k}/2): PASS" in out
        ran += json.loads((tmp_path / f"o{k}" / "gpu_durations.json").read_text())
    assert sorted(Path(i).name for i in ran) == sorted(Path(i).name for i in ids), "the two shards ran every test once"


def test_a_worker_killed_at_the_budget_still_reports_what_it_ran(tmp_path, monkeypatch, capsys):
    """The budget ends inside a test: the suite fails, names that test, and still counts the tests the worker had
    reported (-v lines) before it: a pass, a failure by its id, and the tests that never ran."""
    f = tmp_path / "test_slow_stand_in.py"
    f.write_text(textwrap.dedent("""\
        import time
        def test_ok(): pass
        def test_bad(): assert False
        def test_slow(): time.sleep(120)
        def test_never(): pass
        """))
    ids = [f"{f}::test_ok", f"{f}::test_bad", f"{f}::test_slow", f"{f}::test_never"]
    monkeypatch.setattr(suite, "collect", lambda markers, extra: {suite.SHARED: (ids, ""), suite.ALONE: ([], "")})
    rc = suite.main(["--workers", "1", "--budget", "12", "--out", str(tmp_path / "out"),
                     "--durations", str(tmp_path / "none.json")])
    out = capsys.readouterr().out
    assert rc == 1
    assert "killed at the budget in " in out and "test_slow" in out.split("killed at the budget in ")[1].split()[0]
    assert "FAILED " in out and "test_bad (message lost" in out
    assert "2 collected tests did not report" in out
    assert "FAIL -- 4 collected, 1 passed, 1 failed, 0 skipped" in out


def test_a_sticky_cuda_error_stops_its_worker_and_the_rest_go_on_in_a_fresh_one(tmp_path, monkeypatch, capsys):
    """A test that loses its process's CUDA context (here a stand-in raising torch's message) stops its worker
    (tests/conftest.py's hook); the tests it had not reached (of other files) run in a new worker and count,
    instead of failing one after another in the lost process."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_makereport  # noqa: F401\n")
    f, g = tmp_path / "test_crash_stand_in.py", tmp_path / "test_after_it.py"
    f.write_text(textwrap.dedent("""\
        def test_ok(): pass
        def test_crash(): raise RuntimeError("CUDA error: unspecified launch failure")
        """))
    g.write_text(textwrap.dedent("""\
        def test_after(): pass
        def test_later(): assert 1 + 1 == 2
        """))
    ids = [f"{f}::test_ok", f"{f}::test_crash", f"{g}::test_after", f"{g}::test_later"]
    monkeypatch.setattr(suite, "collect", lambda markers, extra: {suite.SHARED: (ids, ""), suite.ALONE: ([], "")})
    rc = suite.main(["--workers", "1", "--out", str(tmp_path / "out"), "--durations", str(tmp_path / "none.json")])
    out = capsys.readouterr().out
    assert rc == 1
    assert "stopped at a sticky CUDA error in " in out and "its 2 remaining tests go on in worker 1" in out
    assert "FAIL -- 4 collected, 3 passed, 1 failed, 0 skipped" in out
    assert "did not report" not in out


def test_the_rest_of_a_crashed_file_is_held_back_and_named_while_other_files_go_on(tmp_path, monkeypatch, capsys):
    """After a sticky CUDA error, the crashed test's file's remaining tests (here one dealt to the shared workers and
    one run alone) are not run, each in a fresh worker that it would crash again, but named as held back; the other
    files' remaining tests go on in the fresh worker and count."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_makereport  # noqa: F401\n")
    f, g = tmp_path / "test_crash_stand_in.py", tmp_path / "test_other_file.py"
    f.write_text(textwrap.dedent("""\
        def test_crash(): raise RuntimeError("CUDA error: an illegal instruction was encountered")
        def test_same_file(): raise RuntimeError("CUDA error: an illegal instruction was encountered")
        def test_same_file_alone(): pass
        """))
    g.write_text("def test_other(): pass\n")
    shared = [f"{f}::test_crash", f"{f}::test_same_file", f"{g}::test_other"]
    monkeypatch.setattr(suite, "collect", lambda markers, extra: {suite.SHARED: (shared, ""),
                                                                  suite.ALONE: ([f"{f}::test_same_file_alone"], "")})
    rc = suite.main(["--workers", "1", "--out", str(tmp_path / "out"), "--durations", str(tmp_path / "none.json")])
    out = capsys.readouterr().out
    assert rc == 1
    assert "its 1 remaining tests go on in worker 1 (1 of crashed files held back)" in out
    assert "FAIL 2 tests of test_crash_stand_in.py not run: " in out and "test_crash lost its worker's CUDA" in out
    assert "FAIL -- 4 collected, 1 passed, 1 failed, 0 skipped" in out
    assert "did not report" not in out


def test_pytest_counts_come_from_the_verbose_lines_only_without_a_summary():
    from sanitize import parse_pytest

    killed = "t.py::a PASSED [ 25%]\nt.py::b FAILED [ 50%]\nt.py::c SKIPPED (x) [ 75%]\nt.py::d\n"
    c = parse_pytest(killed)
    assert (c.passed, c.failed, c.skipped, c.failed_ids, c.last_started, c.summary_line) == (
        1, 1, 1, ["t.py::b"], "t.py::d", None)
    assert c.reported == ["t.py::a", "t.py::b", "t.py::c"]
    done = killed + "FAILED t.py::b - assert 0\n==== 1 failed, 3 passed, 1 skipped in 2.00s ====\n"
    c = parse_pytest(done)
    assert (c.passed, c.failed, c.skipped, c.failed_ids) == (3, 1, 1, ["t.py::b"]), "the summary's counts win"
