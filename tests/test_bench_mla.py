"""bench/mla.py without a GPU: --dry-run lists BENCH.md's MLA cases with their bytes and FLOPs, imports no
FlashInfer, and the CPU-side pieces (inputs, the check against the float64 reference) behave."""
import math
import sys

import torch

from bench import harness, mla


def test_dry_run_lists_the_bench_cases(capsys):
    assert mla.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["16"], ["64"], ["128"])]
    assert [(r[0], r[1]) for r in rows] == [(str(b), d) for b in mla.BATCHES for d in mla.DISTS]
    b64_skewed = next(r for r in rows if r[:2] == ["64", "skewed"])
    assert b64_skewed[2] == "236129"  # BENCH.md's B=64 skewed Σlen
    assert "meld, fi-fa2, fi-fa3" in out
    assert "flashinfer" not in sys.modules


def test_dry_run_selects_cases_and_impls(capsys):
    assert mla.main(["--dry-run", "--batches", "64", "--dists", "one-long", "--impls", "meld"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(" 64") or
            line.startswith("64")]
    assert len(rows) == 1 and rows[0][:3] == ["64", "one-long", str(63 * 512 + 65536)]
    assert rows[0][-1] == "meld"


def test_dry_run_schedule_runs_both_builds(capsys):
    assert mla.main(["--dry-run", "--batches", "16", "--dists", "skewed", "--impls", "meld", "flashmla",
                     "--schedule", "both"]) == 0
    assert "meld, meld-seesaw, flashmla" in capsys.readouterr().out


def test_sizes_follow_bench():
    t = mla.page_table([2048, 100])
    assert mla.kv_bytes(t) == 2148 * 576 * 2
    assert mla.flops(t) == 2148 * 128 * (576 + 512) * 2
    assert t.num_pages == 32 + 2 and t.last_page_len.tolist() == [64, 36]


def test_check_against_reference_on_cpu():
    inp = mla.make_inputs(mla.Case(2, "skewed"), device="cpu")
    out, lse = mla.reference(inp)
    err, lse_err, problems = harness.check_output(out.to(torch.bfloat16), out, lse.float(), lse)
    assert problems == [] and err < 5e-3 and lse_err < 1e-5
    bad = out.to(torch.bfloat16)
    bad[1, 3, 7] = math.nan  # an unwritten element of a poisoned output
    _, _, problems = harness.check_output(bad, out, (lse / math.log(2)).float(), lse)  # and a base-2 lse
    assert any("NaN" in p for p in problems) and any("lse err" in p for p in problems)


def test_summary_line_gives_both_peers_ratios():
    from bench.mla import summary_line

    rows = [{"case": "B=16 a", "speedup": 1.2, "vs_flashmla": 0.7, "pct_read": 20.0, "pct_mma": 30.0},
            {"case": "B=128 b", "speedup": 1.4, "vs_flashmla": None, "pct_read": 30.0, "pct_mma": 45.0}]
    line = summary_line(rows, [])
    assert "meld vs best FlashInfer over 2 cases" in line and "meld vs FlashMLA over 1 cases: geomean 0.70x" in line
