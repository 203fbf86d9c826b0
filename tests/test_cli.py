"""meld's command line (CPU only): bad arguments and bad trace files end in one line on stderr and exit
status 2, never a traceback, and bad arguments stop it before any work."""
import json
import struct

import numpy as np
import pytest
import torch

from meld import cli
from meld.runtime.profile import Trace

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
T = 10_000  # kernel start (a non-zero globaltimer origin)


@pytest.fixture
def calls(monkeypatch) -> list:
    """meld.cli.demo replaced by a recorder: the test sees whether, and with what, the work would start."""
    seen = []
    monkeypatch.setattr(cli, "demo", lambda batch, device: seen.append((batch, device)) or 0)
    return seen


def _gpus(monkeypatch, *capabilities) -> None:
    """Pretend this machine has GPUs of these compute capabilities."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(capabilities))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capabilities[i])


def _fails(argv: list[str], capsys, *named: str) -> str:
    """Run meld: it must exit with status 2 and one line on stderr that contains each of `named`.
    Returns what it printed on stdout."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2, err
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, err
    for text in named:
        assert text in err, err
    return out


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--batch", "-5"], ["--batch", "x"], ["--device", "gpu"],
                                  ["--device", "meta"], ["--device", "0"], ["--device", "cuda:x"],
                                  ["--device", "cuda:99"], ["--device", "cuda:-1"]])
def test_demo_rejects_before_work(argv, calls, capsys):
    _fails(["demo", *argv], capsys, f"argument {argv[0]}: '{argv[1]}'")
    assert calls == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_demo_rejects_cuda_without_gpu(calls, capsys):
    _fails(["demo", "--device", "cuda"], capsys, "'cuda'", "(available: cpu)")
    assert calls == []


def test_demo_devices(monkeypatch, calls, capsys):
    _gpus(monkeypatch, (8, 0), (9, 0))  # only the second GPU can run meld's kernels
    for device in ("cuda", "cuda:0", "cuda:2"):
        _fails(["demo", "--device", device], capsys, f"'{device}'", "(available: cpu, cuda:1)")
    assert calls == []
    assert cli.main(["demo", "--device", "cuda:1"]) == 0
    assert cli.main(["demo"]) == 0  # the default is GPU 0, which is not sm_90+
    assert calls == [(64, "cuda:1"), (16, "cpu")]


def test_demo_defaults(monkeypatch, calls):
    _gpus(monkeypatch, (9, 0))
    assert cli.main(["demo"]) == 0
    assert cli.main(["demo", "--device", "cpu", "--batch", "3"]) == 0
    _gpus(monkeypatch)
    assert cli.main(["demo"]) == 0
    assert calls == [(64, "cuda"), (3, "cpu"), (16, "cpu")]


def _trace() -> Trace:
    """SM 0 runs a piece and a merge (busy 0.6 of the 1000 ns span), SM 1 one piece (0.3)."""
    raw = np.zeros((2, 3, 4), np.int64)
    raw[0] = [[T, T + 1000, 0, 2], [T, T + 400, 0, 0], [T + 400, T + 600, 1, 0]]
    raw[1, :2] = [[T + 100, T + 900, 1, 1], [T + 100, T + 400, 0, 1]]
    return Trace.from_buffer(raw, units_per_request=1, head_blocks=1)


def _png_width(path) -> int:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    return struct.unpack(">I", data[16:20])[0]


def test_timeline(tmp_path, capsys):
    path = _trace().write_chrome(tmp_path / "run.json")
    assert cli.main(["timeline", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("span 1.000 µs, 2 SMs, 2 CTAs, SM busy min 0.300 mean 0.450")
    assert out[3] == "least busy: SM 1 0.300, SM 0 0.600"
    assert out[4] == f"wrote {tmp_path / 'run.png'}"
    assert _png_width(tmp_path / "run.png") == 1600
    argv = ["timeline", str(path), "-o", str(tmp_path / "b.png"), "--width", "11", "--row-height", "1"]
    assert cli.main(argv) == 0
    assert _png_width(tmp_path / "b.png") == 11


def _meld(corrupt):
    """A trace file's text: the good trace's JSON after corrupt(obj)."""
    def text() -> str:
        obj = _trace().to_chrome()
        corrupt(obj)
        return json.dumps(obj)
    return text


def _first_task(obj: dict) -> dict:
    return next(e for e in obj["traceEvents"] if e["ph"] == "X")


@pytest.mark.parametrize("text, named", [
    (lambda: '{"traceEvents": [', "not JSON"),
    (lambda: "\x89PNG", "not JSON"),
    (lambda: "[]", "not a meld trace"),
    (lambda: "{}", "not a meld trace"),
    (lambda: '{"traceEvents": []}', "not a meld trace"),
    (_meld(lambda o: o["meld"].pop("ctas")), "meld.ctas is missing"),
    (_meld(lambda o: o.pop("traceEvents")), "traceEvents is missing"),
    (_meld(lambda o: o["meld"].update(base_ns="0")), "meld.base_ns must be an integer, got '0'"),
    (_meld(lambda o: o["meld"]["ctas"][0].pop()), "meld.ctas[0] must be [cta, sm, begin_ns, end_ns, cluster"),
    (_meld(lambda o: _first_task(o).pop("args")), ".args is missing"),
    (_meld(lambda o: _first_task(o)["args"].update(unit=None)), ".args.unit must be an integer, got None"),
    (_meld(lambda o: _first_task(o).update(cat="stall")), "unknown task kind 'stall'"),
])
def test_timeline_rejects_trace(text, named, tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(text())
    assert _fails(["timeline", str(path)], capsys, f"argument TRACE: {path}: ", named) == ""
    assert not (tmp_path / "bad.png").exists()


def test_timeline_rejects_paths(tmp_path, capsys):
    good = str(_trace().write_chrome(tmp_path / "run.json"))
    _fails(["timeline", str(tmp_path / "none.json")], capsys, f"cannot read {tmp_path / 'none.json'}: No such file")
    _fails(["timeline", str(tmp_path)], capsys, f"cannot read {tmp_path}: Is a directory")
    assert _fails(["timeline", good, "-o", str(tmp_path / "no" / "t.png")], capsys,
                  f"argument -o/--output: folder {tmp_path / 'no'} does not exist") == ""
    _fails(["timeline", good, "-o", str(tmp_path)], capsys, f"cannot write {tmp_path}: Is a directory")


@pytest.mark.parametrize("argv", [["--width", "10"], ["--width", "-3"], ["--width", "wide"],
                                  ["--row-height", "0"], ["--row-height", "-1"], ["--row-height", "2.5"]])
def test_timeline_rejects_sizes(argv, tmp_path, capsys):
    good = str(_trace().write_chrome(tmp_path / "run.json"))
    _fails(["timeline", good, *argv], capsys, f"argument {argv[0]}: '{argv[1]}'")
    assert not list(tmp_path.glob("*.png"))


def test_the_old_timeline_script_forwards_to_meld_timeline(tmp_path, capsys):
    """bench/timeline.py TRACE [OUT] keeps working: the positional OUT becomes -o, errors stay one line."""
    from bench.timeline import forward

    assert forward(["t.json", "o.png", "--width", "64"]) == ["timeline", "t.json", "-o", "o.png", "--width", "64"]
    assert forward(["--width", "64", "t.json"]) == ["timeline", "--width", "64", "t.json"]
    path = _trace().write_chrome(tmp_path / "run.json")
    assert cli.main(forward([str(path), str(tmp_path / "old.png"), "--width", "40"])) == 0
    assert _png_width(tmp_path / "old.png") == 40
    _fails(forward([str(tmp_path / "missing.json")]), capsys, "cannot read")
