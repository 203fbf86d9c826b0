"""Hostile inputs to meld's command line and to the files and tensors it and the FlashInfer shim read (issue
37), on the CPU: every one ends in a clear error naming the argument and the offending value (for the CLI:
one line on stderr, exit status 2), found before the work starts, never a traceback from deep inside.

  A. the tuning database (`meld tune --db`, MELD_TUNING_DB, and DecodeAttention reading it) that is a
     directory or JSON nested too deeply to parse, as `meld timeline` already refused such traces;
  B. outputs (`serve-bench --json`, `tune --db`, `timeline -o`) and KV pool sizes checked up front;
  C. `meld timeline T.json -o T.json` would overwrite its input;
  D. (gone: a FlashInfer-compat (k_cache, v_cache) tuple that is not one cache's halves in order, refused
     before meld read K and V through two addresses, is read as the K and V it names: tests/test_separate_kv.py);
  E. an int32 kv_indptr that wrapped, named as kv_indptr with its index and values.
"""
import re
import types

import numpy as np
import pytest
import torch

from meld import config
from meld.ops.base import Operator
from meld.tuning.db import TuningDB
from tests.test_cli import _fails, _trace

DEEP = "[" * 200_000 + "]" * 200_000


@pytest.fixture
def deep_file(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text(DEEP)
    return path


@pytest.fixture
def trace_file(tmp_path):
    return _trace().write_chrome(tmp_path / "run.json")


# --- A. the tuning database ----------------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["directory", "deep"])
def test_tune_show_refuses_an_unreadable_db(what, tmp_path, deep_file, capsys):
    path, why = (tmp_path, "Is a directory") if what == "directory" else (deep_file, "nested too deeply")
    _fails(["tune", "--show", "--db", str(path)], capsys, "argument --db", str(path), why)
    with config.scope(MELD_TUNING_DB=str(path)):
        _fails(["tune", "--show"], capsys, "MELD_TUNING_DB", str(path), why)


def test_tune_run_refuses_an_unreadable_db_before_anything(tmp_path, deep_file, capsys):
    """The database is checked before the GPU and the workload (here there is no GPU to measure on)."""
    _fails(["tune", "--workload", "bench", "--db", str(tmp_path)], capsys, "argument --db", "Is a directory")
    _fails(["tune", "--workload", "bench", "--db", str(deep_file)], capsys, "argument --db", "nested too deeply")


def test_tune_inputs_share_the_json_guard(tmp_path, deep_file, capsys):
    """--fit and recorded:FILE go through the same loader: deep nesting is a ValueError, not a RecursionError."""
    db = str(tmp_path / "t.json")
    _fails(["tune", "--workload", "bench", "--fit", str(deep_file), "--db", db], capsys,
           "argument --fit", "nested too deeply")
    _fails(["tune", "--workload", f"recorded:{deep_file}", "--db", db], capsys,
           "argument --workload", f"{deep_file}:1 is not a workload record", "nested too deeply")


@pytest.mark.parametrize("what", ["directory", "deep"])
def test_the_db_loader_names_the_file(what, tmp_path, deep_file):
    path = tmp_path if what == "directory" else deep_file
    with pytest.raises(ValueError, match=rf"tuning database {path} is not readable: "
                                         rf"({'Is a directory' if what == 'directory' else 'JSON nested too deeply'})"):
        TuningDB.load(path)


@pytest.mark.parametrize("what", ["directory", "deep"])
def test_an_operator_refuses_an_unreadable_db_as_it_refuses_a_bad_entry(what, tmp_path, deep_file):
    """What DecodeAttention does at construction on a GPU (the CPU executor never reads the database): a
    database that cannot be used is a ValueError naming MELD_TUNING_DB, like an entry that does not fit."""
    on_gpu = types.SimpleNamespace(device=torch.device("cuda"))
    path = tmp_path if what == "directory" else deep_file
    with config.scope(MELD_TUNING_DB=str(path)), pytest.raises(ValueError, match=rf"MELD_TUNING_DB: tuning database "
                                                                                  rf"{path} is not readable"):
        Operator._tuned(on_gpu, "bfloat16", "Hq32/Hkv8/D128/P16/C1")


# --- C. timeline -o onto its own input -----------------------------------------------------------------------
def test_timeline_refuses_to_overwrite_its_trace(trace_file, tmp_path, capsys):
    before = trace_file.read_bytes()
    link = tmp_path / "link.json"
    link.symlink_to(trace_file)
    hard = tmp_path / "hard.json"
    hard.hardlink_to(trace_file)
    for out in (trace_file, link, hard, tmp_path / "." / "run.json"):
        assert _fails(["timeline", str(trace_file), "-o", str(out)], capsys, "argument -o/--output",
                      f"{out} is the trace file {trace_file} itself") == ""
    as_png = tmp_path / "run.png"   # the default output of a trace whose name already ends in .png
    as_png.write_bytes(before)
    _fails(["timeline", str(as_png)], capsys, "argument -o/--output", "is the trace file")
    assert trace_file.read_bytes() == before == as_png.read_bytes()


# --- B. outputs and pool sizes, checked before the work ------------------------------------------------------
UNWRITABLE = "/sys/meld-out.json"   # creating a file in /sys fails even for root, whom os.access lets through


@pytest.fixture
def no_bench(monkeypatch):
    """serve-bench's work replaced by a recorder: a refused argument must stop it before the first model."""
    from meld.serving import bench, cli as serving_cli

    seen = []
    monkeypatch.setattr(serving_cli, "run", lambda cfg: seen.append(cfg) or (0, []))
    monkeypatch.setattr(bench, "DecoderModel", lambda *a, **k: pytest.fail("built a model for a refused run"))
    return seen


@pytest.mark.parametrize("where,why", [("dir", "Is a directory"), ("missing", "does not exist"),
                                       ("unwritable", "Permission denied")])
def test_serve_bench_checks_json_before_the_benchmark(where, why, tmp_path, no_bench, capsys):
    path = {"dir": str(tmp_path), "missing": str(tmp_path / "no" / "rows.json"), "unwritable": UNWRITABLE}[where]
    _fails(["serve-bench", "--device", "cpu", "--size", "tiny", "--json", path], capsys, "argument --json", why)
    assert no_bench == []


@pytest.mark.parametrize("pages", [5_000_000, 2 ** 31 - 1])
def test_serve_bench_refuses_a_pool_beyond_memory_on_the_cpu(pages, monkeypatch, capsys):
    """Before, the check ran on CUDA only and the CPU run died in torch's allocator."""
    from meld.serving import bench

    monkeypatch.setattr(bench, "available_bytes", lambda device: 22 << 30)
    monkeypatch.setattr(bench, "DecoderModel", lambda *a, **k: pytest.fail("built a model for a refused pool"))
    need = 2 * pages * 2 * 16 * 2 * 64 * 2   # tiny: 2 layers, K and V, 16-token pages, 2 kv heads of 64, bf16
    _fails(["serve-bench", "--device", "cpu", "--size", "tiny", "--kv-pages", str(pages)], capsys,
           "--kv-pages", f"{pages} pages needs {need} bytes", "22.0 GiB available on cpu")


def test_serve_bench_checks_every_pool_before_the_first_run(monkeypatch, capsys):
    """A too-small pool for the second max batch's trace is refused before the first max batch runs."""
    from meld.serving import bench

    monkeypatch.setattr(bench, "DecoderModel", lambda *a, **k: pytest.fail("built a model for a refused run"))
    _fails(["serve-bench", "--device", "cpu", "--size", "tiny", "--max-batch", "2,3", "--kv-pages", "4"], capsys,
           "KV pages", "give the pool more pages")


def test_available_memory_is_the_hosts_on_the_cpu():
    from meld.serving.bench import available_bytes

    assert 0 < available_bytes(torch.device("cpu")) < 1 << 50


def test_tune_checks_its_db_writable_before_measuring(capsys):
    _fails(["tune", "--workload", "bench", "--db", UNWRITABLE], capsys, "argument --db", "Permission denied")


@pytest.mark.parametrize("where,why", [("dir", "Is a directory"), ("unwritable", "Permission denied")])
def test_timeline_checks_its_output_before_rendering(where, why, trace_file, tmp_path, capsys):
    out = {"dir": str(tmp_path), "unwritable": "/sys/meld-out.png"}[where]
    assert _fails(["timeline", str(trace_file), "-o", out], capsys, "argument -o/--output", why) == ""


# --- E. an int32 kv_indptr that wrapped ---------------------------------------------------------------------
def _wrapped_cumsum(pages):
    """kv_indptr as an engine that sums page counts in int32 builds it: past 2**31 - 1 it wraps."""
    return np.r_[0, np.cumsum(pages)].astype(np.int64).astype(np.int32)


WRAPS = {   # kv_indptr, page_size, the message (NumPy's and the C helper's)
    "sum-wraps-long-request": (_wrapped_cumsum([2 ** 30, 2 ** 30, 5]), 16,
                               r"kv_indptr\[0:2\]=\[0, 1073741824\]: request 0 has 1073741824 pages of page_size=16 "
                               r"\(kv_last_page_len\[0\]=16\), more than 2147483647 KV tokens"),
    "sum-wraps-negative": (_wrapped_cumsum([2 ** 30, 2 ** 30, 5]), 1,
                           r"kv_indptr must never decrease, got kv_indptr\[1:3\]=\[1073741824, -2147483648\] "
                           r"\(an int32 offset past 2147483647 wraps negative\)"),
    "2**31-tokens": (np.array([0, 3, 2 ** 27 + 3], np.int32), 16,
                     r"kv_indptr\[1:3\]=\[3, 134217731\]: request 1 has 134217728 pages"),
}


@pytest.mark.parametrize("case", list(WRAPS))
def test_a_wrapped_kv_indptr_is_named(case):
    import meld

    indptr, P, message = WRAPS[case]
    last = torch.full((len(indptr) - 1,), P, dtype=torch.int32)
    attn = meld.DecodeAttention(8, 2, 64, P, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match=message):
        attn.plan(torch.from_numpy(indptr), torch.zeros(4, dtype=torch.int32), last)


@pytest.mark.parametrize("case", list(WRAPS))
def test_the_c_helper_says_the_same(case):
    from tests.test_host_helper import _c_message, _numpy_message, _stage, lib

    if lib is None:
        pytest.skip("no C compiler: plan() uses its NumPy path")
    indptr, P, message = WRAPS[case]
    last, indices = np.full(len(indptr) - 1, P, dtype=np.int32), np.zeros(4, dtype=np.int32)
    err, where, *_ = _stage(indptr, last, indices, P)
    said = _c_message(err, where, indptr, last, indices, P)
    assert said == _numpy_message(indptr, last, indices, P)
    assert re.search(message, said), said
