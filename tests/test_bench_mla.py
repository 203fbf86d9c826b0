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


def test_dry_run_takes_the_long_uniform_cases(capsys):
    """The opt-in long cases (not in the default list): every request the same length, B = 66 a unit an SM."""
    assert mla.main(["--dry-run"]) == 0
    assert "uniform32k" not in capsys.readouterr().out
    assert mla.main(["--dry-run", "--batches", "66", "--dists", "uniform8k", "uniform32k", "--impls", "meld"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["66"]]
    assert [r[:3] for r in rows] == [["66", "uniform8k", str(66 * 8192)], ["66", "uniform32k", str(66 * 32768)]]


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


def test_q_len_cases_sizes_and_peers(capsys):
    """--q-len N: N query rows per request, FLOPs over the keys each new token sees, FlashInfer left out."""
    assert mla.main(["--dry-run", "--q-len", "2", "--batches", "16", "--dists", "uniform2k"]) == 0
    out = capsys.readouterr().out
    assert "2 new tokens per request" in out and "meld, flashmla" in out and "fi-fa2" not in out
    t = mla.page_table([2048, 100])
    assert mla.flops(t, 2) == (2047 + 2048 + 99 + 100) * 128 * (576 + 512) * 2
    inp = mla.make_inputs(mla.Case(2, "skewed", 2), device="cpu")
    assert inp.q_nope.shape == (4, 128, 512) and inp.q_pe.shape == (4, 128, 64) and inp.case.name == "B=2 skewed q2"
    out, lse = mla.reference(inp)
    assert out.shape == (4, 128, 512) and lse.shape == (4, 128)
    assert mla.skip_reason("fi-fa3", 2) == "fi-fa3 runs q_len 1 only in this benchmark (got --q-len 2)"


def test_summary_line_gives_tflops_against_the_matmul_ceiling():
    from bench.mla import summary_line

    rows = [{"case": "B=16 a q2", "vs_flashmla": 0.9, "pct_read": 20.0, "meld_tflops": 300.0, "pct_mma": 40.0,
             "flashmla_tflops": 400.0, "pct_mma_flashmla": 52.0},
            {"case": "B=64 b q2", "vs_flashmla": 1.1, "pct_read": 30.0, "meld_tflops": 500.0, "pct_mma": 65.0,
             "flashmla_tflops": 450.0, "pct_mma_flashmla": 58.0}]
    line = summary_line(rows, [])
    assert "no meld-vs-FlashInfer ratio measured; meld vs FlashMLA over 2 cases" in line
    assert "meld peaks at 500 TFLOP/s, 65% of the bf16 matmul ceiling (B=64 b q2)" in line
    assert "FlashMLA peaks at 450 TFLOP/s, 58% of the bf16 matmul ceiling (B=64 b q2)" in line


def test_fp8_mode_inputs_and_impls(capsys):
    """--kv-dtype fp8: meld's e4m3 build, its bf16 build and FlashMLA's FP8 path; the bf16 caches are the e4m3
    cache's values x its power-of-two scale, exactly."""
    assert mla.main(["--dry-run", "--kv-dtype", "fp8", "--batches", "16", "--dists", "skewed"]) == 0
    assert "meld-fp8, meld, flashmla-fp8" in capsys.readouterr().out
    inp = mla.make_inputs(mla.Case(2, "skewed"), device="cpu", kv_dtype="fp8")
    assert inp.cache8.dtype == torch.float8_e4m3fn and math.log2(inp.kv_scale).is_integer()
    deq = inp.cache8.double() * inp.kv_scale
    assert torch.equal(deq[..., :512], inp.ckv_cache.double()) and torch.equal(deq[..., 512:], inp.kpe_cache.double())
    assert inp.cache8.float().abs().max() <= mla.E4M3_MAX
