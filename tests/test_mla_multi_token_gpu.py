"""Multi-token MLA decode on the GPU (`DecodeMLA(q_len=...)`) against a float64 causal reference: q_len 2 and 4
over B 1, 16 and 64 of mixed lengths (off the 64-token blocks, a request of exactly q_len tokens), outputs
poisoned first, lse, the GPU planner's tables equal to the host planner's, bit-identical repeats, both kernel
builds; NaN in one q row reaching that row only; a page table planned on the GPU; CUDA-graph replay across
re-plans."""
import functools

import pytest
import torch

import meld
from meld.codegen.mla_kernel import MlaKernelConfig
from meld.runtime.reference import mla_reference
from meld.workloads import lengths
from tests.gpu_checks import assert_gpu_plan_matches_host
from tests.test_mla_gpu import _inputs as mla_inputs

pytestmark = pytest.mark.gpu

SCALE = 192 ** -0.5
H, P = 128, 64


def _lens(B: int, q_len: int, seed: int = 0) -> list[int]:
    """B mixed lengths >= q_len: BENCH's skewed ones moved off the 64-token blocks, the first of several exactly
    q_len."""
    g = torch.Generator().manual_seed(seed)
    lens = [n + int(torch.randint(1, 63, (1,), generator=g)) for n in lengths("skewed", B)]
    if B > 1:
        lens[0] = q_len
    return lens


def _inputs(lens, q_len, seed=0, device="cuda"):
    return mla_inputs(lens, H, P, seed, device, q_len)


@functools.lru_cache(maxsize=8)
def _reference(lens: tuple, q_len: int, seed: int = 0):
    """float64 (out, lse) on the host of _inputs(lens, q_len, seed), causal among each request's new tokens (computed
    on the GPU: the same values, q_len times decode's FLOPs)."""
    pb, qn, qp, ckv, kpe = _inputs(list(lens), q_len, seed)
    out, lse = mla_reference(qn, qp, ckv, kpe, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, SCALE, q_len)
    return out.cpu(), lse.cpu()


def _assert_close(out, lse, lens, q_len, seed=0):
    ref, ref_lse = _reference(tuple(lens), q_len, seed)
    o = out.cpu().double()
    assert not o.isnan().any() and not lse.isnan().any(), "an output was not written (or is NaN)"
    err = ((o - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"rel err {err:.2e}"
    assert (lse.cpu().double() - ref_lse).abs().max().item() < 2e-3


@pytest.mark.parametrize("schedule", ["split", "seesaw", "halves"])
@pytest.mark.parametrize("B", [1, 16, 64])
@pytest.mark.parametrize("q_len", [2, 4])
def test_batches(q_len, B, schedule):
    lens = _lens(B, q_len)
    pb, qn, qp, ckv, kpe = _inputs(lens, q_len)
    mla = meld.DecodeMLA(H, P, sm_scale=SCALE, q_len=q_len, kernel_config=MlaKernelConfig(schedule=schedule))
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    assert_gpu_plan_matches_host(mla)
    out = torch.full_like(qn, float("nan"))
    lse = torch.full(qn.shape[:2], float("nan"), device="cuda")
    mla.run(qn, qp, ckv, kpe, out=out, lse=lse)
    torch.cuda.synchronize()
    _assert_close(out, lse, lens, q_len)
    again, again_lse = mla.run(qn, qp, ckv, kpe, return_lse=True)
    assert torch.equal(again, out) and torch.equal(again_lse, lse), "a second run differs: a race"


@pytest.mark.parametrize("q_len", [2, 4])
def test_nan_in_one_q_row_reaches_that_row_only(q_len):
    lens = _lens(16, q_len)
    pb, qn, qp, ckv, kpe = _inputs(lens, q_len)
    mla = meld.DecodeMLA(H, P, sm_scale=SCALE, q_len=q_len)
    mla.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    clean, clean_lse = mla.run(qn, qp, ckv, kpe, return_lse=True)
    row = 5 * q_len + q_len - 1   # request 5's last new token
    qn[row, 70, 9] = float("nan")
    out, lse = mla.run(qn, qp, ckv, kpe, return_lse=True)
    bad = torch.zeros(qn.shape[:2], dtype=torch.bool, device="cuda")
    bad[row, 70] = True
    assert torch.equal(out.isnan().all(-1), bad) and torch.equal(out.isnan().any(-1), bad)
    assert torch.equal(lse.isnan(), bad)
    assert torch.equal(out[~bad], clean[~bad]) and torch.equal(lse[~bad], clean_lse[~bad])


@pytest.mark.parametrize("q_len", [2, 4])
def test_cuda_graph_replays_new_plans(q_len):
    """run() captured once; later plans of 16 requests within the capacities (one from a page table on the GPU,
    planned there with check=False) rewrite the tables and the graph follows."""
    batches = [_lens(16, q_len, 0), [q_len, 70000] + [129] * 14, [3000] * 15 + [q_len + 1]]
    inputs = [_inputs(lens, q_len, seed) for seed, lens in enumerate(batches)]
    rows, pages = 16 * q_len, max(i[0].num_pages for i in inputs)
    qn = torch.zeros(rows, H, 512, dtype=torch.bfloat16, device="cuda")
    qp = torch.zeros(rows, H, 64, dtype=torch.bfloat16, device="cuda")
    ckv = torch.zeros(pages, P, 512, dtype=torch.bfloat16, device="cuda")
    kpe = torch.zeros(pages, P, 64, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(rows, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(rows, H, device="cuda")
    mla = meld.DecodeMLA(H, P, sm_scale=SCALE, q_len=q_len, max_batch_size=16, max_num_pages=2 * pages)
    pb0 = inputs[0][0]
    mla.plan(pb0.kv_indptr, pb0.kv_indices, pb0.kv_last_page_len)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mla.run(qn, qp, ckv, kpe, out=out, lse=lse)
    for seed, (lens, (pb, q1, q2, c1, c2)) in enumerate(zip(batches, inputs)):
        table = (pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
        if seed == 2:
            mla.plan(*(t.cuda() for t in table), check=False)
        else:
            mla.plan(*table)
        qn.copy_(q1), qp.copy_(q2), ckv[:c1.shape[0]].copy_(c1), kpe[:c2.shape[0]].copy_(c2)
        out.fill_(float("nan")), lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _assert_close(out, lse, lens, q_len, seed)
