"""Hostile inputs, round 3: meld's library surfaces beyond the operators' main entry points (serving's KV pool
and traces, workloads, tuning, profiles, the scheduler, the IR builders, MoE weight packing, copies, threads,
the torch-op registry) and round 2's leftovers. CPU only, small shapes, no compiles."""
from __future__ import annotations

import types

import pytest
import torch

import meld
from meld.workloads import paged


# --- describe_unit: out-of-range numbers are answered, never raised (they feed the watchdog's message) -----
def test_describe_unit_out_of_range_says_so():
    a = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, device="cpu")
    for u in (-1, 10 ** 9, 0, "x", 2.5, None):
        assert "out of range" in a.describe_unit(u) or "not a unit number" in a.describe_unit(u)
    pb = paged([3, 20], 16)
    a.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    assert a.describe_unit(15) == "request 1, kv head 7, q heads 28-31"
    for u in (-1, 16, 10 ** 9, 2 ** 64):
        assert a.describe_unit(u) == f"unit {u} is out of range: the plans so far have units 0-15"


def test_watchdog_message_survives_a_failing_describer():
    from meld.runtime.watchdog import Watchdog, _Kernel

    w = Watchdog.__new__(Watchdog)
    w.device = torch.device("cuda", 0)
    w.record = types.SimpleNamespace(kernel=0, unit=7, site=0, detail=0, cta=1, sm=2, warp=3, waited_ns=2e9, parity=0)
    w._kernels = [_Kernel("k", lambda u: 1 // 0)]
    assert "unit 7 (not described: ZeroDivisionError" in w.message()


# --- meld tune --workload recorded:FILE on a binary file names the file ------------------------------------
def test_tune_recorded_binary_file_is_named(tmp_path, capsys):
    from tests.test_cli import _fails

    path = tmp_path / "bin.jsonl"
    path.write_bytes(b"\xff\xfe\x00bad\n")
    _fails(["tune", "--workload", f"recorded:{path}", "--db", str(tmp_path / "t.json")], capsys,
           "argument --workload", f"{path} is not a workload file", "not UTF-8")


# --- meld.dist.shard_batch caps the world it places over -------------------------------------------------
def test_shard_batch_caps_world():
    from meld.dist.shard import MAX_WORLD, shard_batch

    for world in (10 ** 9, MAX_WORLD + 1):
        with pytest.raises(ValueError, match=f"world must be at most {MAX_WORLD}, got {world}"):
            shard_batch([5, 100], 16, world)
    assert shard_batch([5, 100], 16, MAX_WORLD).world == MAX_WORLD


# --- meld serve-bench's lists refuse empty items ------------------------------------------------------------
@pytest.mark.parametrize("option,text", [("--max-batch", "1,,2"), ("--max-batch", "4,"), ("--backend", "meld,,sdpa")])
def test_serve_bench_list_with_an_empty_item(option, text, capsys):
    from tests.test_cli import _fails

    _fails(["serve-bench", option, text], capsys, f"argument {option}", repr(text), "empty item")


# --- MELD_DUMP_DIR that fails after plan() installed the plan: a warning, the plan kept -------------------
def test_dump_failure_after_the_plan_warns(tmp_path, monkeypatch):
    import pathlib

    from meld import config

    a = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, device="cpu")
    first, second = paged([3, 20], 16), paged([40], 16)
    a.plan(first.kv_indptr, first.kv_indices, first.kv_last_page_len)
    real = pathlib.Path.write_bytes

    def full_disk(self, data):
        if self.name.endswith(".schedule.json"):
            raise OSError(28, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(pathlib.Path, "write_bytes", full_disk)
    with config.scope(MELD_DUMP_DIR=str(tmp_path / "dump")):
        with pytest.warns(RuntimeWarning, match=r"MELD_DUMP_DIR=.*cannot write .*schedule.json: No space left on "
                                                r"device; the plan was installed"):
            a.plan(second.kv_indptr, second.kv_indices, second.kv_last_page_len)
    assert a.schedule.kv_len.tolist() == [40]
