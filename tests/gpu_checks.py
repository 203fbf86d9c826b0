"""Checks the GPU test modules share: a full run of DecodeAttention against the float64 reference, and
the GPU planner's tables against the host planner's."""
import numpy as np
import torch

import meld
from meld.ir import CTA_FIELDS
from meld.runtime.reference import attention_reference
from meld.scheduler import plan_decode
from meld.workloads import lengths, paged


def assert_plan_matches_oracle(attn):
    """The host planner's tables (`schedule`) are the NumPy oracle's (meld.scheduler.plan_decode; a head-major
    schedule's are its plan of the requests repeated once per head block, as tests/test_decode_plan_host.py checks
    on random plans). Runs on the CPU too (tests/test_mla_cpu.py), so a wrong oracle call fails there first."""
    s = attn.schedule.validate()
    if s.head_major:   # DecodeMLA's: the oracle's plan of the requests repeated, one unit each
        U = s.units_per_request
        oracle = plan_decode(np.tile(s.kv_len, U), np.tile(s.page_base, U), attn.num_kv_heads, attn.heads_per_unit,
                             attn.topology, attn.cost, attn.heads_per_unit, attn._plan_clusters, attn._chunk)
    else:
        oracle = plan_decode(s.kv_len, s.page_base, attn.num_kv_heads, attn.planned_group_size, attn.topology,
                             attn.cost, attn.heads_per_unit, attn._plan_clusters, attn._chunk)
    assert np.array_equal(oracle.cta, s.cta) and oracle.meta == s.meta, "host planner and NumPy oracle disagree"
    return s


def assert_gpu_plan_matches_host(attn):
    """The GPU planner wrote exactly the tables of the host planner (`schedule`: the same source run as one
    thread), and those are the NumPy oracle's (assert_plan_matches_oracle)."""
    s = assert_plan_matches_oracle(attn)
    t = attn.tables
    W = attn.topology.num_ctas
    B = len(s.kv_len)
    buf = t.buf.cpu().numpy()
    rows = len(CTA_FIELDS)   # (the task layout's header and the segment's fields: meld.ir.work_table)
    assert np.array_equal(buf[:rows * W].reshape(rows, W), s.cta), "GPU planner and host planner disagree"
    assert np.array_equal(buf[t.off_kv_len:t.off_kv_len + B], s.kv_len)
    assert np.array_equal(buf[t.off_page_base:t.off_page_base + B], s.page_base)
    if s.chunk_tokens:
        assert np.array_equal(buf[t.off_slot_base:t.off_slot_base + B], s.slot_base)


def layout(kv_nhd: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """An NHD cache [pages, 2, page_size, Hkv, D] in `kv_layout` (HND: [pages, 2, Hkv, page_size, D])."""
    return kv_nhd if kv_layout == "NHD" else kv_nhd.transpose(2, 3).contiguous()


def check(B, dist, head_dim=128, group=4, page_size=16, num_kv_heads=8, dtype=torch.bfloat16, lens=None, tokens=None,
          **op):
    """Plan and run a batch (outputs poisoned first) and check it: no NaN, every grid's output visible
    to the stream's next work, relative error < 1e-2 against float64, lse, empty requests, and two runs
    bit-identical (op's q_len: that many causal query rows per request; with `tokens`, a ragged operator's new
    tokens per request, planned as its qo_indptr). Returns the operator."""
    lens = lens if lens is not None else lengths(dist, B)
    pb = paged(lens, page_size)
    Hq = num_kv_heads * group
    dev = "cuda"
    q_len = op.get("q_len", 1)
    per = torch.tensor(tokens if tokens is not None else [q_len] * len(lens))
    qo = torch.cat([torch.zeros(1, dtype=torch.int32), per.cumsum(0).int()])
    ragged = dict(qo_indptr=qo) if tokens is not None else {}
    rows = int(qo[-1])
    kv = torch.randn(pb.num_pages, 2, page_size, num_kv_heads, head_dim, device=dev).to(dtype)
    q = torch.randn(rows, Hq, head_dim, device=dev).to(dtype)
    attn = meld.DecodeAttention(Hq, num_kv_heads, head_dim, page_size, dtype, dev, **op)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, **ragged)
    assert_gpu_plan_matches_host(attn)
    cache = layout(kv, attn.kv_layout)
    out = torch.full((rows, Hq, head_dim), float("nan"), dtype=dtype, device=dev)
    lse = torch.full((rows, Hq), float("nan"), device=dev)
    attn.run(q, cache, out=out, lse=lse)
    snap = out.clone()   # the stream's next work: it must see every grid's output (no NaN left)
    out2, lse2 = attn.run(q, cache, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = attention_reference(q, kv, pb.kv_indptr.to(dev), pb.kv_indices.to(dev), pb.kv_last_page_len.to(dev),
                                       q_len=q_len, **ragged)
    assert not out.isnan().any(), "unwritten or NaN output elements"
    assert torch.equal(snap, out), "work queued after run() ran before every grid had finished"
    assert not lse.isnan().any(), "unwritten or NaN lse elements"
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < 1e-2, f"relative error {err:.2e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse = -inf must mark exactly the empty requests"
    assert (lse.double() - ref_lse)[finite].abs().max().item() < 2e-3 if finite.any() else True
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "results differ between two identical runs: a race"
    empty = torch.tensor([n == 0 for n in lens], device=dev).repeat_interleave(per.to(dev))
    assert (out[empty] == 0).all(), "a request with no KV tokens must give zeros"
    return attn


def run_nan_rows(attn, q, kv, bad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """run() into NaN-filled out and lse; asserts that NaN reached exactly the rows (token, head) `bad` marks, whole
    rows of out and their lse, and returns (out, lse) for the other rows' checks."""
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=q.device)
    attn.run(q, kv, out=out, lse=lse)
    torch.cuda.synchronize()
    assert torch.equal(out.isnan().any(-1), bad) and torch.equal(out.isnan().all(-1), bad)
    assert torch.equal(lse.isnan(), bad)
    return out, lse
