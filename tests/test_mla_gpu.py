"""MLA decode attention on the GPU against the float64 reference: outputs poisoned first, no NaN, relative
error < 1e-2, lse, empty requests, bit-identical repeats; split units merged by several CTAs; head counts
that are no multiple of 64; page sizes below and above the kernel's 64-token block; CUDA-graph replay across
re-plans; non-finite inputs reaching exactly their rows; views of one combined latent cache. Each test that
takes `schedule` runs every kernel build (MlaKernelConfig.schedule): the default split, the seesaw and the halves."""
import functools

import pytest
import torch

import meld
from meld.codegen.mla_kernel import MlaKernelConfig
from meld.ir.schedule import CTA_FIELDS
from meld.runtime.reference import mla_reference
from meld.workloads import lengths, paged
from tests.gpu_checks import assert_gpu_plan_matches_host

pytestmark = pytest.mark.gpu

SCALE = 192 ** -0.5


@pytest.fixture(params=["split", "seesaw", "halves"])
def schedule(request):
    """The kernel build a test runs."""
    return MlaKernelConfig(schedule=request.param)


def _inputs(lens, H, P, gen_seed=0, device="cuda", q_len=1):
    """A batch's page table, q (q_len rows a request) and latent cache, random from gen_seed."""
    g = torch.Generator().manual_seed(gen_seed)
    pb = paged(lens, P, generator=g)
    rows = len(lens) * q_len
    ckv = torch.randn(pb.num_pages, P, 512, generator=g).bfloat16().to(device)
    kpe = torch.randn(pb.num_pages, P, 64, generator=g).bfloat16().to(device)
    qn = (torch.randn(rows, H, 512, generator=g) / 3 ** 0.5).bfloat16().to(device)
    qp = (torch.randn(rows, H, 64, generator=g) / 3 ** 0.5).bfloat16().to(device)
    return pb, qn, qp, ckv, kpe


@functools.lru_cache(maxsize=8)
def _reference(lens: tuple, H, P, gen_seed=0):
    """float64 (out, lse) of _inputs(lens, H, P, gen_seed): computed once for both kernel builds."""
    pb, qn, qp, ckv, kpe = _inputs(list(lens), H, P, gen_seed, device="cpu")
    return mla_reference(qn, qp, ckv, kpe, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, SCALE)


def _check(lens, H=128, P=64, **op):
    """Plan and run (outputs poisoned first) and check against float64; two runs bit-identical. `op`: the
    DecodeMLA's keywords (kernel_config: a `schedule`). Returns (op, out, lse)."""
    pb, qn, qp, ckv, kpe = _inputs(lens, H, P)
    mla = meld.DecodeMLA(H, P, torch.bfloat16, "cuda", sm_scale=SCALE, **op)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    assert_gpu_plan_matches_host(mla)
    out = torch.full((len(lens), H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((len(lens), H), float("nan"), device="cuda")
    mla.run(qn, qp, ckv, kpe, out=out, lse=lse)
    torch.cuda.synchronize()
    ref, ref_lse = _reference(tuple(lens), H, P)
    o = out.cpu().double()
    assert not torch.isnan(o).any(), "an output was not written (or is NaN)"
    err = ((o - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < 1e-2, f"rel err {err:.2e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite), "lse of empty requests must be -inf, others finite"
    assert finite.any() and (lse.cpu().double() - ref_lse)[finite].abs().max().item() < 2e-3
    again = mla.run(qn, qp, ckv, kpe)
    assert torch.equal(again, out), "a second run differs: a race"
    return mla, out, lse


@pytest.mark.parametrize("B,dist", [(16, "uniform2k"), (64, "skewed"), (16, "one-long"), (128, "one-long")])
def test_bench_batches(B, dist, schedule):
    _check(lengths(dist, B), kernel_config=schedule)


def test_two_part_units(schedule):
    """Units split in two (B = 64 at 2k tokens over the grid: most of its units), which the split build's part 0
    merges from its own accumulators and part 1's partial: float64 and repeats as _check; a NaN in one q row
    reaches exactly that row's output and lse, the rest unchanged to the bit."""
    lens = lengths("uniform2k", 64)
    mla, clean, clean_lse = _check(lens, kernel_config=schedule)
    f = dict(zip(CTA_FIELDS, mla.schedule.cta))
    assert (f["head_parts"] == 2).any() and (f["tail_parts"] == 2).any(), "no unit split in two: the test misses its path"
    pb, qn, qp, ckv, kpe = _inputs(lens, 128, 64)
    qn[7, 70, 3] = float("nan")   # request 7, q head 70 (its second unit)
    out, lse = mla.run(qn, qp, ckv, kpe, return_lse=True)
    bad = torch.zeros(len(lens), 128, dtype=torch.bool)
    bad[7, 70] = True
    assert torch.equal(torch.isnan(out.cpu()).all(-1), bad) and torch.equal(torch.isnan(out.cpu()).any(-1), bad)
    assert torch.equal(torch.isnan(lse.cpu()), bad)
    assert torch.equal(out[~bad.cuda()], clean[~bad.cuda()]) and torch.equal(lse[~bad.cuda()], clean_lse[~bad.cuda()])


@pytest.mark.parametrize("lens,P", [(lengths("skewed", 64), 64), ([0, 1, 31, 32, 33, 700, 65536], 16)])
def test_32_token_blocks(lens, P):
    """The kernel built for 32-token KV blocks (four ring stages), with its own planner cuts."""
    mla, _, _ = _check(lens, P=P, kernel_config=MlaKernelConfig(block_tokens=32))
    assert mla.cost.tile_tokens == 32 and mla.kernel_config.stages == 4


def test_ragged_with_empty_requests(schedule):
    """Empty requests (zeros, lse -inf), one token, block edges and a few long ones in one batch."""
    mla, out, lse = _check([0, 1, 63, 64, 65, 127, 700, 0, 3000, 20000], kernel_config=schedule)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()


def test_one_long_request_merged_by_many_ctas(schedule):
    """B = 1 of 64K tokens: two units split over the SMs, each merged by eight CTAs (a slice each)."""
    mla, _, _ = _check([65536], kernel_config=schedule)
    it = mla.schedule.items()
    assert it["num_parts"].max() >= 8


@pytest.mark.racecheck
@pytest.mark.parametrize("lens,H", [([5, 70, 300], 100), ([3000, 5], 64)])
def test_small_batches(lens, H, schedule):
    """A padded second unit, and one request split over many CTAs and merged in the launch, at sizes
    compute-sanitizer's racecheck runs in seconds."""
    mla, _, _ = _check(lens, H=H, kernel_config=schedule)
    if H == 64:
        assert mla.schedule.items()["num_parts"].max() > 1, "the long request must be split"


@pytest.mark.parametrize("H", [16, 100, 192])
def test_head_counts(H, schedule):
    """Fewer than 64 heads (one padded unit), a count no multiple of 64, three units a request."""
    _check([5, 300, 2048, 9000], H=H, kernel_config=schedule)


@pytest.mark.parametrize("P", [16, 32, 128])
def test_page_sizes(P, schedule):
    """Pages smaller than the kernel's 64-token block (a box per page) and larger (two blocks a page)."""
    _check([1, 40, 64, 1000, 4097], P=P, kernel_config=schedule)


def test_cuda_graph_replays_new_plans(schedule):
    """run() captured once; later plans within the capacities rewrite the tables and the graph follows."""
    H, P = 128, 64
    batches = [[3000, 10, 500], [70000, 1, 64], [0, 2048, 129]]
    inputs = [_inputs(lens, H, P, seed) for seed, lens in enumerate(batches)]
    pages = max(i[0].num_pages for i in inputs)
    qn = torch.zeros(3, H, 512, dtype=torch.bfloat16, device="cuda")
    qp = torch.zeros(3, H, 64, dtype=torch.bfloat16, device="cuda")
    ckv = torch.zeros(pages, P, 512, dtype=torch.bfloat16, device="cuda")
    kpe = torch.zeros(pages, P, 64, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(3, H, 512, dtype=torch.bfloat16, device="cuda")
    mla = meld.DecodeMLA(H, P, sm_scale=SCALE, max_batch_size=3, max_num_pages=4 * pages, kernel_config=schedule)
    pb0 = inputs[0][0]
    mla.plan(pb0.kv_indptr, pb0.kv_indices, pb0.kv_last_page_len)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mla.run(qn, qp, ckv, kpe, out=out)
    for seed, (lens, (pb, q1, q2, c1, c2)) in enumerate(zip(batches, inputs)):
        mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
        qn.copy_(q1), qp.copy_(q2), ckv[:c1.shape[0]].copy_(c1), kpe[:c2.shape[0]].copy_(c2)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref, _ = _reference(tuple(lens), H, P, seed)
        err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"replay after re-plan: rel err {err:.2e}"


def test_views_of_one_combined_cache(schedule):
    """A [pages, page_size, 576] cache (FlashMLA's layout) passed as its two views."""
    lens = [100, 5000, 64]
    pb, qn, qp, ckv, kpe = _inputs(lens, 128, 64)
    both = torch.cat([ckv, kpe], dim=-1)
    mla = meld.DecodeMLA(128, 64, sm_scale=SCALE, kernel_config=schedule)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    got = mla.run(qn, qp, both[..., :512], both[..., 512:])
    assert torch.equal(got, mla.run(qn, qp, ckv, kpe))


def test_non_finite_inputs_reach_exactly_their_rows(schedule):
    """NaN in one q row, Inf in one token's latent (a value of every head of its request): NaN in exactly
    those rows' outputs and lse; other rows exact."""
    lens = [3000, 70000, 500]
    pb, qn, qp, ckv, kpe = _inputs(lens, 128, 64)
    mla = meld.DecodeMLA(128, 64, sm_scale=SCALE, kernel_config=schedule)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    clean, clean_lse = mla.run(qn, qp, ckv, kpe, return_lse=True)
    qn2, ckv2 = qn.clone(), ckv.clone()
    qn2[0, 5, 17] = float("nan")
    page = int(pb.kv_indices[pb.kv_indptr[2] + 3])   # request 2, token 3 * 64 + 10
    ckv2[page, 10, 200] = float("inf")
    out, lse = mla.run(qn2, qp, ckv2, kpe, return_lse=True)
    bad = torch.zeros(3, 128, dtype=torch.bool)
    bad[0, 5] = True
    bad[2, :] = True
    assert torch.equal(torch.isnan(out.cpu()).all(-1), bad) and torch.equal(torch.isnan(out.cpu()).any(-1), bad)
    assert torch.equal(torch.isnan(lse.cpu()), bad)
    assert torch.equal(out[~bad.cuda()], clean[~bad.cuda()]) and torch.equal(lse[~bad.cuda()], clean_lse[~bad.cuda()])


def test_profile_trace(schedule):
    """A profiling build's trace: every piece recorded, inside its CTA's span; the same outputs."""
    import dataclasses

    lens = lengths("skewed", 16)
    pb, qn, qp, ckv, kpe = _inputs(lens, 128, 64)
    plain_op = meld.DecodeMLA(128, 64, sm_scale=SCALE, kernel_config=schedule)
    prof_op = meld.DecodeMLA(128, 64, sm_scale=SCALE, kernel_config=dataclasses.replace(schedule, profile=True))
    for op in (plain_op, prof_op):
        op.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    assert torch.equal(plain_op.run(qn, qp, ckv, kpe), prof_op.run(qn, qp, ckv, kpe))
    trace = prof_op.last_trace()
    pieces = [t for t in trace.tasks if t.kind == "piece"]
    assert len(pieces) == len(prof_op.schedule.items()["unit"])


def test_phase_stamps(schedule):
    """The phases build (profiled, each role's cycles a phase: tools/mla_phases.py): the plain build's outputs bit
    for bit; both consumer warpgroups of every CTA count the blocks of its planned pieces, and spend cycles in the
    phases every block passes through."""
    import dataclasses

    import numpy as np

    lens = lengths("skewed", 16)
    pb, qn, qp, ckv, kpe = _inputs(lens, 128, 64)
    plain = meld.DecodeMLA(128, 64, sm_scale=SCALE, kernel_config=schedule)
    op = meld.DecodeMLA(128, 64, sm_scale=SCALE, kernel_config=dataclasses.replace(schedule, profile=True, phases=True))
    for o in (plain, op):
        o.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    assert torch.equal(plain.run(qn, qp, ckv, kpe), op.run(qn, qp, ckv, kpe))
    trace = op.last_trace()
    items = op.schedule.items()
    expected = np.zeros(op.schedule.num_ctas, np.int64)
    np.add.at(expected, items["cta"], -(-(items["kv_end"] - items["kv_begin"]) // schedule.block_tokens))
    sums: dict[tuple[int, int], dict[str, int]] = {}
    for x in trace.phases:
        sums.setdefault((x.cta, x.warpgroup), {})[x.phase] = x.cycles
    for c in np.flatnonzero(expected):
        for role in (0, 1):
            got = sums.get((c, role), {})
            assert got.get("blocks") == expected[c], (c, role, got)
        assert sums[c, 0]["softmax"] > 0 and sums[c, 0]["wait-kv"] > 0 and sums[c, 1]["wait-p"] > 0, (c, sums[c, 0])
        for role in (0, 1):   # every unit's end: the warpgroups' meeting, then the stores
            assert sums[c, role].get("end-sync", 0) > 0 and sums[c, role].get("store", 0) > 0, (c, role, sums[c, role])
        assert schedule.schedule != "split" or sums[c, 0].get("issue-pv", 0) > 0, (c, sums[c, 0])
    assert "cycles a block" in trace.phase_table()


def test_query_views_and_fresh_addresses(schedule):
    """The queries as views of one [B, H, 576] tensor (FlashMLA's q layout: heads 576 apart) and, call after call,
    at new addresses: the kernel's copies of the Q tensor maps take each call's addresses (mla_load_q)."""
    lens = [100, 5000, 64]
    pb, qn, qp, ckv, kpe = _inputs(lens, 100, 64)
    mla = meld.DecodeMLA(100, 64, sm_scale=SCALE, kernel_config=schedule)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    want = mla.run(qn, qp, ckv, kpe)
    q = torch.cat([qn, qp], dim=-1)
    assert torch.equal(mla.run(q[..., :512], q[..., 512:], ckv, kpe), want)
    for scale in (2.0, 0.5):   # (new tensors each call; their outputs differ, so a stale address would show)
        a, b = (qn * scale).contiguous(), (qp * scale).contiguous()
        got = mla.run(a, b, ckv, kpe)
        ref, _ = mla_reference(a.cpu(), b.cpu(), ckv.cpu(), kpe.cpu(), pb.kv_indptr, pb.kv_indices,
                               pb.kv_last_page_len, SCALE)
        err = ((got.cpu().double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"q x {scale}: rel err {err:.2e}"
