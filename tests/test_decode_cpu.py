"""DecodeAttention on the CPU reference executor: the planned schedule, executed piece by piece with
last-arriver merges, matches plain float64 attention; bad inputs raise ValueError naming the argument."""
import pytest
import torch

import meld
from meld.codegen import DecodeKernelConfig
from meld.runtime.reference import attention_reference, execute_decode

from meld.workloads import lengths, paged


def _inputs(lens, Hq=8, Hkv=2, D=64, P=16, dtype=torch.bfloat16):
    pb = paged(lens, P)
    kv = torch.randn(pb.num_pages, 2, P, Hkv, D).to(dtype)
    q = torch.randn(len(lens), Hq, D).to(dtype)
    return pb, kv, q


@pytest.mark.parametrize("lens,Hq,Hkv,P", [
    (lengths("ragged", 9), 8, 2, 16),
    ([0, 1, 2, 3, 4000, 0], 12, 1, 1),       # page size 1, group 12 (one 16-head unit, 4 rows masked)
    ([3000, 17, 900], 32, 1, 16),            # group 32: two 16-head units per kv head
    ([5000, 70, 0, 131], 4, 4, 64),          # group 1
    ([0, 0], 8, 2, 16),                      # only empty requests
])
def test_cpu_executor_matches_reference(lens, Hq, Hkv, P):
    pb, kv, q = _inputs(lens, Hq, Hkv, 64, P)
    attn = meld.DecodeAttention(Hq, Hkv, 64, P, torch.bfloat16, "cpu", topology=meld.scheduler.Topology(24, {1: 48}))
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    s = attn.schedule.validate()
    out = torch.full((len(lens), Hq, 64), float("nan"), dtype=torch.bfloat16)
    out, lse = attn.run(q, kv, return_lse=True, out=out)
    ref, ref_lse = attention_reference(q, kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    assert not out.isnan().any()
    assert ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item() < 1e-2
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse.double()[finite], ref_lse[finite], atol=1e-5)
    if sum(lens) > 1000:
        assert (s.items()["slot"] >= 0).any(), "the test must exercise split units and merges"


def test_cpu_executor_runs_the_two_level_placement():
    """With clusters that merge on chip the planner moves cuts between clusters: still exact."""
    lens = lengths("skewed", 16)
    pb, kv, q = _inputs(lens)
    topo = meld.scheduler.Topology(32, {1: 32, 2: 16, 4: 7})
    attn = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, "cpu", topology=topo, cluster_size=4)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    assert attn.cluster_mix == [(4, 7), (2, 2)] and attn.schedule.meta["cluster_snap_tokens"] > 0
    plain = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, "cpu", topology=topo)
    plain.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    assert not (attn.schedule.validate().cta == plain.schedule.cta).all(), "no cut moved: the test tests nothing"
    ref, _ = attention_reference(q, kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    out = attn.run(q, kv)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_cpu_executor_detects_a_wrong_schedule():
    lens = [3000, 2000, 10]
    pb, kv, q = _inputs(lens)
    attn = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, "cpu", topology=meld.scheduler.Topology(16))
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    s = attn.schedule
    ref, _ = attention_reference(q, kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    good, _ = execute_decode(s, q, kv[:, 0], kv[:, 1], pb.kv_indices, attn.sm_scale)
    assert ((good - ref).norm() / ref.norm()).item() < 1e-6
    col = int((s.cta[3] > 0).nonzero()[0][0])
    s.cta[3, col] += 16                       # end one segment a tile later: tokens counted twice
    bad, _ = execute_decode(s, q, kv[:, 0], kv[:, 1], pb.kv_indices, attn.sm_scale)
    assert bad.isnan().any() or ((bad - ref).norm() / ref.norm()).item() > 1e-3


def _planned(**kw):
    attn = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, "cpu", **kw)
    pb, kv, q = _inputs([100, 0, 33])
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    return attn, pb, kv, q


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_qo_heads=6, num_kv_heads=4), "num_qo_heads=6 must be a multiple of num_kv_heads=4"),
    (dict(head_dim=96), "head_dim must be 64, 128, 256 or 512, got 96"),
    (dict(page_size=0), "page_size must be a positive int, got 0"),
    (dict(dtype=torch.float32), "dtype must be torch.bfloat16 or torch.float16"),
    (dict(device="meta"), "device must be 'cuda' or 'cpu'"),
    (dict(page_size=8, kernel_config=DecodeKernelConfig("bfloat16", 64, 8, 2, tma=True)),
     "page_size=8: a kernel with TMA rings needs pages that hold whole 16-token tiles"),
    (dict(cost=meld.scheduler.DecodeCost(tile_tokens=32)), "cost.tile_tokens=32 must equal the kernel's KV tile 16"),
])
def test_constructor_errors(kwargs, match):
    args = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16, device="cpu")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        meld.DecodeAttention(**args)


def test_plan_errors():
    attn, pb, _, _ = _planned()
    i, x, last = pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len
    with pytest.raises(ValueError, match="kv_indptr must have dtype torch.int32, got torch.int64"):
        attn.plan(i.long(), x, last)
    with pytest.raises(ValueError, match=r"kv_last_page_len must have shape \(3,\)"):
        attn.plan(i, x, last[:2])
    bad = last.clone(); bad[0] = 17
    with pytest.raises(ValueError, match=r"kv_last_page_len\[0\]=17 is outside \[1, page_size=16\]"):
        attn.plan(i, x, bad)
    bad = last.clone(); bad[0] = 0
    with pytest.raises(ValueError, match=r"kv_last_page_len\[0\]=0"):
        attn.plan(i, x, bad)
    bad = x.clone(); bad[1] = -3
    with pytest.raises(ValueError, match=r"kv_indices\[1\]=-3 is a negative page index"):
        attn.plan(i, bad, last)
    with pytest.raises(ValueError, match="exceeds len\\(kv_indices\\)"):
        attn.plan(i, x[:2], last)
    with pytest.raises(ValueError, match="never decrease"):
        attn.plan(torch.tensor([0, 5, 3, 9], dtype=torch.int32), x, last)


def test_run_errors():
    attn, pb, kv, q = _planned()
    with pytest.raises(ValueError, match=r"q must have shape \(3, 8, 64\)"):
        attn.run(q[:2], kv)
    with pytest.raises(ValueError, match="q must have dtype torch.bfloat16, got torch.float32"):
        attn.run(q.float(), kv)
    with pytest.raises(ValueError, match="kv_cache must have shape"):
        attn.run(q, kv[:, :1])
    with pytest.raises(ValueError, match=r"reference page \d+, but kv_cache has only 2 pages"):
        attn.run(q, kv[:2])
    with pytest.raises(ValueError, match=r"kv_cache must have a contiguous last dim \(head_dim\), got strides"):
        attn.run(q, kv.transpose(3, 4).contiguous().transpose(3, 4))
    fresh = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, "cpu")
    with pytest.raises(RuntimeError, match="call plan\\(\\) first"):
        fresh.run(q, kv)


def test_cost_model_follows_the_unit_size():
    """16-head units take the cost model measured for them; an explicit cost always wins."""
    big = meld.DecodeAttention(32, 2, 64, 16, torch.bfloat16, "cpu")
    small = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, "cpu")
    assert (big.heads_per_unit, big.cost.item_overhead_tokens) == (16, 192)
    assert (small.heads_per_unit, small.cost.item_overhead_tokens) == (8, 128)
    mine = meld.scheduler.DecodeCost(item_overhead_tokens=64)
    assert meld.DecodeAttention(32, 2, 64, 16, torch.bfloat16, "cpu", cost=mine).cost is mine
