"""The torch ops' C++ fast path (meld.runtime.torch_fastcall): on the CPU, the library builds and, with launches
stubbed (tests/fastcall_stub.py, in a process of its own), a call whose arguments match the record launches
exactly the bytes the Python path launches for them, anything else takes the Python path, and bad inputs raise its
named errors. On a GPU: fast-path results equal the Python path's bit for bit, eagerly, in CUDA graphs and across
re-plans."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import meld
from meld.ops import torch_ops
from meld.runtime import torch_fastcall
from meld.workloads import paged

HERE = Path(__file__).resolve().parent
needs_cxx = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                               reason="the fast path is built with the system C++ compiler (none found)")


def _stubbed() -> dict:
    """tests/fastcall_stub.py's results (its process builds the library into the run's MELD_CACHE_DIR)."""
    res = subprocess.run([sys.executable, str(HERE / "fastcall_stub.py")], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@needs_cxx
def test_stubbed_fast_path():
    """One process for every CPU case (the build is the cost: one test, so parallel workers do not each build).

    MoE: a call matching the record launches the slow path's bytes (same tensors, other tensors, topk routing);
    another shape, dtype, stride, routing, weights, an unaligned x, int64 ids (copied) or an input that requires
    grad take the slow path; calls alternating between kinds (two layers' weights, two routings) each find their
    record once it is made. Decode (one grid, and three of different cluster sizes): the same, lse, K and V apart;
    lse not recorded, another page count or q's strides take the slow path; alternating kinds each find theirs;
    after a plan the first launch (no overlap with the plan's kernel) is not recorded, the second is, the third is
    fast. Bad inputs (and another op's handle, whose operator has a record) raise the slow path's named errors with
    a record in place, and a tripped watchdog its WatchdogTimeout."""
    stubbed = _stubbed()
    moe = stubbed["cases"]
    for name in ("same arguments", "other tensors", "topk routing"):
        assert moe[name] == {"hit": 1, "slow_hit": 0, "same": True, "launches": 2}, name
    for name in ("new shape", "new dtype", "new stride", "routing by ids", "int64 ids (copied)", "requires grad",
                 "other weights", "unaligned x"):
        assert moe[name]["hit"] == 0 and moe[name]["slow_hit"] == 0 and moe[name]["launches"] == 2, name
    assert moe["alternating"] == {"hits": [0, 0, 0, 1, 1, 1, 1, 1, 1]}
    for cluster in (1, 16):
        cases = stubbed["decode"][f"cluster {cluster}"]
        assert cases["alternating"] == {"hits": [0, 0, 0, 1, 1, 1, 1, 1, 1]}, cluster
        for name in ("same arguments", "other tensors", "with lse", "k and v apart"):
            assert cases[name] == {"hit": 1, "slow_hit": 0, "same": True, "launches": 3 if cluster == 16 else 1}, \
                (cluster, name)
        for name in ("lse not recorded", "other page count", "q of other strides"):
            assert cases[name]["hit"] == 0 and cases[name]["same"], (cluster, name)
        assert cases["re-plan"] == {"hits": [0, 0, 1]}, cluster
    errors = stubbed["errors"]
    assert errors["out overlaps x"].startswith("ValueError: out (strides (128, 1)) shares memory with x")
    assert errors["x of another width"] == \
        "ValueError: x must have shape ('*', 128) (tokens x hidden_size), got (5, 64)"
    assert errors["scale on a bf16 cache"].startswith("ValueError: k_scale=2.0 and v_scale=1.0: the scales dequantise")
    assert errors["the MoE's handle"].endswith("names a _StubMoE, not a DecodeAttention")
    assert errors["watchdog tripped"].startswith("WatchdogTimeout: meld watchdog on cpu:")
    assert errors["opcheck with a record"] is None
    _check_eager(stubbed["eager"])
    lib = torch_fastcall.load()   # (built by that process: loaded from the cache)
    assert lib is not None and lib.meld_fc_hits() == 0


def _check_eager(eager: dict) -> None:
    """`MoE()` and `run()` through their ops (tests/fastcall_stub.py's `eager`): each kind of call (out given or
    allocated, routing by logits or by int32 ids; lse; K and V apart) is recorded by its first op call and fast from
    the next, launching the direct path's bytes, returning what the direct path returns; the first run() after a
    plan is the direct path's; a block_tokens, int64 ids, an input that requires grad, an int scale, or a torch
    dispatch or function mode take the direct path (no op call); bad inputs raise the direct path's errors, through the op or not."""
    assert eager["moe"] == {"hits": [0, 1, 1, 0, 1], "op calls": [1] * 5, "returns out": True,
                            "allocated": ["torch.bfloat16", [5, 128], True], "same as direct": True}
    assert eager["moe direct"] == {"hits": [0] * 5, "op calls": [0] * 5}
    errors = eager["moe errors"]
    assert errors[0] == errors[1] == "ValueError: out must have dtype torch.bfloat16, got torch.float32"
    assert errors[2] == errors[3] and errors[2].startswith("ValueError: out (strides (128, 1)) shares memory with x")
    assert eager["moe shape errors"]["op calls"] == [1, 1]   # (the route sends them to the op)
    shape = eager["moe shape raised"]
    assert shape[0] == shape[2] and shape[0].startswith("ValueError: x must have shape")
    assert shape[1] == shape[3] and shape[1].startswith("ValueError: w13 must have shape")
    for lens in ("[30, 100, 7]", "[50, 3, 9]"):
        assert eager[f"run {lens}"] == {"hits": [0, 0, 1, 0, 1, 0, 1], "op calls": [0, 1, 1, 1, 1, 1, 1]}, lens
    assert eager["run returns"] == [True, "tuple", [[3, 32, 128], [3, 32]], "torch.float32"]
    assert eager["run"] == {"same as direct": True}
    assert eager["run direct"] == {"hits": [0] * 4, "op calls": [0] * 4}
    errors = eager["run errors"]
    assert errors[0] == errors[1] and errors[0].startswith("ValueError: k_scale=2.0 and v_scale=1.0: the scales")
    assert errors[2] == errors[3] == "ValueError: q must have shape (3, 32, 128) (batch of the last plan(), " \
                                     "num_qo_heads, head_dim), got (2, 32, 128)"
    assert errors[4] == "ValueError: return_lse must be True or False, got 1"
    assert errors[5] == "ValueError: kv_cache must be a torch.Tensor or a (k_cache, v_cache) tuple, got list"
    assert errors[6] == errors[7] and errors[6].startswith("ValueError: v_cache must be"), errors[6]


# --- GPU --------------------------------------------------------------------------------------------------
HQ, HKV, D, P = 32, 8, 128, 16
BF16 = torch.bfloat16


def _attention(lens, **kw):
    attn = meld.DecodeAttention(HQ, HKV, D, P, BF16, "cuda", max_batch_size=64, max_num_pages=4096, **kw)
    pb = paged(lens, P)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    return attn, pb


def _check_against_float64(q, kv, pb, out, lse, nan_row):
    """NaN exactly in `nan_row`'s rows, float64 attention elsewhere."""
    from tests.test_hostile_inputs import reference

    ref, ref_lse = reference(q.cpu(), kv.cpu(), pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, P, HKV, D ** -0.5)
    out, lse = out.cpu(), lse.cpu()
    assert [bool(r.isnan().any()) for r in out] == [b == nan_row for b in range(q.shape[0])]
    ok = [b for b in range(q.shape[0]) if b != nan_row]
    torch.testing.assert_close(out[ok].double(), ref[ok], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[ok].double(), ref_lse[ok], atol=1e-3, rtol=1e-3)


def _bit_identical_runs(call, shape, dtype, fast: tuple[bool, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """call(out, lse) once per entry of `fast` into NaN-filled out [shape] and lse [shape[:2]], each taking the C++
    fast path exactly when its entry says so; every run's bits equal the first's. Returns the (out, lse) pairs."""
    outs = []
    for f in fast:
        out = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
        lse = torch.full(shape[:2], float("nan"), device="cuda")
        hits = torch_fastcall.hits()
        call(out, lse)
        assert torch_fastcall.hits() - hits == int(f)
        outs.append((out, lse))
    torch.cuda.synchronize()
    for out, lse in outs[1:]:
        assert torch.equal(out.view(torch.int16), outs[0][0].view(torch.int16))
        assert torch.equal(lse.view(torch.int32), outs[0][1].view(torch.int32))
    return outs


@pytest.mark.gpu
def test_gpu_decode_fast_equals_slow():
    """The op through the fast path equals the Python path bit for bit, on fresh inputs after each re-plan
    (the first launch after a plan is the Python path's, the second is recorded, the later ones are fast), with
    NaN in one request's q reaching exactly its rows, and matches float64."""
    attn, _ = _attention([1])
    op = torch.ops.meld.decode_attention.default
    for lens in ([37, 1000, 5, 260, 77], [300, 3, 1111], [1, 2, 3, 4, 500, 16, 17]):   # (not whole 16-token tiles)
        pb = paged(lens, P)
        attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
        kv = torch.randn(pb.num_pages, 2, P, HKV, D, dtype=BF16, device="cuda")
        q = torch.randn(len(lens), HQ, D, dtype=BF16, device="cuda")
        q[1, 3, 5] = float("nan")
        outs = _bit_identical_runs(lambda out, lse: op(q, kv, out, lse, attn.handle), q.shape, q.dtype,
                                   (False, False, True, True))
        _check_against_float64(q, kv, pb, *outs[-1], nan_row=1)


@pytest.mark.gpu
def test_gpu_decode_fast_path_in_cuda_graph():
    """Captured through the fast path, a graph replays later plans (the tables rewritten in place) and equals the
    Python path's eager result for them."""
    attn, pb = _attention([40, 700, 9])
    op = torch.ops.meld.decode_attention.default
    kv = torch.randn(4096, 2, P, HKV, D, dtype=BF16, device="cuda")
    q = torch.randn(3, HQ, D, dtype=BF16, device="cuda")
    out = torch.empty_like(q)
    for _ in range(3):
        op(q, kv, out, None, attn.handle)   # (warm: the record made)
    hits = torch_fastcall.hits()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        op(q, kv, out, None, attn.handle)
    assert torch_fastcall.hits() - hits == 1
    for lens in ([500, 3, 1234], [17, 17, 17]):
        pb = paged(lens, P)
        attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        g.replay()
        expect = attn.run(q, kv)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), expect.view(torch.int16))


@pytest.mark.gpu
def test_gpu_moe_fast_equals_slow():
    """The MoE op through the fast path equals the Python path bit for bit (routing by logits and by the topk
    pair), NaN in one token's x reaching exactly its row, and the result matches float64."""
    from tests.test_moe import dense_reference

    H, I, E, k = 264, 136, 8, 2   # (not whole 64-wide tiles)
    layer = meld.MoE(H, I, E, k, BF16, "cuda", max_num_tokens=64)
    w13 = torch.randn(E, 2 * I, H, dtype=BF16, device="cuda") / H ** 0.5
    w2 = torch.randn(E, H, I, dtype=BF16, device="cuda") / I ** 0.5
    op = torch.ops.meld.moe.default
    for T in (1, 7, 33):
        x = torch.randn(T, H, dtype=BF16, device="cuda")
        x[T // 2, 3] = float("nan")
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(torch.int32).cuda()
        w = torch.rand(T, k, device="cuda")
        for routing in ((torch.randn(T, E, device="cuda"), None, None), (None, w, ids)):
            outs = []
            for fast in (False, True, True):
                out = torch.full_like(x, float("nan"))
                hits = torch_fastcall.hits()
                op(x, routing[0], w13, w2, routing[1], routing[2], out, layer.handle)
                assert torch_fastcall.hits() - hits == int(fast)
                outs.append(out)
            torch.cuda.synchronize()
            for out in outs[1:]:
                assert torch.equal(out.view(torch.int16), outs[0].view(torch.int16))
            assert outs[0].isnan().any(dim=1).tolist() == [t == T // 2 for t in range(T)]
        ok = [t for t in range(T) if t != T // 2]
        ref = dense_reference(x[ok], w13, w2, ids[ok], w[ok])
        torch.testing.assert_close(outs[-1][ok].double().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_mla_fast_equals_slow():
    """The MLA op through the fast path equals the Python path bit for bit across re-plans (its launch does not
    depend on the plan kernel: the first call after a plan is recorded), and matches float64."""
    from meld.runtime.reference import mla_reference
    from tests.test_mla_gpu import SCALE, _inputs

    H, P = 128, 64
    mla = meld.DecodeMLA(H, P, BF16, "cuda", sm_scale=SCALE, max_batch_size=16, max_num_pages=1024)
    op = torch.ops.meld.decode_mla.default
    for seed, lens in enumerate(([100, 7, 3000], [1, 65, 130, 500])):
        pb, qn, qp, ckv, kpe = _inputs(lens, H, P, gen_seed=seed)
        mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
        outs = _bit_identical_runs(lambda out, lse: op(qn, qp, ckv, kpe, out, lse, mla.handle), qn.shape, BF16,
                                   (False, True, True))
        ref, _ = mla_reference(qn.cpu(), qp.cpu(), ckv.cpu(), kpe.cpu(), pb.kv_indptr, pb.kv_indices,
                               pb.kv_last_page_len, SCALE)
        o = outs[0][0].cpu().double()
        assert ((o - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
def test_gpu_compile_and_opcheck_with_fast_path():
    attn, pb = _attention([33, 90])
    assert torch_ops.fast_path()
    kv = torch.randn(pb.num_pages, 2, P, HKV, D, dtype=BF16, device="cuda")
    q = torch.randn(2, HQ, D, dtype=BF16, device="cuda")
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.meld.decode_attention.default, (q, kv, out, None, attn.handle))
    f = torch.compile(lambda q: attn.run(q, kv), fullgraph=True)
    got = f(q)
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.int16), attn.run(q, kv).view(torch.int16))


# --- the entry points' route through the ops (GPU) ----------------------------------------------------------
def _hits(fn):
    """fn()'s result and how many fast-path launches it made."""
    before = torch_fastcall.hits()
    res = fn()
    return res, torch_fastcall.hits() - before


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.gpu
def test_gpu_eager_moe_through_the_op():
    """Eager MoE() calls go through the op: the first of each kind is recorded, the next are fast, and all equal the
    direct path (`MoE._call`, what MELD_TORCH_FASTCALL=0 runs) bit for bit, into NaN-poisoned or allocated outputs,
    with NaN in one token's x reaching exactly its row, and match float64; int64 ids and a block_tokens take the
    direct path (no fast launch) with the same result."""
    from meld.codegen.moe_kernel import BLOCK_TOKEN_CHOICES
    from tests.test_moe import dense_reference

    H, I, E, k = 264, 136, 8, 2   # (not whole 64-wide tiles)
    layer = meld.MoE(H, I, E, k, BF16, "cuda", max_num_tokens=64)
    w13 = torch.randn(E, 2 * I, H, dtype=BF16, device="cuda") / H ** 0.5
    w2 = torch.randn(E, H, I, dtype=BF16, device="cuda") / I ** 0.5
    for T in (1, 7, 33):
        x = torch.randn(T, H, dtype=BF16, device="cuda")
        x[T // 2, 3] = float("nan")
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(torch.int32).cuda()
        w = torch.rand(T, k, device="cuda")
        for logits, tw, ti in ((torch.randn(T, E, device="cuda"), None, None), (None, w, ids)):
            direct = layer._call(x, logits, w13, w2, tw, ti, torch.full_like(x, float("nan")))
            outs, hits = [], []
            for given in (True, True, False):
                out = torch.full_like(x, float("nan")) if given else None
                got, hit = _hits(lambda: layer(x, logits, w13, w2, topk_weights=tw, topk_ids=ti, out=out))
                assert got is out or not given
                outs.append(got)
                hits.append(hit)
            assert hits == [0, 1, 1], (T, hits)
            if ti is not None:
                bt = BLOCK_TOKEN_CHOICES[0]
                for kw in (dict(topk_ids=ti.long()), dict(topk_ids=ti, block_tokens=bt)):
                    got, hit = _hits(lambda: layer(x, None, w13, w2, topk_weights=tw, **kw))
                    assert hit == 0
                    if "block_tokens" not in kw:   # (another row block: another summation order)
                        outs.append(got)
            torch.cuda.synchronize()
            for out in outs:
                assert torch.equal(_bits(out), _bits(direct)), T
            assert direct.isnan().any(dim=1).tolist() == [t == T // 2 for t in range(T)]
        ok = [t for t in range(T) if t != T // 2]
        ref = dense_reference(x[ok], w13, w2, ids[ok], w[ok])
        torch.testing.assert_close(direct[ok].double().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_eager_run_through_the_op():
    """Eager run() calls go through the op across re-plans: the first after a plan is the direct path's, the next
    recorded, the later ones fast (outputs given NaN-poisoned or allocated, lse or not, K and V apart), all equal to
    the direct path (`_run`) bit for bit, NaN in one request's q reaching exactly its rows, and float64."""
    attn, _ = _attention([1])
    for lens in ([37, 1000, 5, 260, 77], [300, 3, 1111]):   # (not whole 16-token tiles)
        pb = paged(lens, P)
        attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
        kv = torch.randn(pb.num_pages, 2, P, HKV, D, dtype=BF16, device="cuda")
        q = torch.randn(len(lens), HQ, D, dtype=BF16, device="cuda")
        q[1, 3, 5] = float("nan")
        results, hits = [], []
        for given in (True, True, True, False):
            out, lse = (torch.full_like(q, float("nan")), torch.full(q.shape[:2], float("nan"), device="cuda")) \
                if given else (None, None)
            got, hit = _hits(lambda: attn.run(q, kv, return_lse=True, out=out, lse=lse))
            assert not given or (got[0] is out and got[1] is lse)
            results.append(got)
            hits.append(hit)
        assert hits == [0, 0, 1, 1], hits
        got, hit = _hits(lambda: attn.run(q, kv))   # (no lse: another kind of call, recorded, then fast)
        assert hit == 0 and _hits(lambda: attn.run(q, kv))[1] == 1
        results.append((got, results[0][1]))
        k, v = (t.contiguous() for t in kv.unbind(1))
        for hit in (0, 1):
            got, n = _hits(lambda: attn.run(q, (k, v), return_lse=True))
            assert n == hit
            results.append(got)
        direct = attn._run((q, kv), True, None, None)
        torch.cuda.synchronize()
        for out, lse in results:
            assert torch.equal(_bits(out), _bits(direct[0])) and torch.equal(_bits(lse), _bits(direct[1]))
        _check_against_float64(q, kv, pb, *direct, nan_row=1)


@pytest.mark.gpu
def test_gpu_eager_mla_run_through_the_op():
    """Eager DecodeMLA.run() calls go through the op across re-plans (its first call after a plan is recorded, the
    next fast), equal to the direct path (`_run`) bit for bit into NaN-poisoned outputs, NaN in one request's
    q_nope reaching exactly its rows, and match float64."""
    from meld.runtime.reference import mla_reference
    from tests.test_mla_gpu import SCALE, _inputs

    H, P = 128, 64
    mla = meld.DecodeMLA(H, P, BF16, "cuda", sm_scale=SCALE, max_batch_size=16, max_num_pages=1024)
    for seed, lens in enumerate(([100, 7, 3000], [1, 65, 130, 500])):
        pb, qn, qp, ckv, kpe = _inputs(lens, H, P, gen_seed=seed)
        qn[1, 2, 3] = float("nan")
        mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
        results, hits = [], []
        for given in (True, True, False):
            out = torch.full(qn.shape, float("nan"), dtype=BF16, device="cuda") if given else None
            lse = torch.full(qn.shape[:2], float("nan"), device="cuda") if given else None
            got, hit = _hits(lambda: mla.run(qn, qp, ckv, kpe, return_lse=True, out=out, lse=lse))
            results.append(got)
            hits.append(hit)
        assert hits == [0, 1, 1], hits
        direct = mla._run((qn, qp, ckv, kpe), True, None, None)
        torch.cuda.synchronize()
        for out, lse in results:
            assert torch.equal(_bits(out), _bits(direct[0])) and torch.equal(_bits(lse), _bits(direct[1]))
        o = direct[0].cpu().double()
        assert [bool(r.isnan().any()) for r in o] == [b == 1 for b in range(len(lens))]
        ref, _ = mla_reference(qn.cpu(), qp.cpu(), ckv.cpu(), kpe.cpu(), pb.kv_indptr, pb.kv_indices,
                               pb.kv_last_page_len, SCALE)
        ok = [b for b in range(len(lens)) if b != 1]
        assert ((o[ok] - ref[ok]).norm() / ref[ok].norm()).item() < 1e-2


_NO_FASTCALL = """
import torch, meld
from meld.runtime import torch_fastcall
layer = meld.MoE(128, 64, 8, 2, torch.bfloat16, "cuda", max_num_tokens=16)
w13, w2 = torch.randn(8, 128, 128, dtype=torch.bfloat16, device="cuda"), torch.randn(8, 128, 64, dtype=torch.bfloat16,
                                                                                     device="cuda")
x, logits = torch.randn(4, 128, dtype=torch.bfloat16, device="cuda"), torch.randn(4, 8, device="cuda")
outs = [layer(x, logits, w13, w2) for _ in range(3)]
torch.cuda.synchronize()
print(layer._op_route(), torch_fastcall.hits(), all(torch.equal(o, outs[0]) for o in outs))
"""


@pytest.mark.gpu
def test_gpu_no_fastcall_is_the_direct_path():
    """MELD_TORCH_FASTCALL=0 (a process of its own): no op route, no fast launch, MoE() as before."""
    import os

    env = dict(os.environ, MELD_TORCH_FASTCALL="0")
    res = subprocess.run([sys.executable, "-c", _NO_FASTCALL], capture_output=True, text=True, timeout=300, env=env,
                         cwd=HERE.parent)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["False", "0", "True"]
