"""Decode attention on the GPU against a float64 reference: every output written (poisoned first),
no NaN, stable across runs, over batch sizes, length distributions, head dims, group sizes and page
sizes, cluster mixes and both merge paths, plus CUDA-graph replay across re-plans."""
import dataclasses

import pytest
import torch

import meld
from meld.codegen import DecodeKernelConfig
from meld.runtime.reference import attention_reference
from meld.scheduler import DecodeCost, Topology

from meld.workloads import lengths, paged
from tests.gpu_checks import assert_gpu_plan_matches_host as _assert_gpu_plan_matches_host, check as _check

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("B", [1, 7, 64, 256])
@pytest.mark.parametrize("dist", ["uniform2k", "skewed", "one-long"])
def test_batches(B, dist):
    if dist == "one-long" and B == 1:
        pytest.skip("one-long needs B >= 2")
    _check(B, dist)


@pytest.mark.parametrize("dist", ["skewed", "one-long"])
def test_other_cost_models(dist):
    _check(64, dist, cost=DecodeCost(item_overhead_tokens=64))
    _check(1, "skewed", cost=DecodeCost(round_tokens=16))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_shapes_ragged_with_empty_requests(head_dim, group, page_size):
    _check(7, "ragged", head_dim=head_dim, group=group, page_size=page_size)


@pytest.mark.parametrize("group,num_kv_heads", [(12, 2), (16, 2), (3, 5), (20, 2), (32, 1)])
def test_odd_groups(group, num_kv_heads):
    """Groups above 8 run 16-head units (a group of 12 masks 4 rows; 20 and 32 take two units)."""
    attn = _check(9, "ragged", group=group, num_kv_heads=num_kv_heads)
    assert attn.heads_per_unit == (16 if group > 8 else 8)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("B,dist", [(8, "skewed"), (64, "one-long")])
def test_group_16(head_dim, B, dist):
    """Llama-405B's shape (128 q heads over 8 kv heads): 16-head units at head_dim 64 and 128, split and
    merged like any other; head_dim 256 keeps 8-head units (two per kv head)."""
    attn = _check(B, dist, head_dim=head_dim, group=16)
    assert attn.heads_per_unit == (8 if head_dim == 256 else 16)
    assert attn.cost.item_overhead_tokens == (128 if head_dim == 256 else 192)
    assert (attn.schedule.items()["slot"] >= 0).any()


@pytest.mark.parametrize("options", ["clusters", "tma", "8-head units"])
def test_group_16_options(options):
    if options == "clusters":
        _check(64, "skewed", group=16, cluster_size=4)
    elif options == "tma":
        _check(64, "skewed", group=16, kernel_config=dataclasses.replace(
            DecodeKernelConfig.default("bfloat16", 128, group_size=16), tma=True))
    else:
        attn = _check(64, "skewed", group=16, kernel_config=DecodeKernelConfig.default("bfloat16", 128))
        assert attn.head_blocks == 2


@pytest.mark.parametrize("head_dim,group", [(64, 8), (256, 4)])
def test_skewed_other_shapes(head_dim, group):
    _check(64, "skewed", head_dim=head_dim, group=group)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_merge_of_many_parts(head_dim):
    """One unit spread over every CTA: the merge goes through its parts in several chunks."""
    attn = _check(1, "ragged", head_dim=head_dim, group=8, num_kv_heads=1, lens=[50000])
    assert attn.schedule.items()["num_parts"].max() > 2 * 16, "the unit was not split finely enough to test"


def test_float16():
    _check(7, "ragged", dtype=torch.float16)


def _tma(head_dim, dtype="bfloat16", **kw):
    return dataclasses.replace(DecodeKernelConfig.default(dtype, head_dim), tma=True, **kw)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [16, 64])
def test_tma_rings_ragged(head_dim, page_size):
    """KV tiles loaded by TMA tensor copies into mbarrier rings: partial tiles (rows past a request's end
    come from the page and must not leak), both page sizes that hold whole tiles, every head dim."""
    _check(7, "ragged", head_dim=head_dim, page_size=page_size, group=8, kernel_config=_tma(head_dim))


@pytest.mark.parametrize("B,dist", [(1, "uniform2k"), (64, "skewed"), (64, "one-long")])
def test_tma_rings_batches(B, dist):
    _check(B, dist, kernel_config=_tma(128))
    _check(B, dist, dtype=torch.float16, kernel_config=_tma(128, "float16"))


@pytest.mark.parametrize("tma", [False, True])
def test_nan_past_the_end_of_a_page_does_not_leak(tma):
    """Token rows past each request's end inside its last page hold NaN: TMA copies them (cp.async
    zero-fills them), and the kernel must not let them through (0 * NaN)."""
    lens = [5, 17, 33, 100, 1000]
    pb = paged(lens, 16)
    dev = "cuda"
    kv = torch.randn(pb.num_pages, 2, 16, 2, 128, device=dev).bfloat16()
    for b, n in enumerate(lens):   # poison the unused tail of each request's last page
        last = int(pb.kv_indices[int(pb.kv_indptr[b + 1]) - 1])
        kv[last, :, n % 16 or 16:] = float("nan")
    q = torch.randn(len(lens), 8, 128, device=dev).bfloat16()
    cfg = _tma(128) if tma else DecodeKernelConfig.default("bfloat16", 128)
    attn = meld.DecodeAttention(8, 2, 128, 16, torch.bfloat16, dev, kernel_config=cfg)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    out = attn.run(q, kv)
    ref, _ = attention_reference(q, kv.nan_to_num(0.0), pb.kv_indptr.to(dev), pb.kv_indices.to(dev),
                                 pb.kv_last_page_len.to(dev))
    assert not out.isnan().any()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_tma_rings_with_clusters():
    _check(64, "skewed", cluster_size=4, kernel_config=_tma(128, onchip_merge=True))


@pytest.mark.parametrize("cluster_size", [2, 4, 8, 16])
@pytest.mark.parametrize("dist", ["skewed", "one-long", "ragged"])
def test_cluster_mixes(cluster_size, dist):
    """Several grids (one per cluster size) over one schedule: pieces merge on chip inside a cluster and
    through global memory across clusters and across grids (clusters of 2 fill an H200 in one grid)."""
    attn = _check(64, dist, cluster_size=cluster_size)
    mix = attn.cluster_mix
    assert sum(s * n for s, n in mix) == attn.topology.num_ctas
    assert mix[0][0] == cluster_size
    assert attn.schedule.meta["cluster_snap_tokens"] > 0, "the GPU planner's two-level placement went untested"


@pytest.mark.parametrize("onchip", [True, False], ids=["dsmem", "hbm"])
@pytest.mark.parametrize("cluster_size", [1, 4])
def test_merge_paths_in_the_trace(onchip, cluster_size):
    """A profiled kernel: the trace shows which merge path ran, every CTA reports once from its own SM."""
    cfg = DecodeKernelConfig.default("bfloat16", 128, onchip_merge=onchip)
    cfg = dataclasses.replace(cfg, profile=True)
    attn = _check(64, "skewed", kernel_config=cfg, cluster_size=cluster_size)
    tr = attn.last_trace()
    kinds = {k: sum(t.kind == k for t in tr.tasks) for k in ("piece", "merge-hbm", "merge-dsmem", "cluster-wait")}
    assert tr.overflowed == 0
    assert len(tr.cta_spans) == attn.topology.num_ctas
    grids = {}
    for c in tr.cta_spans:
        lo, hi = grids.get(c.grid, (c.begin_ns, c.end_ns))
        grids[c.grid] = (min(lo, c.begin_ns), max(hi, c.end_ns))
    if all(grids[g][0] < grids[0][1] for g in grids):   # the grids ran together (a tool like compute-sanitizer
        # serialises programmatic dependent launches): one CTA per SM, the grids cover them all
        assert len({c.sm for c in tr.cta_spans}) == attn.topology.num_ctas
    assert kinds["piece"] == attn.schedule.items()["unit"].size   # one record per (CTA, unit) item
    if onchip and cluster_size > 1:
        assert kinds["merge-dsmem"] > kinds["merge-hbm"] > 0
    else:
        assert kinds["merge-dsmem"] == 0 and kinds["merge-hbm"] > 0
    assert kinds["cluster-wait"] == (attn.topology.num_ctas if onchip else 0)
    assert all(t.start_ns <= t.end_ns for t in tr.tasks)


def test_grid_larger_than_the_gpu():
    """A persistent grid with more CTAs than can be resident (half of them start only as others exit):
    no CTA waits on another's work, so it finishes, and right."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    attn = _check(64, "skewed", topology=Topology(sms, {1: 2 * sms}))
    assert attn.topology.num_ctas == 2 * sms


@pytest.mark.parametrize("resident", [True, False], ids=["resident", "oversubscribed"])
@pytest.mark.parametrize("B,dist,q_len", [(1, "uniform2k", 8), (1, "skewed", 4), (8, "one-long", 1)])
def test_sliced_merges_in_the_trace(resident, B, dist, q_len):
    """A unit of n >= 3 parts whose outputs are more than one CTA's pass (16 rows and more) is merged by
    min(n - 1, 8) of its parts' CTAs, each after waiting for every part (a merge-wait record, then its merge-hbm),
    never by its last part (which starts its CTA's segment); otherwise (2 parts, 8-row units, or a grid with more
    CTAs than can be resident) the last arriver merges alone, without waiting."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = dataclasses.replace(DecodeKernelConfig.default("bfloat16", 128, group_size=4, q_len=q_len), profile=True)
    attn = _check(B, dist, kernel_config=cfg, q_len=q_len,
                  **({} if resident else dict(topology=Topology(sms, {1: 2 * sms}))))
    tr = attn.last_trace()
    assert tr.overflowed == 0
    sliced = resident and 4 * q_len > 8
    per_unit = {}
    for t in tr.tasks:
        per_unit.setdefault(t.unit, []).append(t)
    split = 0
    for u, ts in per_unit.items():
        pieces = sorted((t.cta for t in ts if t.kind == "piece"))
        merges = sorted(t.cta for t in ts if t.kind == "merge-hbm")
        waits = sorted(t.cta for t in ts if t.kind == "merge-wait")
        n = len(pieces)
        slices = min(n - 1, 8) if sliced else 1
        if n == 1:
            assert merges == waits == [], f"unit {u}: whole on CTA {pieces[0]}, merged by {merges}"
        elif slices > 1:
            split += 1
            assert merges == waits == pieces[:slices], f"unit {u}: parts on CTAs {pieces}, merged by {merges}"
        else:
            assert len(merges) == 1 and waits == [], f"unit {u}: parts on CTAs {pieces}, merged by {merges}"
    assert split > 0 or not sliced, "no unit was merged in slices"


@pytest.mark.parametrize("cluster_size", [1, 4])
def test_cuda_graph_replay_across_replans(cluster_size):
    dev, Hq, Hkv, D, P = "cuda", 32, 8, 128, 16
    batches = [lengths("skewed", 64), lengths("one-long", 64), lengths("ragged", 64), [2048] * 64]
    plans = [paged(l, P) for l in batches]
    num_pages = max(p.num_pages for p in plans)
    kv = torch.randn(num_pages, 2, P, Hkv, D, device=dev).bfloat16()
    q = torch.randn(64, Hq, D, device=dev).bfloat16()
    attn = meld.DecodeAttention(Hq, Hkv, D, P, torch.bfloat16, dev, max_batch_size=64,
                                max_num_pages=max(p.kv_indices.numel() for p in plans), cluster_size=cluster_size)
    out = torch.empty(64, Hq, D, dtype=torch.bfloat16, device=dev)
    attn.plan(plans[0].kv_indptr, plans[0].kv_indices, plans[0].kv_last_page_len)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())   # plan() and the inputs were enqueued on this stream
    with torch.cuda.stream(s):
        attn.run(q, kv, out=out)            # warm up outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        attn.run(q, kv, out=out)
    for p in plans:
        attn.plan(p.kv_indptr, p.kv_indices, p.kv_last_page_len)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref, _ = attention_reference(q, kv, p.kv_indptr.to(dev), p.kv_indices.to(dev), p.kv_last_page_len.to(dev))
        assert not out.isnan().any()
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def _slow_copy():
    """A Triton kernel that copies bf16 src to dst after ~100 µs of dependent arithmetic per element."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def slow_copy(src, dst, n, spins, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(src + offs, mask=offs < n).to(tl.float32)
        y = x
        for _ in range(spins):   # y stays x exactly (halves of a float add back to it); not foldable
            y = y * 0.5 + x * 0.5
        tl.store(dst + offs, y.to(tl.bfloat16), mask=offs < n)

    def run(src, dst, spins=20000):
        n = src.numel()
        slow_copy[(triton.cdiv(n, 1024),)](src, dst, n, spins, BLOCK=1024)
    return run


@pytest.mark.parametrize("cluster_size,tma", [(1, False), (1, True), (4, False)])
def test_overlapped_run_waits_for_the_kernel_before(cluster_size, tma):
    """With overlap run() starts while the kernel before it still runs: q and the KV cache that a slow
    kernel writes just before run() must be read only after it ends, by every grid of the cluster mix,
    eagerly and replayed from a CUDA graph. The result equals a plain launch's bit for bit."""
    slow_copy = _slow_copy()
    dev, Hq, Hkv, D, P, B = "cuda", 32, 8, 128, 16, 8
    plan = paged(lengths("skewed", B), P)
    nq, nkv = B * Hq * D, plan.num_pages * 2 * P * Hkv * D
    src = torch.randn(nq + nkv, device=dev).bfloat16()
    dst = torch.full_like(src, float("nan"))
    q, kv = dst[:nq].view(B, Hq, D), dst[nq:].view(plan.num_pages, 2, P, Hkv, D)
    outs = []
    for overlap in (True, False):
        attn = meld.DecodeAttention(Hq, Hkv, D, P, torch.bfloat16, dev, cluster_size=cluster_size,
                                    kernel_config=_tma(128) if tma else None, overlap=overlap)
        assert len(attn.cluster_mix) > 1 or cluster_size == 1
        attn.plan(plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len)
        attn.run(q, kv)             # the plain launch after a plan (NaN in: NaN out)
        dst.fill_(float("nan"))
        slow_copy(src, dst)         # the kernel right before the (overlapped) run
        outs.append(attn.run(q, kv))
        torch.cuda.synchronize()
        if overlap:
            graphed = torch.empty_like(outs[0])
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                slow_copy(src, dst)
                attn.run(q, kv, out=graphed)
            dst.fill_(float("nan"))
            graphed.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(graphed, outs[0])
    qs, kvs = src[:nq].view(B, Hq, D), src[nq:].view(plan.num_pages, 2, P, Hkv, D)
    ref, _ = attention_reference(qs, kvs, plan.kv_indptr.to(dev), plan.kv_indices.to(dev),
                                 plan.kv_last_page_len.to(dev))
    assert not outs[0].isnan().any()
    assert ((outs[0].double() - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("tma", [False, True])
def test_one_plan_many_layers_in_one_graph(tma):
    """What an inference engine does: plan once per batch, run every layer (its own q and KV cache) from
    one captured graph, re-plan for the next batch and replay."""
    dev, Hq, Hkv, D, P, B, layers = "cuda", 32, 8, 128, 16, 16, 3
    plans = [paged(lengths("skewed", B), P), paged(lengths("ragged", B), P), paged([3000] * B, P)]
    num_pages = max(p.num_pages for p in plans)
    kvs = [torch.randn(num_pages, 2, P, Hkv, D, device=dev).bfloat16() for _ in range(layers)]
    qs = [torch.randn(B, Hq, D, device=dev).bfloat16() for _ in range(layers)]
    outs = [torch.empty(B, Hq, D, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    cfg = _tma(128) if tma else None
    attn = meld.DecodeAttention(Hq, Hkv, D, P, torch.bfloat16, dev, max_batch_size=B,
                                max_num_pages=max(p.kv_indices.numel() for p in plans), kernel_config=cfg)
    attn.plan(plans[0].kv_indptr, plans[0].kv_indices, plans[0].kv_last_page_len)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())   # plan() and the inputs were enqueued on this stream
    with torch.cuda.stream(s):
        for q, kv, out in zip(qs, kvs, outs):
            attn.run(q, kv, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for q, kv, out in zip(qs, kvs, outs):
            attn.run(q, kv, out=out)
    for p in plans:
        attn.plan(p.kv_indptr, p.kv_indices, p.kv_last_page_len)
        for out in outs:
            out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for q, kv, out in zip(qs, kvs, outs):
            ref, _ = attention_reference(q, kv, p.kv_indptr.to(dev), p.kv_indices.to(dev), p.kv_last_page_len.to(dev))
            assert not out.isnan().any()
            assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("lens", [[], [0], [0, 0, 0], [1], [65536], [100000, 3] + [0] * 40, lengths("one-long", 256)])
@pytest.mark.parametrize("group", [4, 16])
@pytest.mark.parametrize("cost", [DecodeCost(), DecodeCost(item_overhead_tokens=64), DecodeCost(round_tokens=16)])
def test_gpu_planner_edge_batches(lens, group, cost):
    pb = paged(lens, 16)
    attn = meld.DecodeAttention(2 * group, 2, 128, 16, torch.bfloat16, "cuda", cost=cost)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    _assert_gpu_plan_matches_host(attn)


@pytest.mark.parametrize("check,mixed", [(True, False), (False, False), (True, True)])
def test_page_table_on_gpu(check, mixed):
    lens = lengths("skewed", 64)
    pb = paged(lens, 16)
    dev = "cuda"
    kv = torch.randn(pb.num_pages, 2, 16, 8, 128, device=dev).bfloat16()
    q = torch.randn(len(lens), 32, 128, device=dev).bfloat16()
    attn = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, dev)
    gi, gx, gl = (t.to(dev) for t in (pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len))
    # mixed: the FlashInfer habit of a CPU kv_indptr beside GPU indices
    attn.plan(pb.kv_indptr if mixed else gi, gx, gl, check=check)
    out = attn.run(q, kv)
    _assert_gpu_plan_matches_host(attn)
    ref, _ = attention_reference(q, kv, gi, gx, gl)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("helper", [True, False], ids=["c-helper", "numpy"])
def test_plan_errors_on_gpu_op(helper, monkeypatch):
    from meld.runtime import host_helper

    if not helper:
        monkeypatch.setattr(host_helper, "_lib", None)     # force the NumPy path
    pb = paged([100, 0, 33, 700], 16)
    attn = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, "cuda")
    i, x, last = pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len
    bad = last.clone(); bad[2] = 0
    with pytest.raises(ValueError, match=r"kv_last_page_len\[2\]=0 is outside \[1, page_size=16\]"):
        attn.plan(i, x, bad)
    bad = x.clone(); bad[5] = -3
    with pytest.raises(ValueError, match=r"kv_indices\[5\]=-3 is a negative page index"):
        attn.plan(i, bad, last)
    with pytest.raises(ValueError, match="never decrease"):
        attn.plan(torch.tensor([0, 7, 5, 9, 60], dtype=torch.int32), x, last)
    with pytest.raises(ValueError, match=r"exceeds len\(kv_indices\)"):
        attn.plan(i, x[:3], last)
    attn.plan(i, x, last)          # and a good table still plans after the errors
    _assert_gpu_plan_matches_host(attn)
    kv = torch.randn(pb.num_pages, 2, 16, 2, 64, device="cuda").bfloat16()
    with pytest.raises(ValueError, match=r"reference page \d+, but kv_cache has only 3 pages"):
        attn.run(torch.randn(4, 8, 64, device="cuda").bfloat16(), kv[:3])


@pytest.mark.caching_allocator
def test_sampled_profile_records_one_launch_in_n():
    """MELD_PROFILE_EVERY=3: the launches numbered 0, 3, 6, ... on the GPU write the trace and the others
    leave it as it was, eager launches and graph replays alike (production pays for one launch in N)."""
    from meld import config
    from meld.runtime.cuda_graphs import capture

    dev, P = "cuda", 16
    pb = paged(lengths("skewed", 64), P)
    kv = torch.randn(pb.num_pages, 2, P, 8, 128, device=dev).bfloat16()
    q = torch.randn(64, 32, 128, device=dev).bfloat16()
    cfg = dataclasses.replace(DecodeKernelConfig.default("bfloat16", 128), profile=True)
    with config.scope(MELD_PROFILE_EVERY="3"):
        attn = meld.DecodeAttention(32, 8, 128, P, torch.bfloat16, dev, kernel_config=cfg)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)

    def begins():
        torch.cuda.synchronize()
        return attn._buf.prof[:, 0, 0].clone()   # each CTA's begin time (its trace header)

    seen = []
    for _ in range(3):                                            # launches 0, 1, 2
        attn.run(q, kv)
        seen.append(begins())
    graph, _ = capture(lambda: attn.run(q, kv), device=dev)      # the warmup: launch 3
    seen.append(begins())
    for _ in range(3):                                            # replays: launches 4, 5, 6
        graph.replay()
        seen.append(begins())
    assert (seen[0] > 0).all(), "launch 0 left a CTA's header unwritten"
    for n in range(1, 7):
        if n % 3:
            assert torch.equal(seen[n], seen[n - 1]), f"launch {n} (not sampled) wrote the trace"
        else:
            assert (seen[n] > seen[n - 1]).all(), f"launch {n} (sampled) left a CTA's header"
    tr = attn.last_trace()
    assert len(tr.cta_spans) == attn.topology.num_ctas and tr.tasks
    with config.scope(MELD_PROFILE_EVERY="0"):
        with pytest.raises(ValueError, match="MELD_PROFILE_EVERY='0'"):
            meld.DecodeAttention(32, 8, 128, P, torch.bfloat16, dev, kernel_config=cfg)
