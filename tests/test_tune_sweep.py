"""meld.tuning.tune.sweep (CPU): the exhaustive space is every cost of the fine grid with every kernel,
named so that the pruned search's candidates are found in it; the comparison judges the choice by the
sweep's own measurements against the acceptance row's thresholds; `meld tune --sweep` needs --fit and
prints the pruned table and then the comparison."""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from meld import cli, config
from meld.scheduler import DecodeCost
from meld.tuning import CostFit
from meld.tuning import tune as tmod
from meld.tuning.tune import BatchResult, TuneResult, candidates, summarize, sweep_candidates


def test_the_sweep_space_is_the_fine_grid_times_the_kernels():
    default = DecodeCost.default()
    space = sweep_candidates(default)
    overheads = sorted({default.item_overhead_tokens, *tmod.FINE_ITEM_OVERHEADS})
    assert len(space) == len(overheads) * (1 + len(tmod.KERNEL_VARIANTS)) == 60
    assert space["default"] == tmod.Candidate(default)
    assert space["item_overhead_tokens=80,num_stages=3"] == tmod.Candidate(
        dataclasses.replace(default, item_overhead_tokens=80), {"num_stages": 3})
    assert space["num_warps=4,num_stages=4"] == tmod.Candidate(default, {"num_warps": 4, "num_stages": 4})
    assert space["item_overhead_tokens=32"].kernel == {}
    assert "item_overhead_tokens=128" not in space   # the default's own overhead is "default", not a second name
    pairs = {(c.cost, tuple(c.kernel.items())) for c in space.values()}
    assert len(pairs) == len(space)   # no configuration twice under two names
    assert {c.cost.item_overhead_tokens for c in space.values()} == set(overheads)


def test_every_candidate_the_search_measures_is_in_the_sweep():
    """Same name, same configuration: the sweep's time of what the search adopts is looked up by name."""
    space = sweep_candidates(DecodeCost.default())
    for cands in (candidates(DecodeCost.default()), candidates(DecodeCost.default(), tmod.FINE_ITEM_OVERHEADS)):
        assert {k: space.get(k) for k in cands} == cands


def _batch(name, **ratios):
    return BatchResult(name, {"default": 100.0, **{k: 100.0 * r for k, r in ratios.items()}},
                       {"default": (1.0, 1.0, 1.0), **{k: (r, r - 0.01, r + 0.01) for k, r in ratios.items()}})


def _swept(**per_batch):
    """Two batches with the given (first, second) ratios per candidate."""
    return [_batch(f"b{i}", **{k: v[i] for k, v in per_batch.items()}) for i in range(2)]


def _pruned(adopted):
    return TuneResult([], {}, adopted)


def test_the_comparison_uses_the_sweeps_measurements_and_the_thresholds():
    """Within 2% of the sweep's fastest passes and just past it fails (by the sweep's numbers, whatever the
    pruned run measured); so with the time: 10% of the sweep's passes, 11% fails."""
    swept = _swept(**{"num_stages=3": (0.979, 0.979), "item_overhead_tokens=80,num_stages=3": (0.96, 0.96),
                      "tma=True": (0.98, 0.98), "item_overhead_tokens=32": (1.05, 1.05)})
    close = summarize(TuneResult([], {"num_stages=3": 0.5}, "num_stages=3"), swept, 1.0, 10.0, 5.0)
    assert close.best == "item_overhead_tokens=80,num_stages=3" and close.tuned == "num_stages=3"
    assert close.quality == pytest.approx(0.979 / 0.96) and close.time_ratio == pytest.approx(0.1) and close.passed
    assert not summarize(_pruned("num_stages=3"), swept, 1.1, 10.0, 5.0).passed
    far = summarize(_pruned("tma=True"), swept, 0.5, 10.0, 5.0)
    assert far.quality == pytest.approx(0.98 / 0.96) and not far.passed
    report = tmod.sweep_report(far).splitlines()
    assert report[0].startswith("sweep: 5 candidates on 2 batches; fastest item_overhead_tokens=80,num_stages=3")
    assert "(rank 3 of 5)" in report[1] and report[1].endswith("(<= 1.02: FAIL)")
    assert "0.0500 of the sweep's (<= 0.1: pass)" in report[2] and report[2].endswith("first launch: 5.0 s")
    assert report[-1] == "acceptance row: FAIL"


def test_no_adoption_is_judged_as_the_default():
    """The pruned search adopting nothing leaves the default: judged at 1, against a sweep that found a
    candidate 5% faster (fails) or none faster (the default is the fastest: passes)."""
    better = summarize(_pruned(None), _swept(**{"num_stages=3": (0.95, 0.95)}), 1.0, 100.0, 0.0)
    assert better.tuned == "default" and better.quality == pytest.approx(1 / 0.95) and not better.passed
    none = summarize(_pruned(None), _swept(**{"num_stages=3": (1.01, 1.03)}), 1.0, 100.0, 0.0)
    assert none.best == "default" and none.quality == 1.0 and none.passed
    with pytest.raises(ValueError, match="adopted 'tma=True', which the sweep did not measure"):
        summarize(_pruned("tma=True"), _swept(**{"num_stages=3": (1.0, 1.0)}), 1.0, 100.0, 0.0)


def test_sweep_times_the_pruned_search_and_the_whole_space(monkeypatch):
    """sweep(): a warm-up of the default alone, then the pruned search (default, `keep` planner candidates,
    the kernel variants), then all 60; each run's time is its own span of the clock."""
    clock = [0.0]
    seen = []

    def fake_measure(cands, batches, rounds=5, reps=10, **kw):
        seen.append((set(cands), len(batches), rounds))
        clock[0] += len(cands) * len(batches)   # one second per candidate and batch
        return [_batch(name, **{k: 0.99 if k == "item_overhead_tokens=48,tma=True" else 1.0
                                for k in cands if k != "default"}) for name, _ in batches]

    compiled = []
    monkeypatch.setattr(tmod, "measure", fake_measure)
    monkeypatch.setattr(tmod, "compile_all", lambda cands: compiled.append(len(cands)))
    monkeypatch.setattr(tmod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    batches = tmod.bench_batches()[:2]
    r = tmod.sweep(batches, CostFit(10.0, 0.0, 0.0, 0.0), rounds=3, device="cpu", keep=2, sm_count=132)
    assert compiled == [60] and seen[0] == ({"default"}, 1, 1)
    assert len(seen[1][0]) == 1 + 2 + 3 and seen[2][0] == set(sweep_candidates(DecodeCost.default()))
    assert [s[2] for s in seen[1:]] == [3, 3] and all(s[1] == 2 for s in seen[1:])
    assert (r.warmup_s, r.pruned_s, r.sweep_s) == (1.0, 12.0, 120.0)
    assert r.tuned == "default" and r.best == "item_overhead_tokens=48,tma=True" and r.pruned.adopted is None


def test_cli_sweep_needs_a_fit(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["tune", "--workload", "bench", "--sweep", "--db", str(tmp_path / "t.json")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --sweep: needs --fit" in err


def test_cli_sweep_prints_the_pruned_table_then_the_comparison(tmp_path, monkeypatch, capsys):
    """With a GPU (pretended): no database needed, nothing written, the pruned run's table then the report."""
    fit = tmp_path / "fit.json"
    fit.write_text('{"per_token_ns": 10.0, "per_item_ns": 0.0, "per_merge_ns": 0.0, "fixed_ns": 0.0}')
    calls = []
    pruned = TuneResult(_swept(**{"num_stages=3": (0.97, 0.98)}), {"num_stages=3": 0.975}, "num_stages=3")
    result = summarize(pruned, _swept(**{"num_stages=3": (0.97, 0.97)}), 2.0, 40.0, 9.0)
    monkeypatch.setattr(tmod, "sweep", lambda batches, f, **kw: calls.append((len(batches), f, kw)) or result)
    monkeypatch.setattr(cli, "_devices", lambda: ["cpu", "cuda:0"])
    with config.scope(MELD_TUNING_DB=""):   # no database given, none needed
        assert cli.main(["tune", "--workload", "bench", "--fit", str(fit), "--sweep", "--keep", "3"]) == 0
    out = capsys.readouterr().out
    (n, f, kw), = calls
    assert n == 6 and f.per_token_ns == 10.0 and kw == {"rounds": 5, "device": "cuda", "keep": 3}
    assert out.index("adopted: num_stages=3") < out.index("sweep: 2 candidates") and "acceptance row: pass" in out
    assert list(tmp_path.iterdir()) == [fit]


def test_racing_drops_only_candidates_slower_beyond_the_noise():
    from meld.tuning.tune import racing

    rng = np.random.default_rng(3)
    samples = {"default": list(100 + rng.normal(0, 0.5, 10)), "slow": list(104 + rng.normal(0, 0.5, 10)),
               "tie": list(100 + rng.normal(0, 0.5, 10)), "fast": list(96 + rng.normal(0, 0.5, 10)),
               "noisy": [94.0, 107.0] * 5}   # slower on average, but within its own noise
    assert racing(samples, ["fast", "slow", "default", "tie", "noisy"]) == ["fast", "default", "tie", "noisy"]
