"""meld.tuning.db: the tuning database round-trips, an entry applies only under its own key, a stale one
(other GPU, driver, CUDA or kernel sources) is ignored with a warning naming what differs, a damaged file
is a clear error, DecodeAttention takes a tuned cost model, and `meld tune --show` says what applies."""
import dataclasses
import json
import shutil
import warnings

import numpy as np
import pytest
import torch

import meld
from meld import cli, config
from meld.ops.base import Operator
from meld.tuning import db as tdb
from meld.tuning.db import TuningDB, TuningEntry, TuningKey, source_hash
from meld.tuning import recorder as rec
from meld.tuning.tune import BatchResult, Candidate, bootstrap_ratio, candidates, decide, recorded_batches
from meld.workloads import lengths, paged

KEY = TuningKey("decode_attention", "bfloat16", "Hq32/Hkv8/D128/P16/C1", "NVIDIA H200", 132, "13.0", "13.0",
                source_hash())


def _db(tmp_path, *entries) -> TuningDB:
    db = TuningDB(tmp_path / "tuning.json")
    for e in entries:
        db.put(e)
    db.save()
    return TuningDB.load(db.path)


def test_round_trip_and_replacement(tmp_path):
    a = TuningEntry(KEY, {"cost": {"item_overhead_tokens": 64}}, {"default_us": 232.1, "tuned_us": 229.0})
    b = TuningEntry(dataclasses.replace(KEY, shape="Hq64/Hkv8/D128/P16/C1"), {"cost": {"round_tokens": 256}})
    db = _db(tmp_path, a, b)
    assert [e.key for e in db.entries] == [a.key, b.key] and db.entries[0].evidence == a.evidence
    db.put(TuningEntry(KEY, {"cost": {"item_overhead_tokens": 96}}))
    db.save()
    again = TuningDB.load(db.path)
    assert len(again.entries) == 2 and again.lookup(KEY).config == {"cost": {"item_overhead_tokens": 96}}
    assert not list(tmp_path.glob("*.tmp"))   # written through a temporary file renamed over it


@pytest.mark.parametrize("field,value", [("gpu", "NVIDIA H100 80GB HBM3"), ("sm_count", 114), ("driver", "12.8"),
                                         ("cuda", "12.8"), ("source_hash", "0123456789abcdef")])
def test_a_stale_entry_is_ignored_with_a_warning(tmp_path, field, value):
    db = _db(tmp_path, TuningEntry(dataclasses.replace(KEY, **{field: value}), {"cost": {"item_overhead_tokens": 64}}))
    with pytest.warns(UserWarning, match=rf"entry is ignored, it was recorded with {field} {value!r} \(here "):
        assert db.lookup(KEY) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert db.lookup(dataclasses.replace(KEY, shape="Hq8/Hkv8/D64/P16/C1")) is None   # another shape: silent


def test_damaged_files_are_clear_errors(tmp_path):
    p = tmp_path / "t.json"
    for text, why in [("{", "not readable"), (json.dumps({"version": 7, "entries": []}), "version 7"),
                      (json.dumps({"version": 1, "entries": [{"key": {"operator": "x"}, "config": {}}]}),
                       "an entry's key has fields")]:
        p.write_text(text)
        with pytest.raises(ValueError, match=rf"tuning database {p} is not readable: .*{why}" if why != "not readable"
                           else rf"tuning database {p} is not readable"):
            TuningDB.load(p)
    assert TuningDB.load(tmp_path / "missing.json").entries == []


def test_source_hash_follows_the_kernel_templates(tmp_path, monkeypatch):
    copy = tmp_path / "templates"
    shutil.copytree(tdb._TEMPLATES, copy)
    monkeypatch.setattr(tdb, "_TEMPLATES", copy)
    tdb.source_hash.cache_clear()
    try:
        same = source_hash()
        (copy / "common.cuh").write_text((copy / "common.cuh").read_text() + "\n// changed\n")
        tdb.source_hash.cache_clear()
        assert same == KEY.source_hash != source_hash()
    finally:
        tdb.source_hash.cache_clear()


def test_decode_attention_takes_the_tuned_cost(monkeypatch):
    """The operator applies its entry's cost and kernel fields (here through a stand-in lookup: on the CPU
    executor the database is not read, there being no GPU to key it by); a field DecodeCost or
    DecodeKernelConfig lacks is a clear error."""
    entry = TuningEntry(KEY, {"cost": {"item_overhead_tokens": 64, "min_split_tokens": 256},
                              "kernel": {"num_stages": 3}})
    seen = []
    monkeypatch.setattr(Operator, "_tuned", lambda self, dtype, shape: seen.append((dtype, shape)) or entry)
    attn = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cpu")
    assert seen == [("bfloat16", "Hq32/Hkv8/D128/P16/C1")] and attn.tuning is entry
    assert (attn.cost.item_overhead_tokens, attn.cost.min_split_tokens, attn.cost.round_tokens) == (64, 256, 128)
    assert (attn.kernel_config.num_warps, attn.kernel_config.num_stages) == (8, 3)
    own = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cpu", cost=meld.scheduler.DecodeCost())
    assert own.tuning is None and own.cost.item_overhead_tokens == 128   # a cost given is kept
    given = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cpu",
                                 kernel_config=meld.codegen.DecodeKernelConfig.default("bfloat16", 128))
    assert given.tuning is None and given.kernel_config.num_stages == 2   # a kernel given is kept
    entry.config["kernel"] = {"stages": 3}
    with pytest.raises(ValueError, match=r"entry's kernel \{'stages': 3\} is not a DecodeKernelConfig"):
        meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cpu")
    entry.config["kernel"] = {"num_stages": 1}
    with pytest.raises(ValueError, match="num_stages=1"):
        meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cpu")
    del entry.config["kernel"]
    entry.config["cost"] = {"item_overhead": 64}
    with pytest.raises(ValueError, match=r"entry's cost \{'item_overhead': 64\} is not a DecodeCost"):
        meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cpu")


def test_the_cpu_executor_reads_no_database(tmp_path):
    db = _db(tmp_path, TuningEntry(KEY, {"cost": {"item_overhead_tokens": 64}}))
    with config.scope(MELD_TUNING_DB=str(db.path)):
        attn = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cpu")
    assert attn.tuning is None and attn.cost.item_overhead_tokens == 128


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the entries are compared with the GPU")
def test_cli_tune_show(tmp_path, capsys):
    stale = dataclasses.replace(KEY, source_hash="0123456789abcdef", shape="Hq64/Hkv8/D128/P16/C1")
    db = _db(tmp_path, TuningEntry(KEY, {"cost": {"item_overhead_tokens": 64}}, {"tuned_us": 229.0}),
             TuningEntry(stale, {"cost": {"round_tokens": 256}}))
    assert cli.main(["tune", "--show", "--db", str(db.path)]) == 0
    out = capsys.readouterr().out
    assert f"tuning database {db.path}: 2 entries" in out and '"tuned_us": 229.0' in out
    assert "kernel sources match; no GPU here to compare the rest" in out
    assert "ignored by this meld: source_hash '0123456789abcdef'" in out
    with pytest.raises(SystemExit) as exc, config.scope(MELD_TUNING_DB=""):
        cli.main(["tune", "--show"])
    assert exc.value.code == 2 and "MELD_TUNING_DB is not set" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_decode_attention_reads_the_database(tmp_path):
    here = TuningKey.here("decode_attention", "bfloat16", "Hq32/Hkv8/D128/P16/C1", torch.device("cuda"))
    db = _db(tmp_path, TuningEntry(here, {"cost": {"item_overhead_tokens": 64}}),
             TuningEntry(dataclasses.replace(here, shape="Hq16/Hkv8/D128/P16/C1", gpu="other"), {"cost": {}}))
    with config.scope(MELD_TUNING_DB=str(db.path)):
        attn = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cuda")
        assert attn.tuning.key == here and attn.cost.item_overhead_tokens == 64
        with pytest.warns(UserWarning, match="recorded with gpu 'other'"):
            other = meld.DecodeAttention(16, 8, 128, 16, torch.bfloat16, "cuda")
    assert other.tuning is None and other.cost.item_overhead_tokens == 128


# --- meld tune: the decision ------------------------------------------------------------------------------
def _batch(name, **ratios):
    return BatchResult(name, {"default": 100.0, **{k: 100.0 * v[0] for k, v in ratios.items()}},
                       {"default": (1.0, 1.0, 1.0), **ratios})


def test_adopted_only_when_faster_beyond_the_noise_and_never_slower():
    fast_somewhere = (0.97, 0.95, 0.99)
    within_noise = (0.995, 0.98, 1.01)
    slower = (1.02, 1.01, 1.03)
    geo, adopted = decide([_batch("a", x=fast_somewhere, y=within_noise, z=fast_somewhere),
                           _batch("b", x=within_noise, y=within_noise, z=slower)])
    assert adopted == "x" and geo["x"] == pytest.approx((0.97 * 0.995) ** 0.5)
    assert decide([_batch("a", y=within_noise), _batch("b", y=within_noise)])[1] is None
    assert decide([_batch("a", z=fast_somewhere), _batch("b", z=slower)])[1] is None
    both = decide([_batch("a", x=fast_somewhere, w=(0.9, 0.88, 0.92)), _batch("b", x=within_noise, w=within_noise)])
    assert both[1] == "w"   # the best geometric mean among the adoptable


def test_bootstrap_interval_and_candidates():
    rng = np.random.default_rng(0)
    a = rng.normal(100, 1, 50)
    r, lo, hi = bootstrap_ratio(a, a * 0.9)
    assert lo <= r <= hi < 0.95 and r == pytest.approx(0.9, rel=1e-9)
    r, lo, hi = bootstrap_ratio(a, rng.normal(100, 1, 50))
    assert lo < 1.0 < hi
    c = candidates(meld.scheduler.DecodeCost())
    assert c["default"].cost == meld.scheduler.DecodeCost() and c["default"].kernel_config() is None
    assert "item_overhead_tokens=64" in c
    assert all(v.cost.item_overhead_tokens != 128 for k, v in c.items() if k.startswith("item_overhead"))
    kernels = {k: v.kernel_config() for k, v in c.items() if v.kernel}
    assert set(kernels) == {"num_stages=3", "tma=True", "num_warps=4,num_stages=4"}
    assert kernels["num_warps=4,num_stages=4"].name == "meld_decode_attention_bf16_d128_w4_s4"
    assert all(c[k].cost == meld.scheduler.DecodeCost() for k in kernels)   # kernel variants keep the default cost


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cli_tune_needs_a_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["tune", "--workload", "bench", "--db", str(tmp_path / "t.json")])
    assert exc.value.code == 2 and "tuning measures on a GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_measure_times_every_candidate_on_every_batch():
    from meld.tuning.tune import measure

    cost = meld.scheduler.DecodeCost()
    res = measure({"default": Candidate(cost), "item_overhead_tokens=64": Candidate(dataclasses.replace(cost, item_overhead_tokens=64)),
                   "num_stages=3": Candidate(cost, {"num_stages": 3})},
                  [("B=64 skewed", lengths("skewed", 64)), ("B=8 one-long", lengths("one-long", 8))], rounds=2, reps=4)
    assert [b.name for b in res] == ["B=64 skewed", "B=8 one-long"]
    for b in res:
        assert b.ratio["default"][0] == 1.0 and all(v > 0 for v in b.median_us.values())
        for name in ("item_overhead_tokens=64", "num_stages=3"):
            r, lo, hi = b.ratio[name]
            assert lo <= r <= hi and 0.5 < r < 2


# --- the workload recorder ----------------------------------------------------------------------------------
def test_plan_records_one_batch_in_every(tmp_path):
    """MELD_RECORD: plan() appends one batch in MELD_RECORD_EVERY (its KV lengths, operator and shape);
    a plan() that raises records and counts nothing."""
    path = tmp_path / "workload.jsonl"
    batches = [lengths("ragged", 9), lengths("skewed", 5), [7, 0, 300], lengths("one-long", 3), [16, 17]]
    with config.scope(MELD_RECORD=str(path), MELD_RECORD_EVERY="2"):
        attn = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cpu")
        for lens in batches:
            t = paged(lens, 16)
            attn.plan(t.kv_indptr, t.kv_indices, t.kv_last_page_len)
            with pytest.raises(ValueError):
                attn.plan(t.kv_indptr, t.kv_indices, t.kv_last_page_len + 100)
    assert rec.load(path, "decode_attention", "Hq32/Hkv8/D128/P16/C1") == [batches[0], batches[2], batches[4]]
    assert rec.load(path, "decode_attention", "Hq8/Hkv8/D64/P16/C1") == []
    with open(path, "a") as f:
        f.write("not json\n")
    with pytest.raises(ValueError, match=rf"{path}:4 is not a workload record"):
        rec.load(path, "decode_attention", "Hq32/Hkv8/D128/P16/C1")
    with config.scope(MELD_RECORD=str(path), MELD_RECORD_EVERY="0"), pytest.raises(ValueError, match="must be >= 1"):
        rec.recorder()


def test_recorded_batches_spread_over_their_sizes(tmp_path):
    path = tmp_path / "w.jsonl"
    r = rec.WorkloadRecorder(path, 1)
    for n in range(1, 21):
        r.record("decode_attention", "Hq32/Hkv8/D128/P16/C1", [100 * n] * (n % 4 + 1))
    r.record("decode_attention", "Hq32/Hkv8/D128/P16/C1", [0, 0])
    picked = recorded_batches(path, most=4)
    totals = [sum(lens) for _, lens in picked]
    assert len(picked) == 4 and totals == sorted(totals) and totals[0] > 0
    assert totals[0] == min(100 * n * (n % 4 + 1) for n in range(1, 21))
    assert totals[-1] == max(100 * n * (n % 4 + 1) for n in range(1, 21))
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="holds no recorded decode_attention batch"):
        recorded_batches(empty)


def test_cli_tune_workload_arguments(tmp_path, capsys):
    for workload, why in [("recorded:" + str(tmp_path / "missing.jsonl"), "is not a file"), ("bnech", "is not 'bench'")]:
        with pytest.raises(SystemExit) as exc:
            cli.main(["tune", "--workload", workload, "--db", str(tmp_path / "t.json")])
        assert exc.value.code == 2 and why in capsys.readouterr().err
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit) as exc:
        cli.main(["tune", "--workload", f"recorded:{empty}", "--db", str(tmp_path / "t.json")])
    assert exc.value.code == 2 and "holds no recorded" in capsys.readouterr().err


def test_a_recording_that_fails_never_fails_the_plan(tmp_path):
    """A file that cannot be written: one warning, the plan goes through, recording stops."""
    attn = meld.DecodeAttention(32, 8, 128, 16, torch.bfloat16, "cpu")
    u = paged([300, 1, 90], 16)
    with config.scope(MELD_RECORD=str(tmp_path / "no-such-dir" / "w.jsonl"), MELD_RECORD_EVERY="1"):
        with pytest.warns(UserWarning, match="cannot append batches .*recording stops"):
            attn.plan(u.kv_indptr, u.kv_indices, u.kv_last_page_len)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            attn.plan(u.kv_indptr, u.kv_indices, u.kv_last_page_len)
    assert attn.schedule.kv_len.tolist() == [300, 1, 90]


def test_tune_records_the_adopted_kernel_fields(tmp_path, monkeypatch):
    """tune() on measurements where a kernel variant wins: its kernel fields go to the database beside the cost
    fields it changes (none), with the evidence (measurements and the machine's key stand in: no GPU here)."""
    from meld.tuning import tune as tmod

    def fake_measure(cands, batches, **kw):
        assert {"default", "num_stages=3", "tma=True"} <= set(cands)
        ratios = {k: (0.95, 0.93, 0.97) if k == "num_stages=3" else (1.0, 0.99, 1.01) for k in cands if k != "default"}
        return [_batch(name, **ratios) for name, _ in batches]

    monkeypatch.setattr(tmod, "measure", fake_measure)
    monkeypatch.setattr(tdb.TuningKey, "here", staticmethod(lambda op, dt, shape, dev: dataclasses.replace(KEY, shape=shape)))
    res = tmod.tune(tmp_path / "t.json", [("B=64 skewed", lengths("skewed", 64))], "bench", device="cpu")
    assert res.adopted == "num_stages=3"
    (entry,) = TuningDB.load(tmp_path / "t.json").entries
    assert entry.config == {"cost": {}, "kernel": {"num_stages": 3}}
    assert entry.evidence["batches"]["B=64 skewed"]["ratio_ci95"] == [0.95, 0.93, 0.97]


def test_a_fitted_model_prunes_the_planner_candidates(tmp_path, monkeypatch):
    """With a fit, the planner constants are searched on the fine grid, planned on the host and ranked by the
    predicted launch time; only the `keep` best are measured, beside the default and the kernel variants.
    A model where items cost 1000 tokens keeps the largest item overheads, one where they are free the
    smallest."""
    from meld.tuning import CostFit
    from meld.tuning import tune as tmod

    cands = candidates(meld.scheduler.DecodeCost(), tmod.FINE_ITEM_OVERHEADS)
    batches = tmod.bench_batches()
    costly, free = CostFit(10.0, 10000.0, 0.0, 0.0), CostFit(10.0, 0.0, 0.0, 0.0)
    for fit, want in ((costly, {"item_overhead_tokens=256", "item_overhead_tokens=240"}),
                      (free, {"item_overhead_tokens=32", "item_overhead_tokens=48"})):
        kept = tmod.prune(cands, fit, batches, keep=2)
        assert set(kept) == {"default", *want, "num_stages=3", "tma=True", "num_warps=4,num_stages=4"}
        pred = tmod.predicted_ratios(fit, cands, batches, 132)
        assert pred["default"] == 1.0 and max(pred[k] for k in want) < min(v for k, v in pred.items() if k not in want)
    with pytest.raises(ValueError, match="keep=0"):
        tmod.prune(cands, costly, batches, keep=0)

    seen = []

    def fake_measure(cands, batches, **kw):
        seen.append(set(cands))
        return [_batch(name, **{k: (1.0, 0.99, 1.01) for k in cands if k != "default"}) for name, _ in batches]

    monkeypatch.setattr(tmod, "measure", fake_measure)
    res = tmod.tune(tmp_path / "t.json", batches[:2], "bench", device="cpu", fit=costly, keep=3, sm_count=132)
    assert res.adopted is None and len(seen[0]) == 1 + 3 + 3


def test_cli_tune_fit_argument(tmp_path, capsys):
    bad = tmp_path / "fit.json"
    bad.write_text('{"fits": {"today": {}}}')
    for path, why in [(tmp_path / "missing.json", "No such file"), (bad, "neither 'fit+mix' nor 'fit'")]:
        with pytest.raises(SystemExit) as exc:
            cli.main(["tune", "--workload", "bench", "--fit", str(path), "--db", str(tmp_path / "t.json")])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "argument --fit" in err and why in err
    with pytest.raises(SystemExit) as exc:
        cli.main(["tune", "--workload", "bench", "--keep", "0", "--db", str(tmp_path / "t.json")])
    assert exc.value.code == 2 and "--keep" in capsys.readouterr().err
