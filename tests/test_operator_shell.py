"""The operator shell (meld/ops/base.py): capacity-sized buffers (reused at the same addresses while a plan
fits them, grown otherwise, installed only with the plan that needs them) and transactional plan(): a plan()
that raises leaves every operator exactly as it was, on the CPU executor and on the GPU."""
import copy
from types import SimpleNamespace

import pytest
import torch

import meld
from meld import config
from meld.ops.base import Operator, grown
from meld.workloads import paged

I32 = torch.int32


def test_grown_keeps_the_capacities_a_plan_fits_and_gives_the_others_twice_its_need():
    assert grown({"a": 4, "b": 10}, {"a": 4, "b": 3}) is None
    assert grown({"a": 4, "b": 10}, {"a": 5, "b": 3}) == {"a": 10, "b": 10}
    assert grown({}, {"a": 0, "b": 3}) == {"a": 1, "b": 6}   # none yet: every buffer holds at least one entry


class _Shell(Operator):
    """The shell alone: one buffer of `rows` entries, on the CPU."""

    def __init__(self, device: str = "cpu"):
        self.device = torch.device(device)

    def _make_buffers(self, caps):
        return SimpleNamespace(caps=caps, rows=torch.zeros(caps["rows"]))


def test_buffers_are_reused_while_a_plan_fits_and_replaced_only_by_a_commit():
    op = _Shell()
    first = op._buffers_for({"rows": 3})
    assert first.caps == {"rows": 6} and op._buf is None, "new buffers wait for the plan's commit"
    op._commit("plan 1", first)
    address = first.rows.data_ptr()
    assert op._buffers_for({"rows": 6}) is first and first.rows.data_ptr() == address
    op._commit("plan 2")
    assert (op._planned, op._buf) == ("plan 2", first)
    larger = op._buffers_for({"rows": 7})
    assert larger.caps == {"rows": 14} and op._buf is first, "a plan() that raises now keeps the old buffers"
    op._commit("plan 3", larger)
    assert op._buf is larger


def test_an_operator_copies_on_the_cpu_but_not_on_a_gpu():
    op = _Shell()
    op._commit("plan", op._buffers_for({"rows": 2}))
    twin = copy.deepcopy(op)
    assert twin._planned == "plan" and twin._buf.rows is not op._buf.rows
    with pytest.raises(TypeError, match="cannot be copied or pickled: its kernel's parameters point at its own"):
        copy.deepcopy(_Shell("cuda"))   # (its kernels' parameters would point at the original's buffers)


# --- a plan() that raises changes nothing ---------------------------------------------------------------
def _assert_unchanged(op, before: dict) -> None:
    after = vars(op)
    assert after.keys() == before.keys()
    changed = [k for k in before if after[k] is not before[k]]
    assert not changed, f"a plan() that raised changed {changed}"


def _decode_plans(device):
    """A DecodeAttention, a plan of it, q and kv for run(), and plans that fail at each stage of plan()."""
    attn = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, device, max_batch_size=8)
    pb = paged([300, 17, 0, 90], 16)
    bad_last = pb.kv_last_page_len.clone()
    bad_last[1] = 99
    big = paged([5] * 9, 16)
    bad_index = pb.kv_indices.clone()
    bad_index[-1] = -4
    failing = [((pb.kv_indptr, pb.kv_indices, bad_last), r"kv_last_page_len\[1\]=99"),
               ((pb.kv_indptr, bad_index, pb.kv_last_page_len), "negative page index"),
               ((pb.kv_indptr.float(), pb.kv_indices, pb.kv_last_page_len), "kv_indptr must have dtype"),
               ((big.kv_indptr, big.kv_indices, big.kv_last_page_len), "exceeds max_batch_size=8")]
    q = torch.randn(4, 8, 64).bfloat16().to(device)
    kv = torch.randn(pb.num_pages, 2, 16, 2, 64).bfloat16().to(device)
    return attn, (pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len), (q, kv), failing


def _mla_plans(device):
    mla = meld.DecodeMLA(16, 16, torch.bfloat16, device, sm_scale=0.1, max_batch_size=4)
    pb = paged([100, 3, 40], 16)
    big = paged([5] * 5, 16)
    bad_last = pb.kv_last_page_len.clone()
    bad_last[0] = 0
    failing = [((pb.kv_indptr, pb.kv_indices, bad_last), r"kv_last_page_len\[0\]=0"),
               ((big.kv_indptr, big.kv_indices, big.kv_last_page_len), "exceeds max_batch_size=4")]
    q = (torch.randn(3, 16, 512).bfloat16().to(device), torch.randn(3, 16, 64).bfloat16().to(device))
    caches = (torch.randn(pb.num_pages, 16, 512).bfloat16().to(device),
              torch.randn(pb.num_pages, 16, 64).bfloat16().to(device))
    return mla, (pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len), (*q, *caches), failing


def _levels(groups, prefix, suffix):
    """Two levels of a cascade batch: per group a prefix, per request a suffix, each on pages of its own."""
    nxt, out = 0, []
    for lens, sizes in ((prefix, groups), (suffix, [1] * len(suffix))):
        pages = [-(-n // 16) for n in lens]
        out.append([torch.tensor([0] + sizes, dtype=I32).cumsum(0, dtype=I32),
                    torch.tensor([0] + pages, dtype=I32).cumsum(0, dtype=I32),
                    torch.arange(nxt, nxt + sum(pages), dtype=I32),
                    torch.tensor([(n - 1) % 16 + 1 for n in lens], dtype=I32)])
        nxt += sum(pages)
    return [[lv[i] for lv in out] for i in range(4)], nxt


def _cascade_plans(device):
    op = meld.CascadeDecode(8, 2, 64, 16, 2, torch.bfloat16, device, num_ctas=8)
    good, pages = _levels([2, 2], [100, 40], [5, 9, 30, 1])
    uneven, _ = _levels([2, 3], [100, 40], [5, 9, 30, 1])
    bad_last = [list(a) for a in good]
    bad_last[3][1] = torch.tensor([1, 2, 3, 77], dtype=I32)
    failing = [(uneven, r"qo_indptr_arr\[1\]\[-1\]=4, but level 0 has 5 requests"),
               (bad_last, r"level 1: kv_last_page_len\[3\]=77"),
               (good[:3] + [good[3][:1]], "list of num_levels=2 tensors, got list of 1")]
    q = torch.randn(4, 8, 64).bfloat16().to(device)
    kv = torch.randn(pages, 2, 16, 2, 64).bfloat16().to(device)
    return op, good, (q, kv), failing


def _plan_that_raises_changes_nothing(make, device):
    op, args, inputs, failing = make(device)
    op.plan(*args)
    want = op.run(*inputs, return_lse=True)
    before = dict(vars(op))
    for bad, match in failing:
        with pytest.raises(ValueError, match=match):
            op.plan(*bad)
        _assert_unchanged(op, before)
    got = op.run(*inputs, return_lse=True)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("make", [_decode_plans, _mla_plans, _cascade_plans], ids=["decode", "mla", "cascade"])
def test_a_plan_that_raises_changes_nothing_on_the_cpu(make):
    _plan_that_raises_changes_nothing(make, "cpu")


def test_a_plan_that_raises_on_a_bad_dump_dir_changes_nothing(tmp_path):
    attn, args, inputs, _ = _decode_plans("cpu")
    attn.plan(*args)
    before = dict(vars(attn))
    (tmp_path / "file").write_text("")
    with config.scope(MELD_DUMP_DIR=str(tmp_path / "file")), pytest.raises(ValueError, match="MELD_DUMP_DIR"):
        attn.plan(*args)
    _assert_unchanged(attn, before)


@pytest.mark.gpu
@pytest.mark.parametrize("make", [_decode_plans, _mla_plans, _cascade_plans], ids=["decode", "mla", "cascade"])
def test_a_plan_that_raises_changes_nothing_on_the_gpu(make):
    _plan_that_raises_changes_nothing(make, "cuda")


@pytest.mark.gpu
def test_a_decode_plan_that_would_grow_the_buffers_and_raises_keeps_them():
    attn = meld.DecodeAttention(8, 2, 64, 16, torch.bfloat16, "cuda")   # capacities not given: they grow
    pb = paged([30] * 3, 16)
    attn.plan(pb.kv_indptr, pb.kv_indices, pb.kv_last_page_len)
    buf, address = attn._buf, attn.tables.buf.data_ptr()
    big = paged([5] * 200, 16)                                        # more requests than the first buffers hold
    last = big.kv_last_page_len.clone()
    last[150] = 99
    with pytest.raises(ValueError, match=r"kv_last_page_len\[150\]=99"):
        attn.plan(big.kv_indptr, big.kv_indices, last)
    assert attn._buf is buf and attn.tables.buf.data_ptr() == address
    attn.plan(big.kv_indptr, big.kv_indices, big.kv_last_page_len)
    assert attn._buf is not buf and attn._buf.caps["batch"] == 400


@pytest.mark.gpu
@pytest.mark.parametrize("make", [_decode_plans, _cascade_plans], ids=["decode", "cascade"])
def test_plans_that_fit_rewrite_the_buffers_at_the_same_addresses(make):
    op, args, _, _ = make("cuda")
    op.plan(*args)
    buf = op._buf
    op.plan(*args)
    assert op._buf is buf, "a plan that fits keeps the buffers (a captured graph replays it)"


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_run_takes_k_and_v_apart_and_the_scales_through_the_shell(kv_dtype):
    """DecodeAttention's run() is the shell's _run over (q, kv_cache) and its options: a (k_cache, v_cache)
    tuple is one input, whose tensors that require grad tie the outputs (a backward names meld), and the FP8
    scales reach the executor through _check_run's checked cache; the result is the one cache's, bit for bit."""
    attn = meld.DecodeAttention(4, 2, 64, 16, torch.bfloat16, "cpu", kv_dtype=kv_dtype)
    attn.plan(torch.tensor([0, 2, 3], dtype=I32), torch.tensor([2, 0, 1], dtype=I32), torch.tensor([5, 16], dtype=I32))
    kv = torch.randn(3, 2, 16, 2, 64).to(kv_dtype or torch.bfloat16)
    q = torch.randn(2, 4, 64).bfloat16()
    scales = {"k_scale": 0.5, "v_scale": 0.25} if kv_dtype else {}
    want_o, want_l = attn.run(q, kv, return_lse=True, **scales)
    k = kv[:, 0].clone().requires_grad_(kv_dtype is None)
    got_o, got_l = attn.run(q, (k, kv[:, 1].clone()), return_lse=True, **scales)
    assert torch.equal(got_o, want_o) and torch.equal(got_l, want_l)
    if kv_dtype is None:
        assert got_o.requires_grad
        with pytest.raises(NotImplementedError, match="meld.DecodeAttention.run has no backward"):
            got_o.float().sum().backward()
    else:
        unscaled = attn.run(q, kv)
        assert not torch.equal(unscaled, want_o), "the scales reached the executor"
