"""bench/cascade.py and its workload without a GPU: the dry run lists BENCH.md's shared-prefix cases with the
unique bytes its floor reads, imports no FlashInfer and marks meld's cascade as CPU-only; the two-level batch
and its flat page tables are the same attention."""
import sys

import pytest
import torch

from bench import cascade
from meld import workloads
from meld.runtime.reference import attention_reference, cascade_reference


def test_dry_run_lists_the_cases_and_what_runs(capsys):
    assert cascade.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert [tuple(map(int, r[:4])) for r in rows] == [(c.batch, c.prefix, c.suffix, c.groups) for c in cascade.CASES]
    assert rows[0][5] == "160", "B=64, prefix 8192 once, 64 x 512 suffix tokens: 160 MiB of K and V"
    assert "meld-cascade meld-cascade-cta meld-cascade-mma meld-flat fi-cascade" in out
    assert "flashinfer" not in sys.modules


@pytest.mark.parametrize("batch,prefix,suffix,groups", [(8, 32, 20, 2), (6, 48, 0, 3), (4, 0, 33, 1), (3, 16, 16, 3)])
def test_shared_prefix_levels_and_flat_tables_are_one_attention(batch, prefix, suffix, groups):
    b = workloads.shared_prefix(batch, prefix, suffix, groups, 16, torch.Generator().manual_seed(batch))
    assert b.unique_tokens == groups * prefix + batch * suffix and b.lengths == [prefix + suffix] * batch
    used = torch.cat([lv[2] for lv in b.levels])
    assert sorted(used.tolist()) == list(range(b.num_pages)), "every page used once, by one level"
    q = torch.randn(batch, 4, 16).bfloat16()
    kv = torch.randn(b.num_pages, 2, 16, 2, 16).bfloat16()
    want = cascade_reference(q, kv, b.levels)
    got = attention_reference(q, kv, b.flat.kv_indptr, b.flat.kv_indices, b.flat.kv_last_page_len)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kw,match", [(dict(groups=3), "groups=3 does not divide batch=8"),
                                      (dict(prefix=20), "prefix=20 is not a multiple of page_size=16"),
                                      (dict(batch=0), "batch")])
def test_shared_prefix_refuses_what_it_cannot_build(kw, match):
    with pytest.raises(ValueError, match=match):
        workloads.shared_prefix(**({"batch": 8, "prefix": 32, "suffix": 5, "groups": 2, "page_size": 16} | kw))


def test_plan_host_times_each_phase_on_the_cpu_and_restores_the_planner():
    import meld.scheduler.split_reduce_plan as srp

    planner = srp.plan_split_reduce
    rows = cascade.plan_host([cascade.Case(8, 64, 20, 2), cascade.Case(4, 0, 16)], reps=3).rows
    assert [(r["B"], r["groups"]) for r in rows] == [(8, 2), (4, 1)]
    assert all(r[k] > 0 for r in rows for k in ("validate", "planner", "pack", "whole"))
    assert srp.plan_split_reduce is planner
