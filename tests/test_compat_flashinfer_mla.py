"""meld.compat.flashinfer.BatchMLAPagedAttentionWrapper: FlashInfer 0.6.18's MLA wrapper for decode on
meld.DecodeMLA. FlashInfer's documented usage (its docstring's plan()/run()) against a float64 reference written
in FlashInfer's own terms (kv_len_arr tokens from each request's pages), lse in base 2 or e, the unread pages
FlashInfer's layout allows, what it refuses (NotImplementedError) and what it rejects (ValueError) by name, a
plan() that raises changing nothing, the use_cuda_graph buffers, and torch.compile(fullgraph=True) over run().
The `gpu` tests compare against FlashInfer's own wrapper when it imports, and check poisoned outputs, NaN rows,
CUDA-graph replay across plans and plans from GPU tables."""
import math
import os

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import meld
from meld.compat.flashinfer import BatchMLAPagedAttentionWrapper

LOG2E = 1.4426950408889634
SCALE = 192 ** -0.5
BF16 = torch.bfloat16


def _tables(lens, P, extra=(), num_pages=None, seed=0, device="cpu", q_len=1):
    """plan()'s four tables in FlashInfer's MLA layout: request b's kv_len_arr[b] = lens[b] tokens on its first
    ceil(lens[b] / P) pages, then extra[b] pages it never reads, page indices drawn from num_pages (default: the
    pages used and 3 more)."""
    g = torch.Generator().manual_seed(seed)
    extra = list(extra) + [0] * (len(lens) - len(extra))
    pages = [-(-n // P) + e for n, e in zip(lens, extra)]
    indptr = torch.tensor([0] + pages, dtype=torch.int64).cumsum(0).to(torch.int32)
    nnz = int(indptr[-1])
    indices = torch.randperm(nnz + 3 if num_pages is None else num_pages, generator=g)[:nnz].to(torch.int32)
    tables = (q_len * torch.arange(len(lens) + 1, dtype=torch.int32), indptr, indices, torch.tensor(lens, dtype=torch.int32))
    return tuple(t.to(device) for t in tables)


def _inputs(B, H, P, num_pages, seed=0, device="cpu"):
    """run()'s q_nope, q_pe, ckv_cache and kpe_cache, random (q scaled to keep the softmax away from one-hot)."""
    g = torch.Generator().manual_seed(seed)
    qn, qp = ((torch.randn(B, H, d, generator=g) / 3 ** 0.5).to(BF16) for d in (512, 64))
    ckv, kpe = (torch.randn(num_pages, P, d, generator=g).to(BF16) for d in (512, 64))
    return tuple(t.to(device) for t in (qn, qp, ckv, kpe))


def _batch(lens, P, H, extra=(), seed=0, device="cpu", q_len=1):
    """_tables and _inputs of one batch (q_len query rows a request), its cache just large enough."""
    tables = _tables(lens, P, extra, seed=seed, device=device, q_len=q_len)
    return tables, _inputs(len(lens) * q_len, H, P, len(tables[2]) + 3, seed, device)


def _reference(tables, inputs, scale=SCALE):
    """float64 MLA decode in FlashInfer's terms: row j of request b's n (qo_indptr's step) attends to the first
    kv_len_arr[b] - n + 1 + j rows of its pages (keys [ckv, kpe], values ckv; FlashInfer's causal mask). Returns
    (out, natural-log lse); an empty request gives zeros and -inf."""
    qo, indptr, indices, lens = (t.cpu() for t in tables)
    qn, qp, ckv, kpe = (t.cpu() for t in inputs)
    R, H, _ = qn.shape
    q_len = int(qo[1] - qo[0]) if len(qo) > 1 else 1
    out, lse = torch.zeros(R, H, 512, dtype=torch.float64), torch.full((R, H), -math.inf, dtype=torch.float64)
    for row in range(R):
        b, j = divmod(row, q_len)
        pages, n = indices[indptr[b]:indptr[b + 1]].long(), int(lens[b]) - q_len + 1 + j if int(lens[b]) else 0
        if n:
            c, r = ckv[pages].reshape(-1, 512)[:n].double(), kpe[pages].reshape(-1, 64)[:n].double()
            s = (qn[row].double() @ c.T + qp[row].double() @ r.T) * scale
            lse[row], out[row] = torch.logsumexp(s, -1), torch.softmax(s, -1) @ c
    return out, lse


def _plan_args(tables, heads, P, **kw):
    """plan()'s arguments in FlashInfer's docstring order, as keywords (kw replaces any)."""
    names = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")
    return {**dict(zip(names, tables)), "num_heads": heads, "head_dim_ckv": 512, "head_dim_kpe": 64,
            "page_size": P, "causal": False, "sm_scale": SCALE, "q_data_type": BF16, "kv_data_type": BF16, **kw}


def _wrapper(device="cpu", **kw):
    return BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8, device=device), **kw)


def _assert_close(out, lse2, ref, ref_lse):
    """out near float64 (relative norm error < 1e-2) and the base-2 lse near the reference's; -inf exactly where
    a request is empty, and zeros there."""
    o = out.cpu().double()
    assert not o.isnan().any(), "an output row was not written (or is NaN)"
    err = ((o - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"relative error {err:.2e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse2.cpu()), finite), "lse must be -inf exactly for the empty requests"
    assert (lse2.cpu().double() - ref_lse * LOG2E)[finite].abs().max().item() < 3e-3
    assert (o[~finite] == 0).all(), "an empty request gives zeros"


# --- CPU executor ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [16, 64])
def test_documented_usage_matches_float64(P):
    """FlashInfer's docstring usage (qo_indptr 0..B, kv_lens, plan() positionally, run()), lengths that are no
    multiples of the page size and an empty request: out and lse (base 2, or e) against float64, the same bits
    as meld.DecodeMLA on the same batch, and out=/lse= written in place (poisoned first)."""
    lens, H = [5, 0, 70, 33, 2 * P + 1], 16
    tables, inputs = _batch(lens, P, H)
    w = _wrapper()
    w.plan(*_plan_args(tables, H, P).values())
    o = w.run(*inputs)
    out, lse = torch.full_like(o, math.nan), torch.full(o.shape[:2], math.nan)
    got = w.run(*inputs, out=out, lse=lse, return_lse=True)
    assert got[0] is out and got[1] is lse and torch.equal(out, o)
    _assert_close(out, lse, *_reference(tables, inputs))
    _, lse_e = w.run(*inputs, return_lse=True, return_lse_base_on_e=True)
    torch.testing.assert_close(lse_e * LOG2E, lse, rtol=1e-6, atol=0)
    mla = meld.DecodeMLA(H, P, BF16, "cpu", sm_scale=SCALE)
    _, indptr, indices, kv_len = tables
    mla.plan(indptr, indices, kv_len - (torch.diff(indptr) - 1).clamp(min=0) * P)
    want, want_lse = mla.run(*inputs, return_lse=True)
    assert torch.equal(o, want) and torch.equal(lse_e, want_lse), "the wrapper is meld.DecodeMLA on the batch"
    only_lse = torch.full_like(lse, math.nan)
    assert w.run(*inputs, lse=only_lse).shape == o.shape and torch.equal(only_lse, lse), \
        "a given lse is written without return_lse, as FlashInfer's"


def test_pages_past_kv_len_are_never_read():
    """FlashInfer reads request b's first ceil(kv_len_arr[b] / page_size) pages only: extra pages (NaN-filled here,
    and a request of kv_len 0 that has pages) change nothing."""
    lens, H, P = [5, 0, 40, 16], 16, 16
    tables, inputs = _batch(lens, P, H, extra=[2, 1, 0, 3])
    qn, qp, ckv, kpe = inputs
    _, indptr, indices, _ = tables
    for b, n in enumerate(lens):   # every page past the ones read
        unread = indices[int(indptr[b]) + -(-n // P):int(indptr[b + 1])].long()
        ckv[unread], kpe[unread] = math.nan, math.nan
    w = _wrapper()
    w.plan(**_plan_args(tables, H, P))
    out, lse = w.run(*inputs, return_lse=True)
    _assert_close(out, lse, *_reference(tables, inputs))


def test_unchecked_table_conversion_matches_the_checked_one():
    """The conversion check=False runs on GPU tables (torch ops, no host synchronisation), here on the CPU: the
    pages read, their page indices and the last pages' fills of the checked conversion."""
    from meld.compat.flashinfer_mla import _decode_table

    _, *table = _tables([5, 0, 40, 16, 33, 1], 16, extra=[2, 1, 0, 3, 0, 0])
    (indptr, indices, last), (ptr, idx, fill) = (_decode_table(*table, 16, on_host) for on_host in (True, False))
    assert torch.equal(indptr, ptr) and torch.equal(last, fill) and torch.equal(indices[:indptr[-1]], idx[:ptr[-1]])
    assert indptr.tolist() == [0, 1, 1, 4, 5, 8, 9] and last.tolist() == [5, 16, 8, 16, 1, 1]


@pytest.mark.parametrize("kw,err,match", [
    (dict(page_size=1), NotImplementedError, "page_size=1"),
    (dict(page_size=48), NotImplementedError, "page_size=48"),
    (dict(head_dim_ckv=256), NotImplementedError, "head_dim_ckv=256"),
    (dict(head_dim_kpe=0), NotImplementedError, "head_dim_kpe=0"),
    (dict(q_data_type=torch.float16), NotImplementedError, "q_data_type"),
    (dict(kv_data_type=torch.float8_e5m2), NotImplementedError, "kv_data_type"),
    (dict(kv_data_type=torch.float16), NotImplementedError, "kv_data_type"),
    (dict(use_profiler=True), NotImplementedError, "use_profiler"),
    (dict(qo_indptr=torch.tensor([0, 2, 3, 4, 5], dtype=torch.int32)), NotImplementedError, "qo_indptr"),
    (dict(kv_len_arr=torch.tensor([5, 0, 200, 33], dtype=torch.int32)), ValueError,
     r"kv_len_arr\[2\]=200 needs 13 pages of 16 tokens, but kv_indptr gives request 2 5"),
    (dict(kv_len_arr=torch.tensor([5, 3, 70, 33], dtype=torch.int32)), ValueError, r"kv_len_arr\[1\]=3"),
    (dict(kv_len_arr=torch.tensor([5, -1, 70, 33], dtype=torch.int32)), ValueError, r"kv_len_arr\[1\]=-1 is negative"),
    (dict(kv_len_arr=torch.tensor([5, 0, 70], dtype=torch.int32)), ValueError, "len\\(kv_len_arr\\) \\+ 1 = 4"),
    (dict(kv_indptr=torch.tensor([1, 2, 2, 7, 10], dtype=torch.int32)), ValueError, "kv_indptr must start at 0"),
    (dict(kv_indptr=torch.tensor([0, 1, 1, 6, 90], dtype=torch.int32)), ValueError, r"kv_indptr\[-1\]=90"),
    (dict(kv_indices=torch.arange(10)), ValueError, "kv_indices must have dtype torch.int32"),
    (dict(kv_indptr=torch.zeros(2, 3, dtype=torch.int32)), ValueError, "kv_indptr"),
    (dict(num_heads=0), ValueError, "num_heads"),
    (dict(num_heads=64.0), ValueError, "num_heads"),
    (dict(page_size=16.0), ValueError, "page_size"),
    (dict(sm_scale=math.inf), ValueError, "sm_scale"),
    (dict(sm_scale=True), ValueError, "sm_scale"),
    (dict(causal=1), ValueError, "causal"),
    (dict(check=None), ValueError, "check"),
    (dict(q_data_type="bf16"), ValueError, "q_data_type"),
])
def test_plan_names_what_it_refuses_and_changes_nothing(kw, err, match):
    """Each bad plan() names the argument; before and after it the wrapper runs the last good plan, bit for bit,
    and keeps no operator the failed plan made."""
    lens, H, P = [5, 0, 70, 33], 16, 16
    tables, inputs = _batch(lens, P, H)
    w = _wrapper()
    with pytest.raises(err, match=match):
        w.plan(**_plan_args(tables, H, P, **kw))
    with pytest.raises(RuntimeError, match="call plan"):
        w.run(*inputs)
    other, other_inputs = _batch([3, 17], P, H, seed=1)
    w.plan(**_plan_args(other, H, P))
    before, ops = w.run(*other_inputs), dict(w._ops)
    with pytest.raises(err, match=match):
        w.plan(**_plan_args(tables, H, P, **kw))
    assert w._ops == ops and torch.equal(w.run(*other_inputs), before)


@pytest.mark.parametrize("kw,err,match", [
    (dict(o_scale=1.0), NotImplementedError, "o_scale"),
    (dict(ckv_scale=2.0, kpe_scale=2.0), ValueError, "ckv_scale=2.0: the scales dequantise an FP8 cache"),
    (dict(ckv_scale_arr=torch.ones(1)), NotImplementedError, "ckv_scale_arr"),
    (dict(kpe_scale=2.0), NotImplementedError, "kpe_scale"),
    (dict(ckv_scale=float("nan")), ValueError, "ckv_scale must be a finite number, got nan"),
    (dict(ckv_scale=-1.0, kpe_scale=-1.0), ValueError, "ckv_scale must be positive"),
    (dict(profiler_buffer=torch.empty(1)), NotImplementedError, "profiler_buffer"),
    (dict(return_lse=1), ValueError, "return_lse must be True or False, got 1"),
    (dict(return_lse_base_on_e=None), ValueError, "return_lse_base_on_e"),
    (dict(out=torch.empty(4, 16, 512)), ValueError, "out must have dtype torch.bfloat16"),
    (dict(lse=torch.empty(4, 8)), ValueError, "lse must have shape"),
])
def test_run_names_what_it_refuses(kw, err, match):
    tables, inputs = _batch([5, 0, 70, 33], 16, 16)
    w = _wrapper()
    w.plan(**_plan_args(tables, 16, 16))
    with pytest.raises(err, match=match):
        w.run(*inputs, **kw)
    with pytest.raises(ValueError, match="q_pe must have shape"):
        w.run(inputs[0], inputs[1][:, :, :32], *inputs[2:])


@pytest.mark.parametrize("kw,match", [
    (dict(backend="trtllm-gen"), "backend must be one of"),
    (dict(use_cuda_graph=1), "use_cuda_graph must be True or False"),
    (dict(use_cuda_graph=True), "qo_indptr should be a torch.Tensor in cudagraph mode, got NoneType"),
    (dict(use_cuda_graph=True, qo_indptr=torch.zeros(5, dtype=torch.int32), kv_indptr=torch.zeros(5, dtype=torch.int32),
          kv_indices=torch.zeros(9, dtype=torch.int64), kv_len_arr=torch.zeros(4, dtype=torch.int32)),
     "kv_indices must have dtype torch.int32"),
    (dict(use_cuda_graph=True, qo_indptr=torch.zeros(5, dtype=torch.int32), kv_indptr=torch.zeros(5, dtype=torch.int32),
          kv_indices=torch.zeros(9, dtype=torch.int32), kv_len_arr=torch.zeros(3, dtype=torch.int32)),
     r"len\(kv_len_arr\) \+ 1 = 4 entries, got 5 and 5"),
    (dict(use_cuda_graph=True, qo_indptr=torch.zeros(5, dtype=torch.int32), kv_indptr=torch.zeros(5, dtype=torch.int32),
          kv_indices=torch.zeros(1, dtype=torch.int32).expand(9), kv_len_arr=torch.zeros(4, dtype=torch.int32)),
     "kv_indices"),
])
def test_constructor_names_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        _wrapper(**kw)
    with pytest.raises(ValueError, match="float_workspace_buffer must be a torch.Tensor"):
        BatchMLAPagedAttentionWrapper(None)


def test_cuda_graph_buffers_fix_the_batch_and_hold_the_tables():
    """use_cuda_graph=True (on the CPU executor here): the buffers are the operator's capacities, plan() copies
    its tables into them, keeps the batch size fixed and kv_indices within its buffer (ValueError, nothing
    changed), and plans of other lengths within them run correctly."""
    H, P = 16, 16
    tables, inputs = _batch([5, 0, 70, 33], P, H)   # 9 page indices
    bufs = dict(qo_indptr=torch.full((5,), -1, dtype=torch.int32), kv_indptr=torch.full((5,), -1, dtype=torch.int32),
                kv_indices=torch.full((12,), -1, dtype=torch.int32), kv_len_arr=torch.full((4,), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_indptr has elements that share memory|shares memory"):
        _wrapper(use_cuda_graph=True, **{**bufs, "kv_indptr": bufs["qo_indptr"]})
    w = _wrapper(use_cuda_graph=True, **bufs)
    assert w.is_cuda_graph_enabled
    w.plan(**_plan_args(tables, H, P))
    for name, t in zip(bufs, tables):
        assert torch.equal(bufs[name][:len(t)], t), f"plan() copies {name} into its buffer, as FlashInfer's"
    assert (w._op.max_batch_size, w._op.max_num_pages) == (4, 12)
    _assert_close(*w.run(*inputs, return_lse=True), *_reference(tables, inputs))
    snapshot = {k: v.clone() for k, v in bufs.items()}
    before = w.run(*inputs)
    for lens, extra, match in (([5, 0, 70], (), "batch size should be fixed in cudagraph mode: len\\(kv_len_arr\\)=3"),
                               ([5, 0, 70, 33], (0, 0, 0, 4), "kv_indices has 13 entries, more than the kv_indices "
                                                              "buffer's 12")):
        bad, _ = _batch(lens, P, H, extra=extra)
        with pytest.raises(ValueError, match=match):
            w.plan(**_plan_args(bad, H, P))
        assert torch.equal(w.run(*inputs), before) and all(torch.equal(bufs[k], snapshot[k]) for k in bufs)
    again = _tables([1, 100, 17, 0], P, num_pages=12, seed=2)   # 10 page indices
    w.plan(**_plan_args(again, H, P))
    assert torch.equal(bufs["kv_indices"][:10], again[2]) and torch.equal(bufs["kv_indices"][10:],
                                                                          snapshot["kv_indices"][10:])
    _assert_close(*w.run(*inputs, return_lse=True), *_reference(again, inputs))


def test_check_false_still_checks_host_tables():
    """check=False skips only what would read GPU tables back: tables on the CPU are checked all the same."""
    tables, inputs = _batch([5, 0, 70, 33], 16, 16)
    w = _wrapper()
    w.plan(**_plan_args(tables, 16, 16, check=False))
    _assert_close(*w.run(*inputs, return_lse=True), *_reference(tables, inputs))
    with pytest.raises(ValueError, match=r"kv_len_arr\[3\]=99"):
        w.plan(**_plan_args(tables, 16, 16, check=False, kv_len_arr=torch.tensor([5, 0, 70, 99], dtype=torch.int32)))
    with pytest.raises(NotImplementedError, match="qo_indptr"):
        w.plan(**_plan_args(tables, 16, 16, check=False, qo_indptr=torch.tensor([0, 1, 2, 3, 5], dtype=torch.int32)))
    with pytest.raises(ValueError, match="kv_len_arr must be on the CPU, got meta"):
        w.plan(**_plan_args(tables, 16, 16, kv_len_arr=tables[3].to("meta")))


def test_run_compiles_fullgraph_to_meld_op():
    """torch.compile(fullgraph=True) over the wrapper's run(): one graph holding torch.ops.meld.decode_mla, equal
    to eager, across a later plan() of the same batch size (the op reads the operator's current plan)."""
    H, P = 16, 16
    inputs = _inputs(4, H, P, num_pages=12)
    w = _wrapper()
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda *a: w.run(*a, return_lse=True), fullgraph=True, backend=counter)
    with torch.no_grad():
        for lens in ([5, 0, 70, 33], [40, 1, 0, 9]):
            w.plan(**_plan_args(_tables(lens, P, num_pages=12), H, P))
            got, want = step(*inputs), w.run(*inputs, return_lse=True)
            assert all(torch.equal(g, x) for g, x in zip(got, want))
    assert counter.frame_count == 1
    assert torch.ops.meld.decode_mla.default in {n.target for gm in counter.graphs for n in gm.graph.nodes}


def test_several_causal_rows_per_request_match_float64():
    """qo_indptr = 0, 2, 4, ... with causal=True: DecodeMLA(q_len=2) under FlashInfer's causal mask (a request
    with as many keys as rows among them); without causal, or with rows that differ per request,
    NotImplementedError naming the argument, and the plan stays."""
    tables, inputs = _batch([5, 2, 70, 33], 16, 64, q_len=2)
    w = _wrapper()
    w.plan(**_plan_args(tables, 64, 16, causal=True))
    out, lse = w.run(*inputs, return_lse=True)
    _assert_close(out, lse, *_reference(tables, inputs))
    with pytest.raises(NotImplementedError, match="causal=False"):
        w.plan(**_plan_args(tables, 64, 16, causal=False))
    with pytest.raises(NotImplementedError, match="qo_indptr"):
        w.plan(**_plan_args(tables, 64, 16, causal=True, qo_indptr=torch.tensor([0, 2, 4, 6, 9], dtype=torch.int32)))
    assert torch.equal(w.run(*inputs), out), "a plan() that raised changed the plan"


# --- GPU --------------------------------------------------------------------------------------------------------
def _flashinfer_mla():
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")   # its JIT then builds for the H200 alone
    pytest.importorskip("flashinfer", reason="FlashInfer does not import here")
    import flashinfer.mla
    return flashinfer.mla


def _lens(B, P, seed):
    """B mixed KV lengths, none a multiple of P (1 .. 3000 tokens)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 3000, (B,), generator=g)
    return (lens + (lens % P == 0).long()).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("P", [64, 16])
@pytest.mark.parametrize("B,H", [(1, 128), (7, 16), (64, 128)])
def test_gpu_matches_flashinfer(B, H, P):
    """FlashInfer's own wrapper and meld's on FlashInfer's documented usage (device tables, return_lse; DeepSeek's
    128 heads, or 16 as under 8-way tensor parallelism), meld's outputs poisoned first: both against float64, and
    meld's lse against FlashInfer's (base 2)."""
    _check_against_flashinfer(*_batch(_lens(B, P, B + P), P, H, device="cuda"), H, P, causal=False)


def _check_against_flashinfer(tables, inputs, H, P, causal):
    """FlashInfer's wrapper (fa2) and meld's planned alike on device tables, meld's outputs poisoned first: both
    against float64 (`_reference`, causal among a request's rows), and meld's lse against FlashInfer's (base 2)."""
    fi_mla = _flashinfer_mla()
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    fi, ours = fi_mla.BatchMLAPagedAttentionWrapper(ws, backend="fa2"), BatchMLAPagedAttentionWrapper(ws)
    for w in (fi, ours):
        w.plan(*_plan_args(tables, H, P, causal=causal).values())
    fi_out, fi_lse = fi.run(*inputs, return_lse=True)
    rows = inputs[0].shape[0]
    out = torch.full((rows, H, 512), math.nan, dtype=BF16, device="cuda")
    lse = torch.full((rows, H), math.nan, device="cuda")
    ours.run(*inputs, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    ref = _reference(tables, inputs)
    _assert_close(out, lse, *ref)
    _assert_close(fi_out, fi_lse, *ref)
    assert (lse - fi_lse).abs().max().item() < 1e-2, "lse must be FlashInfer's (base 2)"


@pytest.mark.gpu
def test_gpu_nan_reaches_exactly_its_rows():
    """NaN in q_nope of one (request, head) row reaches that row alone (out and lse); NaN in a latent row a
    request reads reaches every head of that request alone; NaN past a request's kv_len in its last page reaches
    nothing. Every other row is bit-identical to the clean run's."""
    H, P = 128, 64
    lens = [100, 3000, 77, 1000, 5]
    tables, inputs = _batch(lens, P, H, device="cuda")
    w = BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8, device="cuda"))
    w.plan(**_plan_args(tables, H, P))
    clean, clean_lse = w.run(*inputs, return_lse=True)
    _, indptr, indices, _ = tables
    qn, qp, ckv, kpe = (t.clone() for t in inputs)
    qn[0, 3, 7] = math.nan                                        # request 0, head 3
    ckv[indices[int(indptr[1]) + 20], 5, 100] = math.nan          # request 1's token 20 * 64 + 5 (split: 3000 tokens)
    ckv[indices[int(indptr[3]) + 15], 1000 - 15 * P, 0] = math.nan  # request 3's last page, past its 1000 tokens
    out, lse = w.run(qn, qp, ckv, kpe, return_lse=True)
    torch.cuda.synchronize()
    nan = torch.zeros(len(lens), H, dtype=torch.bool, device="cuda")
    nan[0, 3] = True
    nan[1] = True
    assert torch.equal(out.isnan().any(-1), nan) and torch.equal(lse.isnan(), nan), "NaN must reach exactly its rows"
    assert torch.equal(out[~nan], clean[~nan]) and torch.equal(lse[~nan], clean_lse[~nan])


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_later_plans():
    """use_cuda_graph=True with GPU buffers: run() captured once, then re-planned (from GPU tables, with check and
    without) for batches of other lengths, the same batch size: each replay (output poisoned first) matches
    float64 and the wrapper's eager run, bit for bit."""
    H, P, B = 128, 64, 7
    cuda = dict(dtype=torch.int32, device="cuda")
    bufs = dict(qo_indptr=torch.empty(B + 1, **cuda), kv_indptr=torch.empty(B + 1, **cuda),
                kv_indices=torch.empty(2048, **cuda), kv_len_arr=torch.empty(B, **cuda))
    w = BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8, device="cuda"), True, **bufs)
    inputs = _inputs(B, H, P, num_pages=512, device="cuda")   # one cache for every plan (a captured run reads it)
    out = torch.empty(B, H, 512, dtype=BF16, device="cuda")
    lse = torch.empty(B, H, device="cuda")
    graph = None
    for i, check in enumerate((True, True, False)):
        tables = _tables(_lens(B, P, i), P, extra=[i] * B, num_pages=512, seed=i, device="cuda")
        w.plan(**_plan_args(tables, H, P, check=check))
        if graph is None:
            w.run(*inputs, out=out, lse=lse)   # warm-up outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                w.run(*inputs, out=out, lse=lse)
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        want, want_lse = w.run(*inputs, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(lse, want_lse), f"replay {i} differs from eager"
        _assert_close(out, lse, *_reference(tables, inputs))


@pytest.mark.gpu
def test_gpu_plan_from_device_tables_without_check():
    """check=False from GPU tables (no host synchronisation), unread pages included: the same plan as check=True."""
    H, P = 128, 64
    tables, inputs = _batch([5, 0, 3000, 64 * 3 + 1, 700], P, H, extra=[1, 2, 0, 3, 0], device="cuda")
    w = BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8, device="cuda"))
    w.plan(**_plan_args(tables, H, P))
    want = w.run(*inputs, return_lse=True)
    w.plan(**_plan_args(tables, H, P, check=False))
    got = w.run(*inputs, return_lse=True)
    torch.cuda.synchronize()
    assert all(torch.equal(g, x) for g, x in zip(got, want))
    _assert_close(*got, *_reference(tables, inputs))


@pytest.mark.gpu
def test_gpu_run_compiles_fullgraph():
    """torch.compile(fullgraph=True, inductor) over run() on the GPU: no graph break, equal to eager across plans."""
    H, P = 128, 64
    w = BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8, device="cuda"))
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(lambda *a: w.run(*a, return_lse=True), fullgraph=True, backend=counter)
    inputs = _inputs(5, H, P, num_pages=300, device="cuda")
    with torch.no_grad():
        for seed in range(3):
            w.plan(**_plan_args(_tables(_lens(5, P, seed), P, num_pages=300, seed=seed, device="cuda"), H, P))
            got, want = step(*inputs), w.run(*inputs, return_lse=True)
            torch.cuda.synchronize()
            assert all(torch.equal(g, x) for g, x in zip(got, want))
    assert counter.frame_count == 1


@pytest.mark.gpu
def test_gpu_opcheck_decode_mla():
    tables, inputs = _batch([100, 0, 3000], 64, 128, device="cuda")
    w = BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8, device="cuda"))
    w.plan(**_plan_args(tables, 128, 64))
    qn = inputs[0]
    torch.library.opcheck(torch.ops.meld.decode_mla.default,
                          (*inputs, torch.empty_like(qn), torch.empty(3, 128, device="cuda"), w._op.handle))


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [2, 4])
def test_gpu_matches_flashinfer_with_several_rows_per_request(q_len):
    """q_len causal rows per request (qo_indptr = 0, q_len, ...), meld's wrapper and FlashInfer's own (fa2), meld's
    outputs poisoned first: both against the float64 causal reference, meld's lse against FlashInfer's."""
    lens = [q_len, 900, 4000, 65, 2049]
    _check_against_flashinfer(*_batch(lens, 64, 128, device="cuda", q_len=q_len), 128, 64, causal=True)
