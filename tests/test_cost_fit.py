"""meld.tuning.cost_fit on traces synthesised from real schedules with known costs: the samples count the
plan's work and the trace's merges per CTA, the fit recovers the constants and per-SM speeds, a few
outlier CTAs do not move it, and held-out launches are predicted as well as the training ones."""
import dataclasses

import numpy as np
import pytest

from meld.runtime.profile import CtaSpan, TaskRecord, Trace
from meld.scheduler import DecodeCost, Topology, plan_decode
from meld.tuning import CostFit, concat, cta_samples, errors, fit_cost, today
from meld.workloads import lengths

TRUE = CostFit(per_token_ns=2.5, per_item_ns=900.0, per_merge_ns=1500.0, fixed_ns=4000.0)
SMS = 66


def _schedule(dist: str, batch: int, ctas: int = SMS):
    L = np.array(lengths(dist, batch), dtype=np.int64)
    return plan_decode(L, np.r_[0, np.cumsum(-(-L // 16))][:-1].astype(np.int64), 8, 4, Topology(ctas))


def _trace(schedule, rng, speed=None, outliers=0, noise=0.01, model=TRUE) -> Trace:
    """A trace whose CTA c, on SM c, runs its items back to back and ends after
    speed[c] * model(tokens, items, merges, the launch's means of them) with multiplicative noise; merges:
    one per split unit, on its last piece's CTA."""
    it = schedule.items()
    spans, tasks = [], []
    last = {}
    for i, (c, u, s) in enumerate(zip(it["cta"], it["unit"], it["slot"])):
        if s >= 0:
            last[u] = c
    merges = np.bincount(np.array(list(last.values()), dtype=np.int64), minlength=schedule.num_ctas)
    tokens = np.bincount(it["cta"], weights=it["kv_end"] - it["kv_begin"], minlength=schedule.num_ctas)
    items = np.bincount(it["cta"], minlength=schedule.num_ctas)
    slow = set(rng.choice(np.flatnonzero(items), outliers, replace=False).tolist()) if outliers else set()
    used = items > 0
    mix = (model.mix_token_ns * tokens[used].mean() + model.mix_item_ns * items[used].mean()
           + model.mix_merge_ns * merges[used].mean())
    for c in range(schedule.num_ctas):
        if not items[c]:
            continue
        t = (model.per_token_ns * tokens[c] + model.per_item_ns * items[c] + model.per_merge_ns * merges[c]
             + model.fixed_ns + mix)
        t *= (1.0 if speed is None else speed[c]) * rng.normal(1.0, noise) * (3.0 if c in slow else 1.0)
        begin = 1_000_000 + int(rng.integers(0, 500))
        end = begin + int(t)
        spans.append(CtaSpan(c, c, begin, end + 100, c, 0))
        tasks.append(TaskRecord(c, c, "piece", 0, begin + 50, end - 10 * merges[c]))
        tasks += [TaskRecord(c, c, "merge-hbm", 0, end - 10 * (k + 1), end - 10 * k) for k in range(merges[c])]
    return Trace(tasks, spans, 0, 8, 1)


def _samples(rng, launches=6, **kw):
    scheds = [_schedule(d, b) for b in (64, 256) for d in ("skewed", "one-long", "uniform2k")]
    return concat([cta_samples(s, _trace(s, rng, **kw), launch=i * len(scheds) + j)
                   for i in range(launches) for j, s in enumerate(scheds)])


def test_samples_count_the_plan_and_the_trace():
    s = _schedule("skewed", 64)
    smp = cta_samples(s, _trace(s, np.random.default_rng(0), noise=0.0), launch=3)
    used = np.flatnonzero(np.bincount(s.items()["cta"], minlength=s.num_ctas))
    assert len(smp) == len(used) and (smp.launch == 3).all() and (smp.sm == used).all()
    assert np.array_equal(smp.tokens, s.cta_cost(0)[used])
    assert smp.merges.sum() == len({u for u, sl in zip(s.items()["unit"], s.items()["slot"]) if sl >= 0})
    assert np.allclose(smp.time_ns, TRUE.predict(smp), rtol=1e-6, atol=2)


def test_fit_recovers_the_constants_and_ignores_outliers():
    rng = np.random.default_rng(1)
    s = _samples(rng, outliers=3)
    f = fit_cost(s)
    assert f.per_token_ns == pytest.approx(TRUE.per_token_ns, rel=0.02)
    assert f.per_item_ns == pytest.approx(TRUE.per_item_ns, rel=0.15)
    assert f.per_merge_ns == pytest.approx(TRUE.per_merge_ns, rel=0.15)
    assert np.percentile(errors(f, s), 90) < 0.03
    assert f.item_overhead_tokens == pytest.approx(360, rel=0.15)
    # the shipped model (128 tokens per item, nothing per merge or CTA) cannot follow these costs
    assert np.percentile(errors(today(s, DecodeCost()), s), 90) > 2 * np.percentile(errors(f, s), 90)


def test_per_sm_speeds_are_recovered_and_hold_on_held_out_launches():
    rng = np.random.default_rng(2)
    speed = rng.uniform(0.9, 1.1, SMS)
    s = _samples(rng, speed=speed)
    train, test = s.where(s.launch % 3 != 0), s.where(s.launch % 3 == 0)
    plain, per_sm = fit_cost(train), fit_cost(train, per_sm=True)
    got = np.array([per_sm.sm_speed[c] for c in range(SMS) if c in per_sm.sm_speed])
    want = np.array([speed[c] for c in range(SMS) if c in per_sm.sm_speed])
    assert np.corrcoef(got, want)[0, 1] > 0.95
    assert np.percentile(errors(per_sm, test), 90) < 0.5 * np.percentile(errors(plain, test), 90)


def test_too_few_or_bad_samples_raise():
    s = _samples(np.random.default_rng(3), launches=1)
    with pytest.raises(ValueError, match="need at least 8 CTA samples"):
        fit_cost(s.where(np.arange(len(s)) < 3))
    bad = s.where(np.ones(len(s), dtype=bool))
    bad.time_ns[0] = 0
    with pytest.raises(ValueError, match="finite and positive"):
        fit_cost(bad)


def test_launch_mix_terms_are_recovered_where_the_plain_fit_misses_them():
    """CTAs that share the memory bandwidth: each one's time depends on the launch's mean work too."""
    mixed = dataclasses.replace(TRUE, mix_token_ns=1.2, mix_item_ns=-400.0)
    s = _samples(np.random.default_rng(4), model=mixed)
    plain, fit = fit_cost(s), fit_cost(s, mix=True)
    # A balanced plan gives every CTA about the mean tokens: what is identified is the sum of the own and
    # the launch's per-token costs, the sign of the mix's item term, and the predictions.
    assert fit.per_token_ns + fit.mix_token_ns == pytest.approx(TRUE.per_token_ns + 1.2, rel=0.05)
    assert fit.mix_item_ns < -100
    assert np.percentile(errors(fit, s), 90) < 0.03 < np.percentile(errors(plain, s), 90)
    with pytest.raises(ValueError, match="at least 4 different mixes, got 1"):
        fit_cost(s.where(s.launch == 0), mix=True)


@pytest.mark.parametrize("model", [TRUE, dataclasses.replace(TRUE, mix_token_ns=1.2, mix_item_ns=-400.0)])
def test_a_plan_alone_predicts_what_its_trace_measures(model):
    """plan_samples counts the same work per CTA as the trace of the plan's launch, so a model predicts each
    CTA's time, and the launch's (its slowest CTA), before anything runs."""
    from meld.tuning import plan_samples, predicted_launch_ns

    for dist in ("skewed", "one-long"):
        s = _schedule(dist, 64)
        measured = cta_samples(s, _trace(s, np.random.default_rng(5), noise=0.0, model=model))
        planned = plan_samples(s)
        assert np.array_equal(planned.sm, measured.sm) and np.isnan(planned.time_ns).all()
        assert np.allclose(model.predict(planned), measured.time_ns, rtol=1e-6, atol=2)
        assert predicted_launch_ns(model, s) == pytest.approx(measured.time_ns.max(), abs=2)   # (times in whole ns)


def test_a_fit_survives_json(tmp_path):
    import json

    from meld.tuning.tune import load_fit

    f = dataclasses.replace(TRUE, mix_token_ns=1.5, sm_speed={3: 1.01, 7: 0.99})
    one = tmp_path / "one.json"
    one.write_text(json.dumps(dataclasses.asdict(f)))
    assert load_fit(one) == f
    bench = tmp_path / "bench.json"   # bench/cost_fit.py --json: the fits by name
    bench.write_text(json.dumps({"fits": {"fit": dataclasses.asdict(TRUE), "fit+mix": dataclasses.asdict(f)}, "rows": []}))
    assert load_fit(bench) == f
    bench.write_text(json.dumps({"fits": {"today": dataclasses.asdict(TRUE)}}))
    with pytest.raises(ValueError, match="neither 'fit\\+mix' nor 'fit'"):
        load_fit(bench)
    one.write_text(json.dumps({"per_token_ns": 1.0, "speed": 2}))
    with pytest.raises(ValueError, match="unknown fields \\['speed'\\]"):
        load_fit(one)
