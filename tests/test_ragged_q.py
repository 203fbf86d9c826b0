"""Ragged multi-token decode (`DecodeAttention(q_len=n, ragged=True)`, plan()'s qo_indptr) without a GPU: the CPU
reference executor against the float64 ragged reference, the ragged builds compiled by nvcc for sm_90a, the torch op,
and bad input naming the argument and changing nothing."""
import dataclasses

import numpy as np
import pytest
import torch

import meld
from meld.codegen import DecodeKernelConfig
from meld.runtime.reference import attention_reference
from meld.scheduler import Topology
from meld.workloads import paged
from tests.kernel_matrix import nvcc

_TOPO = Topology(24, {1: 48})


def qo_indptr(tokens) -> torch.Tensor:
    """FlashInfer's qo_indptr of requests of `tokens` new tokens each."""
    return torch.tensor([0, *np.cumsum(tokens)], dtype=torch.int32)


def _batch(lens, tokens, Hq=8, Hkv=2, D=64, P=16):
    pb = paged(lens, P)
    kv = torch.randn(pb.num_pages, 2, P, Hkv, D).bfloat16()
    q = torch.randn(sum(tokens), Hq, D).bfloat16()
    return pb, kv, q, qo_indptr(tokens)


def _error(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _op(q_len, Hq=8, Hkv=2, P=16, **kw):
    return meld.DecodeAttention(Hq, Hkv, 64, P, torch.bfloat16, "cpu", q_len=q_len, ragged=True, topology=_TOPO, **kw)


def test_reference_is_the_uniform_one_per_request():
    """The ragged reference's rows of a request of n_b tokens are the uniform reference's at q_len = n_b."""
    lens, tokens = [40, 3, 700], [3, 1, 2]
    pb, kv, q, qo = _batch(lens, tokens)
    out, lse = attention_reference(q, kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, q_len=4, qo_indptr=qo)
    for b, n in enumerate(tokens):
        one = paged([lens[b]], 16)
        page = pb.kv_indices[int(pb.kv_indptr[b]):int(pb.kv_indptr[b + 1])]
        rows = slice(int(qo[b]), int(qo[b + 1]))
        ref, ref_lse = attention_reference(q[rows], kv, one.kv_indptr, page, pb.kv_last_page_len[b:b + 1], q_len=n)
        assert torch.equal(out[rows], ref) and torch.equal(lse[rows], ref_lse)


@pytest.mark.parametrize("q_len,Hq,Hkv,P", [(4, 8, 2, 16), (8, 32, 8, 16), (3, 6, 2, 1), (8, 16, 1, 64)])
def test_cpu_executor_matches_ragged_reference(q_len, Hq, Hkv, P):
    """Mixed n_b (1 and q_len among them, a request of exactly n_b keys), poisoned outputs all written, split units
    merged; groups whose rows fill one unit, part of one (6 q heads x 3), and several (16 q heads x 8)."""
    lens = [3000, 2, 800, 9, 1500, 17, q_len]
    tokens = [1, 2, q_len, 1, q_len - 1, 2, q_len]
    pb, kv, q, qo = _batch(lens, tokens, Hq, Hkv, P=P)
    attn = _op(q_len, Hq, Hkv, P)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, qo_indptr=qo)
    assert (attn.schedule.validate().items()["slot"] >= 0).any(), "the test must exercise split units and merges"
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"))
    attn.run(q, kv, out=out, lse=lse)
    ref, ref_lse = attention_reference(q, kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, q_len=q_len,
                                       qo_indptr=qo)
    assert not out.isnan().any() and not lse.isnan().any()
    assert _error(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 1e-5
    uniform, _ = attention_reference(q[:len(lens)], kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    assert _error(out[1:2], uniform[1:2]) > 1e-2, "request 1's first token must be masked at its own position"


def test_nan_in_q_reaches_exactly_its_row():
    lens, tokens = [40, 300, 2000], [2, 4, 1]
    pb, kv, q, qo = _batch(lens, tokens)
    attn = _op(4)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, qo_indptr=qo)
    q[3, 5] = float("nan")   # request 1, token 1, q head 5
    out, lse = attn.run(q, kv, return_lse=True)
    bad = torch.zeros(q.shape[:2], dtype=torch.bool)
    bad[3, 5] = True
    assert torch.equal(out.isnan().any(-1), bad) and torch.equal(lse.isnan(), bad)


def test_replans_with_other_qo_indptr():
    """One operator, plans of other row counts; a uniform qo_indptr gives the uniform operator's result."""
    lens = [100, 37, 900]
    attn = _op(4)
    uniform = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, "cpu", q_len=4, topology=_TOPO)
    for tokens in ([1, 1, 1], [4, 4, 4], [3, 1, 2]):
        pb, kv, q, qo = _batch(lens, tokens)
        attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, qo_indptr=qo)
        out = attn.run(q, kv)
        ref, _ = attention_reference(q, kv, pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, q_len=4, qo_indptr=qo)
        assert _error(out, ref) < 1e-2
        if tokens == [4, 4, 4]:
            uniform.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
            assert torch.equal(out, uniform.run(q, kv))


# The ragged builds: 16-row units (group 4 x q_len 4), 32-row units merging in passes with clusters and TMA rings
# (group 4 x q_len 8), FP8 with TMA rings, head_dim 64's 32-row units in fp16 (group 8 x q_len 3), batch invariance.
RAGGED_BUILDS = [DecodeKernelConfig.default("bfloat16", 128, group_size=4, q_len=4, ragged_q=True),
                 dataclasses.replace(DecodeKernelConfig.default("bfloat16", 128, onchip_merge=True, group_size=4,
                                                                q_len=8, ragged_q=True), tma=True),
                 dataclasses.replace(DecodeKernelConfig.default("bfloat16", 128, group_size=4, q_len=4,
                                                                kv_dtype="float8_e4m3fn", ragged_q=True), tma=True),
                 DecodeKernelConfig.default("float16", 64, group_size=8, q_len=3, batch_invariant=True,
                                            ragged_q=True)]


@pytest.mark.parametrize("cfg", RAGGED_BUILDS, ids=lambda c: c.name)
def test_ragged_builds_compile_for_sm90a(cfg):
    assert cfg.name.endswith("r" if not cfg.batch_invariant else "r_inv") and cfg.heads_per_unit in (16, 32)
    cubin, log = nvcc(cfg.render(), cfg.name)
    assert cubin and "0 bytes spill stores" in log and "0 bytes stack frame" in log, log


def test_torch_op_ragged():
    """torch.ops.meld.decode_attention takes q [qo_indptr[-1], ...] (opcheck: schema, fake implementation, autograd
    registration)."""
    pb, kv, q, qo = _batch([20, 300], [1, 2])
    attn = _op(2)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, qo_indptr=qo)
    torch.library.opcheck(torch.ops.meld.decode_attention.default,
                          (q, kv, torch.empty_like(q), torch.empty(3, 8), attn.handle))


@pytest.mark.parametrize("kwargs,match", [
    (dict(ragged=True), "ragged must be True or False, True only with q_len > 1 .*ragged=True with q_len=1"),
    (dict(q_len=2, ragged=1), "ragged must be True or False.*got ragged=1"),
    (dict(q_len=2, ragged=True, kernel_config=DecodeKernelConfig.default("bfloat16", 64, group_size=4, q_len=2)),
     "q_len=2, kv_dtype='', ragged_q=False; the operator is .*q_len=2, kv_dtype='', ragged=True"),
])
def test_bad_construction_names_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, "cpu", **kwargs)


def test_ragged_build_needs_tokens():
    with pytest.raises(ValueError, match="ragged_q=True with q_len=1: expected a bool, True only with q_len > 1"):
        DecodeKernelConfig(ragged_q=True)


def test_bad_plan_and_run_name_the_argument_and_change_nothing():
    lens = [40, 300]
    pb, kv, q, qo = _batch(lens, [3, 1])
    attn = _op(4)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len, qo_indptr=qo)
    before = attn.run(q, kv)
    table = (pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    for qo_bad, match in (
            (None, r"qo_indptr is required: this operator is ragged"),
            (qo.long(), r"qo_indptr must have dtype torch.int32, got torch.int64"),
            (qo[:2], r"qo_indptr must have shape \(3,\) \(B \+ 1 offsets"),
            (qo + 1, r"qo_indptr\[0\] must be 0, got 1"),
            (torch.tensor([0, 2, 2], dtype=torch.int32), r"request 1 0 new tokens \(qo_indptr\[2\] - qo_indptr\[1\] "
                                                         r"= 2 - 2\): expected 1 to q_len=4"),
            (torch.tensor([0, 5, 6], dtype=torch.int32), r"request 0 5 new tokens .* expected 1 to q_len=4"),
            ([0, 3, 4], r"qo_indptr must be a torch.Tensor, got list")):
        with pytest.raises(ValueError, match=match):
            attn.plan(*table, qo_indptr=qo_bad)
    short = paged([40, 2], 16)
    with pytest.raises(ValueError, match=r"give request 1 2 KV tokens, fewer than its 3 new tokens in qo_indptr "
                                         r"\(qo_indptr\[2\] - qo_indptr\[1\]\)"):
        attn.plan(short.kv_indptr, short.kv_indices, short.kv_last_page_len, qo_indptr=qo_indptr([1, 3]))
    assert torch.equal(attn.run(q, kv), before), "a plan() that raised changed the plan"
    with pytest.raises(ValueError, match=r"q must have shape \(4, 8, 64\) \(qo_indptr\[-1\] of the last plan\(\)"):
        attn.run(q[:3], kv)
    with pytest.raises(ValueError, match=r"lse must have shape \(4, 8\) \(qo_indptr\[-1\] of the last plan\(\)"):
        attn.run(q, kv, lse=torch.empty(8, 8))
    uniform = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, "cpu", q_len=4, topology=_TOPO)
    with pytest.raises(ValueError, match=r"qo_indptr is for ragged operators .*q_len=4 new tokens for every request"):
        uniform.plan(*table, qo_indptr=qo)


def test_bench_draws_ragged_batches():
    """bench/decode.py --q-len 4 --ragged: 1..4 new tokens per request, q with their rows, the reference over them,
    meld-q1's rows each request's last token."""
    from bench import decode

    try:
        decode.Q_LEN[0], decode.RAGGED[0] = 4, True
        inp = decode.make_inputs(decode.Case(16, "uniform2k", 8, 2, 64), seed=3, device="cpu")
        n = torch.diff(inp.qo_indptr)
        assert inp.q.shape[0] == int(inp.qo_indptr[-1]) and n.min() >= 1 and n.max() <= 4 and len(set(n.tolist())) > 1
        out, _ = decode.reference(inp)
        assert out.shape == inp.q.shape
        assert torch.equal(decode.last_tokens(inp.q, inp.qo_indptr), inp.q[inp.qo_indptr[1:].long() - 1])
        assert decode.skip_reason("fi-tc", inp.case, inp.table, None) is not None
    finally:
        decode.Q_LEN[0], decode.RAGGED[0] = 1, False
