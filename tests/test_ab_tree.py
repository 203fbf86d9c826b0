"""bench/ab_tree.py: an A/B worker runs the package of its own tree, or stops; rounds alternate the sides."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.ab_tree import medians, run_rounds, use_tree  # noqa: E402


def test_a_missing_tree_stops_the_worker_naming_it(tmp_path):
    with pytest.raises(SystemExit, match="nothere: no meld package there"):
        use_tree(tmp_path / "nothere", REPO)


def test_a_worker_imports_meld_from_its_tree_before_bench_does(tmp_path):
    (tmp_path / "meld").mkdir()
    (tmp_path / "meld" / "__init__.py").write_text("TREE = True\n")
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from bench.ab_tree import worker_tree_first; "
              "from pathlib import Path; worker_tree_first(Path(sys.argv[1])); import meld; print(meld.__file__)")
    res = subprocess.run([sys.executable, "-c", script, str(REPO), "--worker", str(tmp_path)],
                         capture_output=True, text=True, check=True)
    assert Path(res.stdout.strip()) == tmp_path / "meld" / "__init__.py"


def test_rounds_alternate_the_sides_and_a_failed_worker_ends_the_run(tmp_path):
    order = tmp_path / "order"
    write = "import json, sys; open(sys.argv[3], 'a').write(sys.argv[1]); json.dump({'r': int(sys.argv[2])}, open(sys.argv[4], 'w'))"
    runs = run_rounds(["base", "new"], 3, lambda side, r, out: [sys.executable, "-c", write, side, str(r), str(order), out])
    assert order.read_text() == "basenewnewbasebasenew"
    assert runs == {"base": [{"r": 0}, {"r": 1}, {"r": 2}], "new": [{"r": 0}, {"r": 1}, {"r": 2}]}
    fail = "import sys; open(sys.argv[2], 'w').write('{}'); sys.exit(sys.argv[1] == 'new')"
    assert run_rounds(["base", "new"], 2, lambda side, r, out: [sys.executable, "-c", fail, side, out]) is None


def test_medians_are_per_side_case_and_measure():
    runs = {"base": [{"c": {"us": 3.0}}, {"c": {"us": 1.0}}, {"c": {"us": 2.0}}], "new": [{"c": {"us": 5.0}}] * 3}
    assert medians(runs) == {"base": {"c": {"us": 2.0}}, "new": {"c": {"us": 5.0}}}
