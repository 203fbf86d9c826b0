"""The A/B scripts (bench/*_ab.py) on the CPU: the command line each hands its worker processes parses with the
script's own parser and reaches its worker (a worker that cannot parse its arguments fails only on the GPU
machine, after the device time is spent: cascade_ab.py's worker once lacked the required --base)."""
import importlib
import sys

import pytest

SCRIPTS = {   # script -> the arguments of a base-against-this-tree run
    "decode_ab": ["--base", "BASE", "--q-len", "4", "--batch", "8"],
    "cascade_ab": ["--base", "BASE", "--cases", "0", "1"],
    "cascade_ab w4": ["--base", "BASE", "--cases", "0", "--new-op", "warps=4", "prefix_mma=mma"],
    "mla_ab": ["--base", "BASE", "--batches", "16", "--dists", "skewed"],
    "mla_ab fp8": ["--base", "BASE", "--batches", "16", "--dists", "skewed", "--kv-dtype", "fp8"],
    "mla_ab seesaw": ["--base", "BASE", "--batches", "16", "--dists", "skewed", "--schedule", "seesaw"],
    "mla_ab b32": ["--base", "BASE", "--batches", "16", "--dists", "skewed", "--block-tokens", "32"],
    "mla_ab halves": ["--base", "BASE", "--batches", "16", "--dists", "skewed", "--schedule", "split",
                      "--new-schedule", "halves"],
    "mla_ab fp8 s3": ["--base", "BASE", "--batches", "16", "--dists", "skewed", "--kv-dtype", "fp8",
                      "--new-num-stages", "3"],
    "moe_ab": ["--base-tree", "BASE", "--tokens", "1", "16"],
    "moe_ab fp8": ["--base-tree", "BASE", "--tokens", "128", "--fp8"],
    "tp_ab": ["--base", "BASE", "--world", "1"],
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_worker_command_lines_parse_and_reach_the_worker(name, monkeypatch, tmp_path):
    mod = importlib.import_module(f"bench.{name.split()[0]}")
    commands = []

    def fake_rounds(sides, rounds, command):   # capture each side's first-round worker command; run nothing
        commands.extend(command(side, 0, str(tmp_path / f"{side}.json")) for side in sides)
        return None

    monkeypatch.setattr(mod, "run_rounds", fake_rounds)
    monkeypatch.setattr(sys, "argv", [mod.__file__, *SCRIPTS[name]])
    assert mod.main() == 1   # (run_rounds returned None: a failed worker)
    assert len(commands) == 2
    calls = []

    def fake_worker(*args, **kw):
        calls.append(args)
        return {}

    monkeypatch.setattr(mod, "worker", fake_worker)
    for cmd in commands:
        assert cmd[0] == sys.executable and cmd[1] == mod.__file__ and "--worker" in cmd
        monkeypatch.setattr(sys, "argv", cmd[1:])
        assert mod.main() == 0, cmd
    assert len(calls) == 2
    if name.startswith("mla_ab"):   # the worker times the build asked for: (..., kv_dtype, schedule, block_tokens,
        # num_stages), the new side's stage count and schedule on the new side only
        want = {"mla_ab": ("bf16", "", 0), "mla_ab fp8": ("fp8", "", 0),
                "mla_ab seesaw": ("bf16", "seesaw", 0), "mla_ab b32": ("bf16", "", 32),
                "mla_ab fp8 s3": ("fp8", "", 0), "mla_ab halves": ("bf16", "split", 0)}
        new = ("bf16", "halves", 0) if name.endswith("halves") else want[name]
        assert [c[-4:-1] for c in calls] == [want[name], new], calls
        assert [c[-1] for c in calls] == ([0, 3] if name.endswith("s3") else [0, 0]), calls
    if name.startswith("cascade_ab"):   # the new side's CascadeDecode keywords, the base side's none
        want = {"warps": 4, "prefix_mma": "mma"} if name.endswith("w4") else {}
        assert [c[-1] for c in calls] == [{}, want], calls
    if name == "moe_ab fp8":   # the FP8 experts on both sides
        assert all(c[-1] is True for c in calls)


def test_report_prints_the_ratio_of_each_case_and_writes_every_round(tmp_path, capsys):
    from bench.ab_tree import report_new_over_base

    runs = {"base": [{"c": {"t": 10.0}}, {"c": {"t": 12.0}}], "new": [{"c": {"t": 9.0}}, {"c": {"t": 13.0}}]}
    report_new_over_base(runs, "t", 2, tmp_path / "ab.json")
    out = capsys.readouterr().out
    assert "11.0" in out and "1.000" in out and "medians over 2 alternating rounds" in out
    doc = __import__("json").loads((tmp_path / "ab.json").read_text())
    assert doc["runs"] == runs and doc["median"] == {"base": {"c": {"t": 11.0}}, "new": {"c": {"t": 11.0}}}


def test_mla_ab_times_the_also_trees_in_the_same_rounds(monkeypatch, tmp_path):
    """--also NAME=TREE: each tree is one more side of the rounds, its worker on its own tree; a tree without a
    package, or a taken name, stops the run before any worker runs."""
    from pathlib import Path

    import bench.mla_ab as mod

    repo = str(Path(mod.__file__).resolve().parents[1])
    sides = []
    monkeypatch.setattr(mod, "run_rounds", lambda s, rounds, command: sides.append(
        {side: command(side, 0, str(tmp_path / side)) for side in s}))
    monkeypatch.setattr(sys, "argv", [mod.__file__, "--base", "BASE", "--batches", "16", "--also", f"x={repo}"])
    assert mod.main() == 1
    cmds = sides[0]
    assert list(cmds) == ["base", "new", "x"]
    tree = {side: cmd[cmd.index("--worker") + 1] for side, cmd in cmds.items()}
    assert tree == {"base": "BASE", "new": repo, "x": repo}
    for bad in (f"base={repo}", str(tmp_path / "none"), f"y={tmp_path}"):
        monkeypatch.setattr(sys, "argv", [mod.__file__, "--base", "BASE", "--also", bad])
        with pytest.raises(SystemExit, match="--also"):
            mod.main()


def test_report_gives_each_other_side_its_ratio_to_the_base(capsys):
    from bench.ab_tree import report_new_over_base

    runs = {"base": [{"c": {"t": 10.0}}], "new": [{"c": {"t": 9.0}}], "q": [{"c": {"t": 12.0}}]}
    report_new_over_base(runs, "t", 1, None)
    out = capsys.readouterr().out
    assert "q/base" in out and "0.900" in out and "1.200" in out and "new/base, q/base > 1" in out
