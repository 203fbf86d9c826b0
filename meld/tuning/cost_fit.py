"""Fit the decode planner's cost model to measured per-CTA times.

The planner balances the CTAs of a launch by a predicted cost: KV tokens plus `item_overhead_tokens` per
item (`DecodeCost`), a constant fitted by hand sweeps. A profiling build records when each CTA starts and
when each of its tasks ends, so every launch is a set of (planned work, measured time) samples. This
module turns (schedule, trace) pairs into those samples and fits

    time = speed[sm] * (per_token * tokens + per_item * items + per_merge * merges + fixed
                        + mix_token * mean tokens + mix_item * mean items + mix_merge * mean merges)

by robust regression (Huber weights, iteratively reweighted least squares: a CTA slowed by something the
model cannot see, a preemption or a cold TLB, must not drag the fit), where `merges` counts the merges the
CTA ran as the last arriver, `speed` is an optional factor per SM, and the `mix_*` terms (optional) weigh
the launch's mean work per CTA: the CTAs share the GPU's memory bandwidth, so a CTA streams faster when
the others spend more of their time in per-item work (bench/RESULTS.md, "the first launch after a free,
and the cost model on launches that do not follow one"). `today()` is the shipped model with only its
time scale fitted, so the two can be compared on the same samples: `errors()` gives
|predicted - measured| / measured per CTA.

    samples = concat([cta_samples(schedule, trace, launch=i) for i, (schedule, trace) in enumerate(runs)])
    fit = fit_cost(samples.where(samples.launch % 3 != 0), per_sm=True)
    print(np.percentile(errors(fit, samples.where(samples.launch % 3 == 0)), 90))
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from ..ir import Schedule
from ..ops.checks import check_finite, check_positive
from ..runtime.profile import Trace
from ..scheduler.cost_model import DecodeCost

_MERGES = ("merge-hbm", "merge-dsmem")
_WORK = ("piece",) + _MERGES


@dataclass(frozen=True)
class CtaSamples:
    """Per-CTA features and measured times (one entry per CTA that ran work), possibly of many launches."""

    tokens: np.ndarray    # KV tokens the plan gave the CTA
    items: np.ndarray     # items (pieces) the plan gave it
    merges: np.ndarray    # merges it ran, as the last arriver of a split unit (from the trace)
    sm: np.ndarray        # the SM it ran on
    time_ns: np.ndarray   # from its start to the end of its last piece or merge
    launch: np.ndarray    # which launch the sample came from
    mix_tokens: np.ndarray   # the launch's mean tokens, items and merges per CTA (the same for all its CTAs)
    mix_items: np.ndarray
    mix_merges: np.ndarray

    def __len__(self) -> int:
        return len(self.time_ns)

    def where(self, mask: np.ndarray) -> "CtaSamples":
        return CtaSamples(**{f.name: getattr(self, f.name)[mask] for f in fields(self)})


def cta_samples(schedule: Schedule, trace: Trace, launch: int = 0) -> CtaSamples:
    """The samples of one launch: the plan's work per CTA and the trace's time per CTA."""
    it = schedule.items()
    tokens = np.bincount(it["cta"], weights=it["kv_end"] - it["kv_begin"], minlength=schedule.num_ctas)
    items = np.bincount(it["cta"], minlength=schedule.num_ctas)
    begin = {s.cta: s.begin_ns for s in trace.cta_spans}
    sm = {s.cta: s.sm for s in trace.cta_spans}
    end: dict[int, int] = {}
    merges = np.zeros(schedule.num_ctas, dtype=np.int64)
    for t in trace.tasks:
        if t.kind in _WORK:
            end[t.cta] = max(end.get(t.cta, 0), t.end_ns)
            merges[t.cta] += t.kind in _MERGES
    ctas = np.array(sorted(c for c in end if c in begin and c < schedule.num_ctas and items[c] > 0), dtype=np.int64)
    t, i, m = tokens[ctas].astype(np.float64), items[ctas].astype(np.float64), merges[ctas].astype(np.float64)
    mean = (lambda v: np.full(len(ctas), v.mean() if len(v) else 0.0))
    return CtaSamples(t, i, m, np.array([sm[c] for c in ctas], dtype=np.int64),
                      np.array([end[c] - begin[c] for c in ctas], dtype=np.float64),
                      np.full(len(ctas), launch, dtype=np.int64), mean(t), mean(i), mean(m))


def plan_samples(schedule: Schedule) -> CtaSamples:
    """A plan's per-CTA features before it runs (times NaN): tokens, items, and one merge per split unit on
    the CTA of its last piece; what `CostFit.predict` needs to say how long each CTA will take."""
    it = schedule.items()
    W = schedule.num_ctas
    tokens = np.bincount(it["cta"], weights=it["kv_end"] - it["kv_begin"], minlength=W).astype(np.float64)
    items = np.bincount(it["cta"], minlength=W).astype(np.float64)
    split = it["slot"] >= 0
    last = dict(zip(it["unit"][split].tolist(), it["cta"][split].tolist()))   # (items run in order: the last wins)
    merges = np.bincount(np.array(list(last.values()), dtype=np.int64), minlength=W).astype(np.float64)
    ctas = np.flatnonzero(items)
    t, i, m = tokens[ctas], items[ctas], merges[ctas]
    n = len(ctas)
    return CtaSamples(t, i, m, ctas.astype(np.int64), np.full(n, np.nan), np.zeros(n, dtype=np.int64),
                      np.full(n, t.mean() if n else 0.0), np.full(n, i.mean() if n else 0.0),
                      np.full(n, m.mean() if n else 0.0))


def predicted_launch_ns(fit: "CostFit", schedule: Schedule) -> float:
    """The launch's predicted time: its slowest CTA's."""
    return float(fit.predict(plan_samples(schedule)).max())


def concat(samples: list[CtaSamples]) -> CtaSamples:
    return CtaSamples(**{f.name: np.concatenate([getattr(s, f.name) for s in samples]) for f in fields(CtaSamples)})


@dataclass(frozen=True)
class CostFit:
    """time_ns = speed[sm] * (per_token_ns * tokens + per_item_ns * items + per_merge_ns * merges + fixed_ns
    + mix_token_ns * mix_tokens + mix_item_ns * mix_items + mix_merge_ns * mix_merges); an SM without a factor
    runs at 1."""

    per_token_ns: float
    per_item_ns: float
    per_merge_ns: float
    fixed_ns: float
    sm_speed: dict[int, float] | None = None
    mix_token_ns: float = 0.0
    mix_item_ns: float = 0.0
    mix_merge_ns: float = 0.0

    def predict(self, s: CtaSamples) -> np.ndarray:
        base = (self.per_token_ns * s.tokens + self.per_item_ns * s.items + self.per_merge_ns * s.merges + self.fixed_ns
                + self.mix_token_ns * s.mix_tokens + self.mix_item_ns * s.mix_items + self.mix_merge_ns * s.mix_merges)
        if not self.sm_speed:
            return base
        return base * np.array([self.sm_speed.get(int(sm), 1.0) for sm in s.sm])

    @staticmethod
    def from_dict(d: dict) -> "CostFit":
        """A fit as `dataclasses.asdict` wrote it (JSON: SM ids as strings)."""
        if not isinstance(d, dict):
            raise ValueError(f"not a CostFit: expected a dict, got {type(d).__name__}")
        names = {f.name for f in fields(CostFit)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"not a CostFit: unknown fields {sorted(unknown)}")
        required = [f.name for f in fields(CostFit) if f.name not in ("sm_speed", "mix_token_ns", "mix_item_ns",
                                                                       "mix_merge_ns")]
        if missing := [n for n in required if n not in d]:
            raise ValueError(f"not a CostFit: missing fields {missing}")
        numbers = {n: check_finite(f"CostFit.{n}", v) for n, v in d.items() if n != "sm_speed"}
        sm = d.get("sm_speed")
        if sm is not None and not isinstance(sm, dict):
            raise ValueError(f"CostFit.sm_speed must be a dict of SM -> factor, got {sm!r:.80}")
        try:
            speeds = {int(k): check_finite(f"CostFit.sm_speed[{k!r}]", v) for k, v in sm.items()} if sm else None
        except (TypeError, ValueError) as e:
            raise ValueError(f"CostFit.sm_speed must map SM ids to finite factors: {e}") from None
        return CostFit(**numbers, sm_speed=speeds)

    @property
    def item_overhead_tokens(self) -> float:
        """The item cost in KV-token equivalents: what `DecodeCost.item_overhead_tokens` holds."""
        if not self.per_token_ns > 0:
            raise ValueError(f"item_overhead_tokens needs a positive per_token_ns, got {self.per_token_ns!r}")
        return self.per_item_ns / self.per_token_ns


def errors(fit: CostFit, s: CtaSamples) -> np.ndarray:
    """|predicted - measured| / measured, per sample."""
    return np.abs(fit.predict(s) - s.time_ns) / s.time_ns


def _huber_lstsq(X: np.ndarray, y: np.ndarray, k: float = 1.345, iters: int = 50) -> np.ndarray:
    """Coefficients of y ~ X under Huber's loss (scale from the median absolute residual)."""
    w = np.ones(len(y))
    beta = np.zeros(X.shape[1])
    for _ in range(iters):
        sw = np.sqrt(w)
        new = np.linalg.lstsq(X * sw[:, None], y * sw, rcond=None)[0]
        r = y - X @ new
        scale = 1.4826 * np.median(np.abs(r - np.median(r))) or 1.0
        a = np.abs(r) / (k * scale)
        w = np.where(a <= 1, 1.0, 1.0 / np.maximum(a, 1e-12))
        done = np.allclose(new, beta, rtol=1e-9, atol=1e-12)
        beta = new
        if done:
            break
    return beta


def _check(s: CtaSamples, need: int) -> None:
    if not isinstance(s, CtaSamples):
        raise ValueError(f"expected CtaSamples (cta_samples, concat), got {type(s).__name__}")
    if len(s) < need:
        raise ValueError(f"need at least {need} CTA samples to fit, got {len(s)}")
    if not np.all(np.isfinite(s.time_ns)) or np.any(s.time_ns <= 0):
        raise ValueError("measured CTA times must be finite and positive")


def fit_cost(s: CtaSamples, per_sm: bool = False, mix: bool = False, rounds: int = 5) -> CostFit:
    """The robust fit of the four constants, with `mix` the three launch-mix terms too (the samples must
    come from launches of at least four different mixes), and with `per_sm` one speed factor per SM
    (median 1), alternating: the constants on times divided by the speeds, then each SM's median ratio of
    measured to predicted time."""
    check_positive("rounds", rounds)
    _check(s, 8)
    cols = [s.tokens, s.items, s.merges, np.ones(len(s))]
    if mix:
        mixes = len(np.unique(np.stack([s.mix_tokens, s.mix_items, s.mix_merges], axis=1), axis=0))
        if mixes < 4:
            raise ValueError(f"fitting the launch-mix terms needs launches of at least 4 different mixes, got {mixes}")
        cols += [s.mix_tokens, s.mix_items, s.mix_merges]
    X = np.stack(cols, axis=1)
    speed = np.ones(len(s))
    sm_speed: dict[int, float] | None = None
    for _ in range(rounds if per_sm else 1):
        beta = _huber_lstsq(X, s.time_ns / speed)
        if not per_sm:
            break
        ratio = s.time_ns / (X @ beta)
        sm_speed = {int(sm): float(np.median(ratio[s.sm == sm])) for sm in np.unique(s.sm)}
        norm = float(np.median(list(sm_speed.values())))
        sm_speed = {sm: v / norm for sm, v in sm_speed.items()}
        speed = np.array([sm_speed[int(sm)] for sm in s.sm])
    return CostFit(*(float(b) for b in beta[:4]), sm_speed=sm_speed, **(
        dict(zip(("mix_token_ns", "mix_item_ns", "mix_merge_ns"), (float(b) for b in beta[4:]))) if mix else {}))


def today(s: CtaSamples, cost: DecodeCost) -> CostFit:
    """The shipped model, time proportional to tokens + cost.item_overhead_tokens per item, with only its
    scale fitted (the median ratio of measured time to predicted cost)."""
    _check(s, 1)
    units = s.tokens + cost.item_overhead_tokens * s.items
    if not np.all(units > 0):
        raise ValueError(f"every CTA sample needs planned work (tokens + item_overhead_tokens * items > 0) to "
                         f"scale the shipped model, got {float(units.min())!r}")
    scale = float(np.median(s.time_ns / units))
    return CostFit(scale, scale * cost.item_overhead_tokens, 0.0, 0.0)
