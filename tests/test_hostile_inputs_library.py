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


# --- meld.distributed.shard_batch caps the world it places over -------------------------------------------------
def test_shard_batch_caps_world():
    from meld.distributed.shard import MAX_WORLD, shard_batch

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


# --- meld.serving's KV pool: the block allocator and the page lists ---------------------------------------
def _kv():
    from meld.serving.kv_cache import PagedKVCache

    return PagedKVCache(1, 16, 4, 1, 8, torch.float32, "cpu")


@pytest.mark.parametrize("n", [-1, 2.5, "2", True, 10 ** 9])
def test_allocator_refuses_bad_counts(n):
    from meld.serving.kv_cache import BlockAllocator

    a = BlockAllocator(8)
    with pytest.raises(ValueError, match=r"^n must be"):
        a.alloc(n)
    assert a.num_free == 7


@pytest.mark.parametrize("pages,match", [
    ([10 ** 30], "outside 0..7"), ([2.5], "integer page indices"), ("12", "a list of page indices"),
    (None, "a list of page indices"), ([[1, 2]], "integer page indices")])
def test_allocator_free_refuses_what_is_no_page_list(pages, match):
    from meld.serving.kv_cache import BlockAllocator

    a = BlockAllocator(8)
    got = a.alloc(2)
    with pytest.raises(ValueError, match=match):
        a.free(pages)
    assert a.num_free == 5
    a.free(got)
    with pytest.raises(ValueError, match="double free"):
        a.free(got)
    assert a.num_free == 7


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_pages=8.5), "num_pages must be a positive int, got 8.5"),
    (dict(num_pages=10 ** 12), "num_pages must be at most"),
    (dict(num_pages=8, first=-3), "first must be a non-negative int, got -3"),   # handed out pages -3..-1
    (dict(num_pages=8, seed=2 ** 70), "seed must be an int in")])
def test_allocator_constructor(kwargs, match):
    from meld.serving.kv_cache import BlockAllocator

    with pytest.raises(ValueError, match=match):
        BlockAllocator(**kwargs)


@pytest.mark.parametrize("args,match", [
    ((-1, 16, 4, 1, 8), "num_layers must be a positive int, got -1"),
    ((1, 16, 4, 0, 8), "num_kv_heads must be a positive int, got 0"),
    ((1, 16, 2.5, 1, 8), "page_size must be a positive int, got 2.5"),
    ((1, 10 ** 6, 4096, 64, 4096), r"the KV pool \(1, 1000000, 2, 4096, 64, 4096\) .* cannot be allocated on cpu"),
    ((1, 16, 4, 1, 8, "bf16"), "dtype must be a floating-point torch.dtype, got 'bf16'"),
    ((1, 16, 4, 1, 8, torch.float32, "cuda:7"), "device='cuda:7'")])
def test_kv_cache_constructor(args, match):
    from meld.serving.kv_cache import PagedKVCache

    with pytest.raises(ValueError, match=match):
        PagedKVCache(*args)


def test_kv_cache_requests_that_are_not_there():
    kv = _kv()
    kv.add(1, 8)
    kv.release(1)
    for call in (lambda: kv.release(1), lambda: kv.extend(9, 1), lambda: kv.append([9]), lambda: kv.length(9),
                 lambda: kv.pages(9), lambda: kv.page_table([9]), lambda: kv.release([1])):
        with pytest.raises(ValueError, match=r"request .* is not in the KV cache"):
            call()
    assert kv.allocator.num_free == 15 and kv._unallocated == 0


def test_kv_cache_counts():
    kv = _kv()
    for call, match in ((lambda: kv.add(1, -5), "max_tokens must be a non-negative int, got -5"),
                        (lambda: kv.add(1, 2.5), "max_tokens must be a non-negative int, got 2.5"),
                        (lambda: kv.add("a", 5), "rid must be an int, got 'a'"),
                        (lambda: kv.can_admit(-100), "max_tokens must be a non-negative int, got -100")):
        with pytest.raises(ValueError, match=match):
            call()
    kv.add(1, 8)
    with pytest.raises(ValueError, match="n must be a non-negative int, got -3"):
        kv.extend(1, -3)   # the length became -3
    assert kv.length(1) == 0 and kv._unallocated == 2


def test_kv_cache_append_is_all_or_nothing():
    kv = _kv()
    kv.add(1, 8), kv.add(2, 4)
    kv.extend(2, 4)
    for rids, match in (([1, 99], "request 99 is not in the KV cache"), ([1, 2], "request 2 would hold 5 tokens"),
                        ([1, 1], "name a request twice")):
        with pytest.raises(ValueError, match=match):
            kv.append(rids)
        assert kv.length(1) == 0 and kv.pages(1).size == 0   # request 1 had grown before the error
    assert kv.append([1]).shape == (1,)


def test_kv_cache_page_table_and_pool_access():
    kv = _kv()
    for kwargs, match in ((dict(pad_to=10 ** 12), "pad_to must be at most"),
                          (dict(pad_to=2, pad_page=999), r"pad_page must be a page of the pool \(0..15\)"),
                          (dict(pad_to=2, pad_page=-1), "pad_page must be a page of the pool")):
        with pytest.raises(ValueError, match=match):
            kv.page_table([], **kwargs)
    with pytest.raises(ValueError, match=r"layer must be 0..0, got 5"):
        kv.layer(5)
    z = torch.zeros(1, 1, 8)
    for slots, k, match in ((torch.tensor([10 ** 6]), z, r"slots must be token slots of the pool \(0..63\)"),
                            (torch.tensor([-1]), z, "slots must be token slots"),
                            (torch.tensor([1]), torch.zeros(1, 2, 8), r"k must have shape \(1, 1, 8\)"),
                            (torch.tensor([1], dtype=torch.int32), z, "slots must have dtype torch.int64")):
        with pytest.raises(ValueError, match=match):
            kv.write(0, slots, k, z)
    with pytest.raises(ValueError, match="layer must be"):
        kv.write(3, torch.tensor([1]), z, z)


# --- meld.serving's traces ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(arrival_rate=float("inf")), "arrival_rate must be a finite number, got inf"),
    (dict(arrival_rate="2"), "arrival_rate must be a finite number, got '2'"),
    (dict(num_requests=10 ** 12), "num_requests must be at most"),   # a hang
    (dict(num_requests=2.5), "num_requests must be a positive int, got 2.5"),
    (dict(prompt=(float("nan"), 1.0, 4, 100)), "prompt's ln-mean must be a finite number, got nan"),  # all min
    (dict(prompt=(1.0, float("nan"), 4, 100)), "prompt's ln-sd must be a finite number, got nan"),
    (dict(prompt=(1.0, 1.0, 4.5, 100.7)), "prompt lengths: need int 1 <= min <= max"),
    (dict(output=(1.0, 1.0, 4, 10 ** 30)), "output lengths: need int 1 <= min <= max"),
    (dict(prompt=(1.0, 1.0, 4)), r"prompt must be \(ln-mean, ln-sd, min, max\)"),
    (dict(seed=2 ** 64 - 1), "seed must be an int in"),
    (dict(seed=1.5), "seed must be an int in")])
def test_trace_config_refused(kwargs, match):
    from meld.serving.trace import TraceConfig, make_trace

    with pytest.raises(ValueError, match=match):
        make_trace(TraceConfig(**{"num_requests": 4, "arrival_rate": 2.0, **kwargs}))


def test_requests_and_their_tokens():
    from meld.serving.trace import Request, request_tokens

    with pytest.raises(ValueError, match="Request.prompt_len must be an int >= 1, got -3"):
        Request(0, 0, -3, 2)
    with pytest.raises(ValueError, match="vocab_size must be a positive int, got 0"):
        request_tokens(Request(0, 0, 3, 2), 0, 1)
    with pytest.raises(ValueError, match=r"seed must be an int with seed \* 1_000_003 \+ rid"):
        request_tokens(Request(0, 0, 3, 2), 10, 2 ** 70)


# --- meld.workloads -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dist,batch,match", [
    ("uniform2k", -3, "batch must be a non-negative int, got -3"),   # []
    ("one-long", 0, "batch must be >= 1 for one-long"),              # a batch of one
    ("ragged", -1, "batch must be a non-negative int"), ("skewed", "3", "batch must be a non-negative int")])
def test_lengths_refused(dist, batch, match):
    from meld.workloads import lengths

    with pytest.raises(ValueError, match=match):
        lengths(dist, batch)


@pytest.mark.parametrize("args,match", [
    (([-5, 3], 16), "lens must be integer KV lengths >= 0"), (([2.5], 16), "lens must be integer KV lengths"),
    (([5], 0), "page_size must be a positive int, got 0"), (([5], -4), "page_size must be a positive int"),
    (([5, 40], 16, -3), "spare_pages must be a non-negative int, got -3"),
    (([2 ** 40], 16), "page indices are int32"), (("abc", 16), "lens must be a list of KV lengths")])
def test_paged_refused(args, match):
    with pytest.raises(ValueError, match=match):
        paged(*args)
    assert paged(torch.tensor([5, 9]), 4).kv_indptr.tolist() == [0, 2, 5]


# --- meld.scheduler's public planners -------------------------------------------------------------------------
def test_plan_decode_refuses_what_it_silently_planned():
    import numpy as np

    from meld.scheduler import DecodeCost, Topology, plan_decode, plan_decode_host

    topo, cost, L, pb = Topology.h200(), DecodeCost.default(4), np.array([5, 100]), np.array([0, 1])
    for args, match in (((np.array([-5]), np.array([0]), 8, 4), "kv_len must be a 1-D array of integers"),
                        ((np.array([2 ** 40]), np.array([0]), 8, 4), "kv_len must be"),
                        ((np.array([5.5]), np.array([0]), 8, 4), "kv_len must be"),
                        ((L, pb, 0, 4), "num_kv_heads must be a positive int, got 0"),
                        ((L, pb, 8, 0), "group_size must be a positive int, got 0"),
                        ((L, pb[:1], 8, 4), "kv_len and page_base must have one entry per request, got 2 and 1")):
        with pytest.raises(ValueError, match=match):
            plan_decode(*args, topo, cost)
    assert plan_decode(np.zeros(0, np.int32), np.zeros(0, np.int32), 8, 4, topo, cost).num_units == 0
    for args, match in (((np.array([0, -1]), np.array([3]), 16, 8, 4), "kv_indptr must never decrease"),
                        ((np.array([0, 1]), np.array([3]), 0, 8, 4), "page_size must be a positive int, got 0"),
                        ((np.array([0, 1]), np.array([3, 3]), 16, 8, 4), "expected B \\+ 1 and B"),
                        ((np.array([0, 1]), np.array([3]), 16, 8, 0), "group_size must be a positive int")):
        with pytest.raises(ValueError, match=match):
            plan_decode_host(*args, topo, cost)


# --- copies of the paged decode operators, and the torch-op registry ---------------------------------------
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_decode_operator_runs_and_replans(how):
    import copy
    import pickle

    from meld.ops import torch_ops

    a = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, device="cpu")
    pb = paged([3, 40], 16)
    a.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    q = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    kv = torch.randn(pb.num_pages, 2, 16, 2, 64, dtype=torch.bfloat16)
    want = a.run(q, kv)
    b = copy.deepcopy(a) if how == "deepcopy" else pickle.loads(pickle.dumps(a))   # TypeError: CArgObject before
    assert b.handle != a.handle and torch_ops.lookup(b.handle, meld.DecodeAttention) is b
    assert torch.equal(b.run(q, kv), want)
    b.plan(pb.kv_indptr[:2], pb.kv_indices, pb.kv_last_page_len[:1])
    assert torch.equal(a.run(q, kv), want)   # the original keeps its plan


def test_operators_built_and_dropped_leave_no_handle():
    import gc

    from meld.ops import registry

    gc.collect()
    before = len(registry._live)
    for _ in range(10):
        a = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, device="cpu")
        del a
    gc.collect()
    assert len(registry._live) == before
