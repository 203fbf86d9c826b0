"""Hostile inputs to meld's command line and to the files and tensors it and the FlashInfer shim read (issue
37), on the CPU: every one ends in a clear error naming the argument and the offending value (for the CLI:
one line on stderr, exit status 2), found before the work starts, never a traceback from deep inside.

  A. the tuning database (`meld tune --db`, MELD_TUNING_DB, and DecodeAttention reading it) that is a
     directory or JSON nested too deeply to parse, as `meld timeline` already refused such traces;
  B. outputs (`serve-bench --json`, `tune --db`, `timeline -o`) and KV pool sizes checked up front;
  C. `meld timeline T.json -o T.json` would overwrite its input;
  D. a FlashInfer-compat (k_cache, v_cache) tuple of one cache's halves in the wrong order or layout;
  E. an int32 kv_indptr that wrapped, named as kv_indptr with its index and values.
"""
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
